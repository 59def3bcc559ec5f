"""Step-3.7's and DeepSeek-OCR-2's processor output cut into items (`vitpool.items_from`): both
records name `view_and_crops_items`, so a batch of either is cut without naming the family.

`Step3p7ImageProcessor` (and `DeepseekOcr2ImageProcessor`) give each image one global view, a row
of `pixel_values` [images, 3, S, S], and zero or more crops: all images' crops stacked in
`pixel_values_local` [total crops, 3, s, s], `num_local_patches` of them per image. The key is
absent where no image has crops. An item is one image: its view, and its crops as the input
`pixel_values_local` where it has some (an image without crops has no such input, as the
processor gives it alone). Both families' full processors keep `num_local_patches`.
(DeepSeek-OCR-2's views are padded to a square of its `size`; its crops, of `tile_size`, come
only for an image over `tile_size` pixels a side.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.models.processor_items import (
    IMAGE,
    ProcessorItem,
    check_array,
    cut_by_counts,
    required,
    whole_numbers,
)

CROPS_KEY = "pixel_values_local"
COUNTS_KEY = "num_local_patches"


def view_and_crops_items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per global view of `pixel_values`: that row, with its `num_local_patches` crops of
    `pixel_values_local` as that input where it has any.

    Raises:
        ValueError: no `num_local_patches`, a count per image that does not match the views, or
            crops the counts do not account for.
    """
    views = required(batch, "pixel_values", "")
    check_array(views, "pixel_values")
    counts = whole_numbers(
        required(batch, COUNTS_KEY, "the image processor gives it, one count per image"), COUNTS_KEY
    )
    if len(counts) != len(views):
        raise ValueError(
            f"pixel_values holds {len(views)} global views but {COUNTS_KEY} {counts} counts "
            f"{len(counts)} images"
        )
    crops = batch.get(CROPS_KEY)
    if crops is None:
        if sum(counts):
            raise ValueError(
                f"{COUNTS_KEY} {counts} counts {sum(counts)} crops but the batch has no {CROPS_KEY}"
            )
        return [ProcessorItem(IMAGE, views[index : index + 1]) for index in range(len(views))]
    per_image = cut_by_counts(crops, CROPS_KEY, counts, COUNTS_KEY)
    return [
        ProcessorItem(IMAGE, views[index : index + 1], inputs={CROPS_KEY: own} if len(own) else None)
        for index, own in enumerate(per_image)
    ]
