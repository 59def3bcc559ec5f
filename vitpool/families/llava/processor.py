"""LLaVA's processor output cut into items (`vitpool.items_from`), and how a batch is told to be
LLaVA's.

`CLIPImageProcessor`, LLaVA 1.5's image processor, resizes and centre-crops every image to the
checkpoint's one square size (336²) and returns `pixel_values` [images, 3, S, S] and nothing else:
an image is one view, so an item is one row.

Those keys alone name no family, so a batch is LLaVA's only where nothing else marks it
(`LlavaProcessorOutput.missing`): a key another family's processor output holds (`num_crops`,
`num_patches`, `image_sizes`, ...) makes it that family's, and a prompt is refused.
`LlavaProcessor` returns `input_ids` and `attention_mask` beside the pixels, and so do processors
that drop the counts saying where an image ends (InternVL's `num_patches`, Gemma 3's `num_crops`):
with a prompt, nothing tells LLaVA's one view an image from their tiles, so such a batch is not
cut; cut the image processor's output instead.

No torch here: slicing works on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from vitpool.models import processor_items
from vitpool.models.family import ProcessorOutput
from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array

FAMILY = "llava"
PIXELS_KEY = "pixel_values"
# What LlavaProcessor and its neighbours return with a prompt (PaliGemma's and Gemma 3's add
# token_type_ids, PaliGemma's labels); any of them marks a batch that is not the image processor's.
PROMPT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "labels", "mm_token_type_ids")
PROMPT_HINT = (
    "a prompt (input_ids) beside the pixels is LlavaProcessor's output and also that of processors that "
    "drop where an image's tiles end (InternVL's num_patches, Gemma 3's num_crops), so it does not say "
    "these are LLaVA's views; cut the image processor's output "
    "(processor.image_processor(images, return_tensors='pt')), or pass {'pixel_values': "
    "out['pixel_values']} with family='llava'"
)


@dataclass(frozen=True)
class LlavaProcessorOutput(ProcessorOutput):
    """LLaVA's processor output: `pixel_values` alone, where no other family's keys and no prompt
    mark the batch (the module's opening)."""

    def missing(self, keys: Collection[str]) -> tuple[str, ...]:
        """What keeps a batch with `keys` from being LLaVA's: `pixel_values` where it lacks them,
        else the keys of other families' processors it holds, else its prompt's keys (the cutter
        refuses both by name); empty where the batch is LLaVA's."""
        if PIXELS_KEY not in keys:
            return (PIXELS_KEY,)
        foreign = other_families_keys(keys)
        if foreign:
            return tuple(sorted(foreign))
        return tuple(key for key in PROMPT_KEYS if key in keys)


def other_families_keys(keys: Collection[str]) -> dict[str, list[str]]:
    """Each of `keys` that another shipped family's processor output holds (not the pixels, not a
    prompt's), with those families' names."""
    return processor_items.other_families_keys(keys, FAMILY, (PIXELS_KEY, *PROMPT_KEYS))


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image: its row of `pixel_values`, [1, 3, S, S].

    Raises:
        ValueError: no `pixel_values`, pixels that are not one tensor [images, channels, S, S],
            keys of another family's processor output (named, with the families), or a prompt.
    """
    pixels = batch.get(PIXELS_KEY)
    if pixels is None:
        raise ValueError(f"the batch has no {PIXELS_KEY}")
    check_array(pixels, PIXELS_KEY)
    foreign = other_families_keys(batch.keys())
    if foreign:
        held = "; ".join(f"{key} ({', '.join(names)})" for key, names in sorted(foreign.items()))
        raise ValueError(
            f"the batch holds keys of other families' processor output: {held}; LLaVA's image processor "
            f"returns {PIXELS_KEY} alone: pass that family's name as family="
        )
    prompt = [key for key in PROMPT_KEYS if key in batch]
    if prompt:
        raise ValueError(f"the batch holds {', '.join(prompt)}: {PROMPT_HINT}")
    if len(pixels.shape) != 4:
        raise ValueError(
            f"{PIXELS_KEY} has shape {tuple(pixels.shape)}; LLaVA's image processor returns one view an "
            "image, [images, channels, height, width]"
        )
    return [ProcessorItem(IMAGE, pixels[index : index + 1]) for index in range(len(pixels))]
