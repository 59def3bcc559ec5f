"""Phi-4-multimodal's processor output cut into items (`vitpool.items_from`).

`Phi4MultimodalImageProcessor` (torchvision only) returns, for images of any sizes:
`image_pixel_values` [images, max crops, 3, S, S] (each image's global crop, then its canvas' crops
row by row, then all-zero padding crops up to the longest image's count), `image_sizes` [images, 2]
(the canvas' height and width in pixels, whole crops), `image_attention_mask` [images, max crops,
S/P, S/P] (per crop, the patches holding image; ones on the global and the padding crops) and
`num_img_tokens`. `Phi4MultimodalProcessor` keeps the first three. An item is one image's crops,
padding crops dropped, with (height, width, valid_rows, valid_cols) as its layout: the top-left
rectangle of the canvas' patches the mask keeps (`vitpool.families.phi4_multimodal.rules`).

No torch here: slicing works on torch tensors and NumPy arrays alike (the masks are read as lists).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.models.processor_items import (
    IMAGE,
    ProcessorItem,
    check_array,
    int_rows,
    required,
)

PIXELS, SIZES, MASKS = "image_pixel_values", "image_sizes", "image_attention_mask"
HINT = "pass the (image) processor's output as it is (return_tensors='pt' or 'np')"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image: its global crop and canvas crops of `image_pixel_values`, as many as its
    `image_sizes` row says, with the canvas and the image's patches of `image_attention_mask`.

    Raises:
        ValueError: a key missing, arrays that are not the processor's shapes, image sizes
            that are not whole crops or need more crops than the batch holds, or a mask that is not
            one top-left rectangle of each canvas (ones on the global crop).
    """
    pixels, masks = required(batch, PIXELS, HINT), required(batch, MASKS, HINT)
    sizes = int_rows(required(batch, SIZES, HINT), SIZES)
    for key, value, rank in ((PIXELS, pixels, 5), (MASKS, masks, 4)):
        check_array(value, key)
        if len(value.shape) != rank:
            raise ValueError(
                f"{key} has shape {tuple(value.shape)}; the image processor's has {rank} dimensions "
                "([images, crops, 3, S, S] and [images, crops, S/P, S/P])"
            )
    num_images, max_crops, side = pixels.shape[0], pixels.shape[1], pixels.shape[-1]
    if not len(sizes) == num_images == masks.shape[0] or masks.shape[1] != max_crops:
        raise ValueError(
            f"{PIXELS} holds {num_images} images of {max_crops} crops, {MASKS} {tuple(masks.shape[:2])} and "
            f"{SIZES} {len(sizes)} rows: they must agree"
        )
    cut = []
    for index, size in enumerate(sizes):
        if len(size) != 2 or min(size) < side or size[0] % side or size[1] % side:
            raise ValueError(
                f"{SIZES} row {index} is {size}; expected (height, width) in whole {side}-pixel crops"
            )
        rows, cols = size[0] // side, size[1] // side
        crops = 1 + rows * cols
        if crops > max_crops:
            raise ValueError(
                f"image {index}: a {size[0]} x {size[1]} canvas needs {crops} crops; {PIXELS} holds "
                f"{max_crops}"
            )
        valid_rows, valid_cols = _image_patches(masks[index, :crops].tolist(), rows, cols, index)
        cut.append(ProcessorItem(IMAGE, pixels[index, :crops], (size[0], size[1], valid_rows, valid_cols)))
    return cut


def _image_patches(masks: list, rows: int, cols: int, index: int) -> tuple[int, int]:
    """The patch rows and columns of an image's canvas that hold image, from its crops' masks
    (global crop first); ValueError unless the global crop is all ones and the canvas' ones are
    one top-left rectangle."""
    if not all(value for line in masks[0] for value in line):
        raise ValueError(f"image {index}: {MASKS} masks patches of the global crop; the processor masks none")
    side = len(masks[0])

    def canvas(y: int, x: int) -> bool:
        return bool(masks[1 + (y // side) * cols + x // side][y % side][x % side])

    height, width = rows * side, cols * side
    valid_rows = next((y for y in range(height) if not canvas(y, 0)), height)
    valid_cols = next((x for x in range(width) if not canvas(0, x)), width)
    rectangle = all(
        canvas(y, x) == (y < valid_rows and x < valid_cols) for y in range(height) for x in range(width)
    )
    if not valid_rows or not valid_cols or not rectangle:
        raise ValueError(
            f"image {index}: {MASKS} is not one top-left rectangle of the canvas' patches (the processor "
            "pads the bottom or the right of the canvas only)"
        )
    return valid_rows, valid_cols
