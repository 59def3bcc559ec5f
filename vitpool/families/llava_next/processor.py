"""LLaVA-NeXT's processor output cut into items (`vitpool.items_from`), and how it is told from
Mistral 3's, whose keys are the same.

`LlavaNextImageProcessor` (and its PIL twin; `LlavaNextProcessor` adds the prompt) returns

- `pixel_values` [images, tiles, 3, S, S]: each image's base tile and the crops of its grid, padded
  with all-zero tiles to the batch's most tiles (do_pad=True, the default; with do_pad=False a batch
  whose images have one tile count is the same array, unpadded);
- `image_sizes` [images, 2]: each image's original (height, width) in pixels.

An item is one image's tiles and its size: `Image(pixel_values[i, :n], image_sizes[i])`. How many
tiles are the image's own is its grid's (the checkpoint's `image_grid_pinpoints`, which the output
does not hold), and the padding is all-zero tiles, which no real tile is (the processor normalises
every pixel, the letterbox's black ones too, with CLIP's mean and std, so none is 0): an image's
tiles are those before its padding, and its rules check their count against its size when it is
encoded. Hugging Face's model also takes the images' tiles stacked [tiles, 3, S, S], but no
processor returns that, and cutting it needs the pinpoints: pass the processor's own output.

`PixtralImageProcessor` (Mistral 3) returns the same two keys, with one padded image a row, [B, C, H,
W]. The two cutters fit the same keys, so `items_from` finds one cut for both (the record's
`cut_as`, Mistral 3's cutter's name): this one, which cuts five-dimensional tiles itself and hands
any other batch to Mistral 3's cutter. Named with family='llava_next', a four-dimensional batch is
cut so too (a cutter is not told how it was found), and its items, whole images rather
than tiles, are refused by LLaVA-NeXT's rules when encoded, by index; family='mistral3' cuts only
Mistral 3's.

No torch here: slicing and comparisons work on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.families.llava_onevision.processor import _real_tiles as real_tiles
from vitpool.families.mistral3 import processor as mistral3_processor
from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array, int_rows, required

SIZES_KEY = "image_sizes"
TILES_NDIM = 5
IMAGE_PROCESSOR_HINT = "pass what LlavaNextProcessor (or its image processor) returned, as it is"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """The batch's images, cut by the shape of its `pixel_values`: five dimensions, LLaVA-NeXT's
    tiles (`tiles`); any other, one padded image a row, Mistral 3's (its cutter's items).

    Raises:
        ValueError: what `tiles` raises, or else what Mistral 3's cutter raises, with what
            LLaVA-NeXT's processor gives instead.
    """
    pixels = required(batch, "pixel_values", IMAGE_PROCESSOR_HINT)
    check_array(pixels, "pixel_values")
    if len(pixels.shape) == TILES_NDIM:
        return tiles(batch)
    try:
        return mistral3_processor.items(batch)
    except ValueError as error:
        raise ValueError(
            f"{error}; or, for LLaVA-NeXT, pixel_values has shape {tuple(pixels.shape)} where its image "
            "processor gives [images, tiles, channels, height, width]: "
            f"{IMAGE_PROCESSOR_HINT}"
        ) from None


def tiles(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image, in the processor's order: its tiles before the padding, and its size.

    Raises:
        ValueError: a key missing, pixel values that are not [images, tiles, 3, S, S], sizes that do
            not fit the images, an image with no real tile or real tiles after padding.
    """
    pixels = required(batch, "pixel_values", IMAGE_PROCESSOR_HINT)
    check_array(pixels, "pixel_values")
    if len(pixels.shape) != TILES_NDIM:
        raise ValueError(
            f"pixel_values has shape {tuple(pixels.shape)}; LLaVA-NeXT's image processor gives "
            f"[images, tiles, channels, height, width]: {IMAGE_PROCESSOR_HINT}"
        )
    sizes = int_rows(required(batch, SIZES_KEY, IMAGE_PROCESSOR_HINT), SIZES_KEY)
    if len(sizes) != pixels.shape[0]:
        raise ValueError(f"pixel_values holds {pixels.shape[0]} images; {SIZES_KEY} has {len(sizes)} rows")
    cut = []
    for index, size in enumerate(sizes):
        if len(size) != 2 or min(size) < 1:
            raise ValueError(
                f"{SIZES_KEY} row {index} is {size}; expected (height, width) of positive integers"
            )
        count = real_tiles(pixels[index], f"image {index}")
        cut.append(ProcessorItem(IMAGE, pixels[index, :count], (size[0], size[1])))
    return cut
