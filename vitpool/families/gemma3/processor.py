"""Gemma 3's processor output cut into items (`vitpool.items_from`).

`Gemma3ImageProcessor` stacks every image's views into one `pixel_values` [total views, 3, S, S]:
the whole image, then, with `do_pan_and_scan`, its crops; `num_crops` [images] says how many crops
each image has, so an image is `1 + num_crops[i]` consecutive views. `Gemma3Processor` drops
`num_crops` (it is among its unused inputs): named with `family="gemma3"`, its output is cut one
item per view, as the model encodes every view alone (SigLIP, then the projector's pooling) and
`get_image_features` returns them view by view; the items' tokens joined are its output.

No torch here: slicing works on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array, tile_items

PIXELS_KEY = "pixel_values"
CROPS_KEY = "num_crops"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image: its whole view and its `num_crops` crops, consecutive rows of
    `pixel_values`; without `num_crops` (Gemma3Processor's output, `items_from` with the family
    named), one item per view (`tile_items`).

    Raises:
        ValueError: no `pixel_values`, pixels that are not views, counts that are not one
            non-negative whole number per image, or views they do not account for.
    """
    pixels = batch.get(PIXELS_KEY)
    if pixels is None:
        raise ValueError(f"the batch has no {PIXELS_KEY}")
    check_array(pixels, PIXELS_KEY)
    crops = batch.get(CROPS_KEY)
    if crops is None:
        return tile_items(pixels, PIXELS_KEY)
    views = [1 + count for count in crop_counts(crops)]
    if sum(views) != len(pixels):
        raise ValueError(
            f"{PIXELS_KEY} has {len(pixels)} views; {CROPS_KEY} {[v - 1 for v in views]} accounts for "
            f"{sum(views)} (each image's whole view and its crops)"
        )
    cut, start = [], 0
    for count in views:
        cut.append(ProcessorItem(IMAGE, pixels[start : start + count]))
        start += count
    return cut


def crop_counts(value: Any) -> list[int]:
    """`num_crops` (a 1-D tensor, array or list) as non-negative ints, one per image."""
    numbers = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(numbers, Sequence) or isinstance(numbers, str):
        # ValueError, as every cutter's: items_from's callers catch one kind of error for a bad batch
        raise ValueError(f"{CROPS_KEY} must be one count per image; got {type(value).__name__}")  # noqa: TRY004
    if not all(_is_count(number) for number in numbers):
        raise ValueError(f"{CROPS_KEY} must be one non-negative whole number per image; got {numbers!r}")
    return [int(number) for number in numbers]


def _is_count(number: Any) -> bool:
    try:
        return not isinstance(number, bool) and int(number) == number and number >= 0
    except (TypeError, ValueError):
        return False
