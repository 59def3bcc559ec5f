"""MiniCPM-V 4.6's and 4.7's processor output cut into items (`vitpool.items_from`; both records
name this cutter).

MiniCPM-V 4.7 has no image processor of its own: transformers maps `minicpmv4_7` to MiniCPM-V
4.6's (`MiniCPMV4_6ImageProcessorPil`, `MiniCPMV4_6ImageProcessor`; videos `MiniCPMV4_6VideoProcessor`),
and `MiniCPMV4_7Processor` is 4.6's processor that also returns `mm_token_type_ids` by default. The
image processor packs every slice of every image side by side into one strip `pixel_values`
[1, C, P, N*P], with one `target_sizes` row (h, w) per slice (an image's overview, then its refined
slices row by row), and says how many slices each image has: `num_patches_per_image` (and `grids`,
each image's rows x columns of refined slices). The full processor drops both (its
`unused_input_names`) and adds the prompt: `input_ids`, `attention_mask`, `mm_token_type_ids`. Its
`target_sizes` rows then do not say where one image ends.

An item is one image: its slices' columns of the strip and their `target_sizes` rows, as the
processor gives them for that image alone. What cutting needs is each image's slice count, taken
- from `num_patches_per_image`, where the batch holds it (the image processor's output);
- else from the prompt, `input_ids` with `mm_token_type_ids`: the processor writes each image as
  `<image>`, its overview's tokens, `</image>`, then `<slice>`, a refined slice's tokens, `</slice>`
  for each refined slice, so each run of image tokens (type 1) is one slice, in `target_sizes`'
  order, and a run opens an image where the token before it is the one before the batch's first
  run (`<image>`: every image opens with its overview). Every run must hold its slice's h*w/16
  tokens, all other runs must follow one and the same token (`<slice>`), and there must be one run
  per `target_sizes` row: a prompt cut short or written otherwise is refused, not guessed;
- else a ValueError names what is missing and how to get it.

No torch here: slicing works on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from vitpool.families.minicpmv4_6.rules import PATCHES_PER_TOKEN
from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array, int_rows

SLICES_KEY = "num_patches_per_image"
TOKEN_TYPES_KEY = "mm_token_type_ids"
IMAGE_TOKEN_TYPE = 1  # transformers' mm_token_type_ids: 0 text, 1 image, 2 video
HOW_TO_CUT = (
    "MiniCPMV4_6Processor and MiniCPMV4_7Processor drop num_patches_per_image; pass the image processor's "
    "output instead (processor.image_processor(images, return_tensors='pt') keeps it), or the full "
    "processor's output with its input_ids and mm_token_type_ids (return_mm_token_type_ids=True, 4.7's "
    "default), or call the processor one image at a time and make each item Image(out['pixel_values'], "
    "out['target_sizes'])"
)


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image, in the processor's order: its slices' patch columns of the strip and
    its `target_sizes` rows.

    Raises:
        ValueError: a strip that is not [1, C, P, N*P]; no slice count per image (neither
            `num_patches_per_image` nor `input_ids` with `mm_token_type_ids`); or slices, tokens and
            patches that do not add up.
    """
    strip, target_sizes = required(batch, "pixel_values"), required(batch, "target_sizes")
    check_array(strip, "pixel_values")
    patch = patch_size_of(strip)
    sizes = slice_sizes(target_sizes)
    counts = slices_per_image(batch, sizes)
    patches = [h * w for h, w in sizes]
    if sum(patches) * patch != strip.shape[-1]:
        raise ValueError(
            f"pixel_values holds {strip.shape[-1] // patch} patches of {patch} x {patch}; "
            f"the {len(sizes)} target_sizes rows account for {sum(patches)}"
        )
    parts, row, column = [], 0, 0  # the image's first target_sizes row and first patch column
    for count in counts:
        width = sum(patches[row : row + count]) * patch
        pixels, grid = strip[..., column : column + width], target_sizes[row : row + count]
        parts.append(ProcessorItem(IMAGE, pixels, grid))
        row, column = row + count, column + width
    return parts


def required(batch: Mapping[str, Any], key: str) -> Any:
    """`batch[key]`; a ValueError naming the key where it is absent."""
    if batch.get(key) is None:
        raise ValueError(f"the batch has no {key}, which every MiniCPM-V image processor output holds")
    return batch[key]


def patch_size_of(strip: Any) -> int:
    """The strip's patch side P: its height, each patch P columns wide."""
    shape = tuple(strip.shape)
    if len(shape) != 4 or shape[0] != 1 or shape[2] < 1 or shape[3] % shape[2]:
        raise ValueError(
            f"pixel_values has shape {shape}; the processor's strip is [1, C, P, N*P] "
            "(N patches of P x P side by side)"
        )
    return shape[2]


def slice_sizes(target_sizes: Any) -> list[tuple[int, int]]:
    """`target_sizes` [slices, 2] as (h, w) pairs of positive integers."""
    rows = int_rows(target_sizes, "target_sizes")
    if not rows or any(len(row) != 2 or min(row) < 1 for row in rows):
        raise ValueError(f"target_sizes must be one (h, w) row of positive integers per slice; got {rows}")
    return [(h, w) for h, w in rows]


def slices_per_image(batch: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[int]:
    """How many `target_sizes` rows each image has: `num_patches_per_image`, else read from the prompt.

    Raises:
        ValueError: neither is in the batch, or they do not account for the rows.
    """
    if batch.get(SLICES_KEY) is not None:
        counts = slice_counts(batch[SLICES_KEY])
        if sum(counts) != len(sizes):
            raise ValueError(
                f"{SLICES_KEY} {counts} accounts for {sum(counts)} slices; target_sizes has {len(sizes)} rows"
            )
        return counts
    missing = [key for key in ("input_ids", TOKEN_TYPES_KEY) if batch.get(key) is None]
    if missing:
        raise ValueError(
            f"the batch has no {SLICES_KEY} (each image's slice count) and no {' or '.join(missing)} to "
            f"read it from; its {len(sizes)} target_sizes rows alone do not say which image each slice "
            f"belongs to. {HOW_TO_CUT}"
        )
    return slices_from_prompt(batch["input_ids"], batch[TOKEN_TYPES_KEY], sizes)


def slice_counts(value: Any) -> list[int]:
    """A processor's `num_patches_per_image`: one positive whole number per image."""
    numbers = value.tolist() if hasattr(value, "tolist") else value
    is_counts = (
        isinstance(numbers, Sequence)
        and not isinstance(numbers, str)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in numbers)
    )
    if not is_counts or not numbers:
        raise ValueError(f"{SLICES_KEY} must be one positive whole number per image; got {numbers!r}")
    return list(numbers)


def slices_from_prompt(input_ids: Any, token_types: Any, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Each image's slice count from the prompt's runs of image tokens (see the module's opening).

    Raises:
        ValueError: the runs are not one per slice of the right length, or do not follow the
            processor's markers.
    """
    id_rows, type_rows = int_rows(input_ids, "input_ids"), int_rows(token_types, TOKEN_TYPES_KEY)
    if [len(row) for row in id_rows] != [len(row) for row in type_rows]:
        raise ValueError(f"input_ids and {TOKEN_TYPES_KEY} differ in shape")
    runs = []  # (the token before the run, its length), prompt by prompt
    for ids, types in zip(id_rows, type_rows):
        start = 0
        for token_type, run in itertools.groupby(types):
            length = len(list(run))
            if token_type == IMAGE_TOKEN_TYPE:
                runs.append((ids[start - 1] if start else None, length))
            start += length
    if len(runs) != len(sizes):
        raise ValueError(
            f"the prompt holds {len(runs)} runs of image tokens ({TOKEN_TYPES_KEY} == {IMAGE_TOKEN_TYPE}), "
            f"one per slice, and target_sizes {len(sizes)} rows: a prompt cut short, or pixels of another "
            f"prompt. {HOW_TO_CUT}"
        )
    for number, ((_, length), (h, w)) in enumerate(zip(runs, sizes)):
        if length * PATCHES_PER_TOKEN != h * w:
            raise ValueError(
                f"slice {number}'s run of image tokens is {length} long; its target_sizes row ({h}, {w}) "
                f'gives {h} * {w} / {PATCHES_PER_TOKEN} (the "16x" mode vitpool runs). {HOW_TO_CUT}'
            )
    opener = runs[0][0]
    followers = {before for before, _ in runs if before != opener}
    if opener is None or len(followers) > 1:
        raise ValueError(
            "the prompt's image tokens do not follow the processor's markers (<image> before an image's "
            "first slice, <slice> before each other): the tokens before its runs are "
            f"{[before for before, _ in runs]}. {HOW_TO_CUT}"
        )
    counts: list[int] = []
    for before, _ in runs:
        if before == opener:
            counts.append(1)
        else:
            counts[-1] += 1
    return counts
