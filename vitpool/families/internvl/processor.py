"""InternVL's processor output cut into items (`vitpool.items_from`).

`GotOcr2ImageProcessor(crop_to_patches=True)` stacks every image's tiles (its crops, then a
thumbnail) into one `pixel_values` [total tiles, 3, S, S] and says how many each image has in
`num_patches`; an item is one image's tiles. `InternVLProcessor` drops `num_patches` (and joins
videos' frames into `pixel_values`, in the prompt's order), so its output cannot be cut.

No torch here: slicing works on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.models.processor_items import (
    IMAGE,
    ProcessorItem,
    cut_by_counts,
    required,
    whole_numbers,
)

TILES_KEY = "num_patches"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image: its `num_patches` consecutive tiles of `pixel_values`.

    Raises:
        ValueError: no `num_patches` (InternVLProcessor's output), or counts that do not
            add up to the tiles.
    """
    pixels = required(batch, "pixel_values", "")
    counts = whole_numbers(
        required(
            batch,
            TILES_KEY,
            "InternVLProcessor drops it; cut the image processor's output instead "
            "(processor.image_processor(images, return_tensors='pt') keeps it), or set "
            "batch['num_patches'] to each image's tile count",
        ),
        TILES_KEY,
    )
    return [ProcessorItem(IMAGE, tiles) for tiles in cut_by_counts(pixels, "pixel_values", counts, TILES_KEY)]
