"""MiniCPM-OCR's processor output cut into items (`vitpool.items_from`).

`MiniCPMOcrImageProcessor` is MiniCPM-V 4.6's with another default mode ("4x") and a choice of how
small images and slices are sized (`small_image_upsize`); its output is 4.6's: one strip
`pixel_values` [1, C, P, N*P] of every slice of every image, one `target_sizes` row per slice, and
each image's slice count (`num_patches_per_image`). `MiniCPMOcrProcessor` is 4.6's processor: it
drops the count and writes `h*w / 4` image tokens a slice in "4x" (`h*w / 16` in "16x") between
4.6's markers. So the cut is 4.6's (`vitpool.families.minicpmv4_6.processor`): from
`num_patches_per_image` where the batch holds it, else from the prompt's runs of image tokens
(`input_ids` with `mm_token_type_ids`), whose lengths here give h*w / 4 or h*w / 16, one ratio for
the whole batch (the processor's mode), which this module reads from the runs before 4.6's rules
of the markers apply.

No torch here: slicing works on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from vitpool.families.minicpm_ocr.rules import MERGE_SIDE
from vitpool.families.minicpmv4_6 import processor as processor_4_6
from vitpool.families.minicpmv4_6.processor import IMAGE_TOKEN_TYPE, SLICES_KEY, TOKEN_TYPES_KEY
from vitpool.models.processor_items import ProcessorItem, int_rows

HOW_TO_CUT = (
    "MiniCPMOcrProcessor (as MiniCPMV4_6Processor and MiniCPMV4_7Processor) drops num_patches_per_image; "
    "pass the image processor's output instead (processor.image_processor(images, return_tensors='pt') "
    "keeps it), or the full processor's output with its input_ids and mm_token_type_ids "
    "(return_mm_token_type_ids=True), or call the processor one image at a time and make each item "
    "Image(out['pixel_values'], out['target_sizes'])"
)
PATCHES_PER_TOKEN = {mode: side * side for mode, side in MERGE_SIDE.items()}


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image, in the processor's order: its slices' patch columns of the strip and
    its `target_sizes` rows.

    Raises:
        ValueError: a strip that is not [1, C, P, N*P]; no slice count per image (neither
            `num_patches_per_image` nor `input_ids` with `mm_token_type_ids`); or slices, tokens and
            patches that do not add up.
    """
    if batch.get(SLICES_KEY) is not None:
        return processor_4_6.items(batch)
    target_sizes = processor_4_6.required(batch, "target_sizes")
    processor_4_6.required(batch, "pixel_values")
    sizes = processor_4_6.slice_sizes(target_sizes)
    missing = [key for key in ("input_ids", TOKEN_TYPES_KEY) if batch.get(key) is None]
    if missing:
        raise ValueError(
            f"the batch has no {SLICES_KEY} (each image's slice count) and no {' or '.join(missing)} to "
            f"read it from; its {len(sizes)} target_sizes rows alone do not say which image each slice "
            f"belongs to. {HOW_TO_CUT}"
        )
    counts = slices_from_prompt(batch["input_ids"], batch[TOKEN_TYPES_KEY], sizes)
    return processor_4_6.items({**batch, SLICES_KEY: counts})


def slices_from_prompt(input_ids: Any, token_types: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Each image's slice count from the prompt's runs of image tokens, in either mode.

    Raises:
        ValueError: the runs are not one per slice, their lengths fit neither mode for every slice,
            or they do not follow the processor's markers.
    """
    lengths = run_lengths(input_ids, token_types)
    if len(lengths) != len(sizes):
        raise ValueError(
            f"the prompt holds {len(lengths)} runs of image tokens "
            f"({TOKEN_TYPES_KEY} == {IMAGE_TOKEN_TYPE}), one per slice, and target_sizes {len(sizes)} "
            f"rows: a prompt cut short, or pixels of another prompt. {HOW_TO_CUT}"
        )
    fitting = {
        mode: [length * ratio == h * w for length, (h, w) in zip(lengths, sizes)]
        for mode, ratio in PATCHES_PER_TOKEN.items()
    }
    modes = [mode for mode, fits in fitting.items() if all(fits)]
    if not modes:
        # slice 0 where it fits neither mode, else the first slice that slice 0's mode misses
        first_mode = next((mode for mode, fits in fitting.items() if fits[0]), None)
        number = 0 if first_mode is None else fitting[first_mode].index(False)
        h, w = sizes[number]
        raise ValueError(
            f"slice {number}'s run of image tokens is {lengths[number]} long; its target_sizes row "
            f"({h}, {w}) gives {h} * {w} / 4 in downsample_mode '4x' or {h} * {w} / 16 in '16x', one mode "
            f"for the whole batch: a prompt cut short, or of another mode. {HOW_TO_CUT}"
        )
    # 4.6's reading of the markers, given the slices in its 16x terms (the runs' lengths fit them now)
    side = 4 // MERGE_SIDE[modes[0]]
    as_16x = [(h * side, w * side) for h, w in sizes]
    return processor_4_6.slices_from_prompt(input_ids, token_types, as_16x)


def run_lengths(input_ids: Any, token_types: Any) -> list[int]:
    """The lengths of the prompts' runs of image tokens, prompt by prompt."""
    id_rows, type_rows = int_rows(input_ids, "input_ids"), int_rows(token_types, TOKEN_TYPES_KEY)
    if [len(row) for row in id_rows] != [len(row) for row in type_rows]:
        raise ValueError(f"input_ids and {TOKEN_TYPES_KEY} differ in shape")
    return [
        len(list(run))
        for types in type_rows
        for token_type, run in itertools.groupby(types)
        if token_type == IMAGE_TOKEN_TYPE
    ]
