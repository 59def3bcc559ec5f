"""PaliGemma's processor output cut into items (`vitpool.items_from`), and how a batch is told to be
PaliGemma's.

`SiglipImageProcessor`, PaliGemma's image processor, resizes every image to the one square size of
the checkpoint (224², 448² or 896²) and returns `pixel_values` [images, 3, S, S] and nothing else: an
image is one view, so an item is one row. `PaliGemmaProcessor` adds the prompt's `input_ids`,
`attention_mask` and `token_type_ids`, and always `labels` (it asks the tokenizer for the token types
and derives labels from them).

A batch of `pixel_values` alone names no family by its keys, so PaliGemma's is found only where
nothing else marks the batch (`PaliGemmaProcessorOutput.missing`): a key another family's processor
output holds (`num_crops`, `image_sizes`, `pixel_attention_mask`, ...) makes it that family's, and a
prompt without `labels` is Gemma3Processor's as much as PaliGemma's (Gemma3Processor drops
`num_crops` and returns the same keys), so it is refused rather than cut one view an image.

No torch here: slicing works on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from vitpool.models import processor_items
from vitpool.models.family import ProcessorOutput
from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array

FAMILY = "paligemma"
PIXELS_KEY = "pixel_values"
# What PaliGemmaProcessor returns beside the pixels; `labels` comes with every prompt.
PROMPT_KEY, LABELS_KEY = "input_ids", "labels"
PROMPT_KEYS = (PROMPT_KEY, "attention_mask", "token_type_ids", LABELS_KEY)
NO_LABELS = (
    "the batch holds a prompt (input_ids) without labels, which PaliGemmaProcessor returns with every "
    "prompt: these keys are Gemma3Processor's output too (it drops num_crops), so they do not say whose "
    "views these are; keep labels, or cut the image processor's output "
    "(processor.image_processor(images, return_tensors='pt'))"
)


@dataclass(frozen=True)
class PaliGemmaProcessorOutput(ProcessorOutput):
    """PaliGemma's processor output: `pixel_values`, and a batch is PaliGemma's only where no other
    family's keys mark it and a prompt comes with its `labels` (the module's opening)."""

    def missing(self, keys: Collection[str]) -> tuple[str, ...]:
        """What keeps a batch with `keys` from being PaliGemma's: `pixel_values` where it lacks
        them, else the keys of other families' processors it holds (the cutter refuses them by
        name), else `labels` for a prompt without them; empty where the batch is PaliGemma's."""
        if PIXELS_KEY not in keys:
            return (PIXELS_KEY,)
        foreign = other_families_keys(keys)
        if foreign:
            return tuple(foreign)
        if PROMPT_KEY in keys and LABELS_KEY not in keys:
            return (LABELS_KEY,)
        return ()


def other_families_keys(keys: Collection[str]) -> dict[str, list[str]]:
    """Each of `keys` that another shipped family's processor output holds (not the pixels, not a
    prompt's), with those families' names."""
    return processor_items.other_families_keys(keys, FAMILY, (PIXELS_KEY, *PROMPT_KEYS))


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image: its row of `pixel_values`, [1, 3, S, S].

    Raises:
        ValueError: no `pixel_values`, pixels that are not one tensor [images, channels, S, S],
            keys of another family's processor output (named, with the families), or a prompt
            without its `labels`.
    """
    pixels = batch.get(PIXELS_KEY)
    if pixels is None:
        raise ValueError(f"the batch has no {PIXELS_KEY}")
    check_array(pixels, PIXELS_KEY)
    foreign = other_families_keys(batch.keys())
    if foreign:
        held = "; ".join(f"{key} ({', '.join(names)})" for key, names in sorted(foreign.items()))
        raise ValueError(
            f"the batch holds keys of other families' processor output: {held}; PaliGemma's image "
            f"processor returns {PIXELS_KEY} alone: pass that family's name as family="
        )
    if PROMPT_KEY in batch and LABELS_KEY not in batch:
        raise ValueError(NO_LABELS)
    if len(pixels.shape) != 4:
        raise ValueError(
            f"{PIXELS_KEY} has shape {tuple(pixels.shape)}; PaliGemma's image processor returns one "
            "view an image, [images, channels, height, width]"
        )
    return [ProcessorItem(IMAGE, pixels[index : index + 1]) for index in range(len(pixels))]
