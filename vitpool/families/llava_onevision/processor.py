"""LLaVA-OneVision's processor output cut into items (`vitpool.items_from`).

`LlavaOnevisionImageProcessor` (and its PIL twin) takes images as samples (a flat list: one image a
sample; a nested list: the images of each sample) and returns

- `pixel_values` [images, tiles, 3, S, S]: for the image of a one-image sample its base tile and the
  crops of its grid; for each image of a sample of several its base tile alone (padded to a square
  first: the model runs no crops there); padded with all-zero tiles to the batch's most tiles;
- `image_sizes` [images, 2]: each image's original (height, width) in pixels;
- `batch_num_images`: the images of each sample.

An item is one image's tiles and its size: `Image(pixel_values[i, :n], image_sizes[i])`. How many
tiles are the image's own is its grid's (the checkpoint's `image_grid_pinpoints`, which the output
does not hold) or one, and the padding is all-zero tiles, which no real tile is: the processor
normalises every pixel to (v / 255 - mean) / std, and no 8-bit value v is 255 times CLIP's mean or
SigLIP's 0.5. So an image's tiles are those before its padding; the item's rules check their count
against its size when it is encoded. `LlavaOnevisionVideoProcessor` returns `pixel_values_videos`
[videos, frames, 3, S, S]: one item per video, its frames.

No torch here: slicing and comparisons work on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.models.processor_items import (
    IMAGE,
    VIDEO,
    ProcessorItem,
    check_array,
    int_rows,
    required,
    whole_numbers,
)

SIZES_KEY, SAMPLES_KEY, VIDEO_KEY = "image_sizes", "batch_num_images", "pixel_values_videos"
IMAGE_PROCESSOR_HINT = "pass what LlavaOnevisionProcessor (or its image processor) returned, as it is"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image, in the processor's order (its tiles before the padding, and its size),
    then one per video (its frames).

    Raises:
        ValueError: a key missing, pixel values that are not [images, tiles, 3, S, S], sizes or
            sample counts that do not fit the images, an image with real tiles after padding, an
            image of a multi-image sample with more than its base tile, a video frame that is all
            zeros.
    """
    cut = _images(batch) if "pixel_values" in batch else []
    return cut + _videos(batch) if VIDEO_KEY in batch else cut


def _images(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    pixels = required(batch, "pixel_values", "")
    check_array(pixels, "pixel_values")
    if len(pixels.shape) != 5:
        raise ValueError(
            f"pixel_values has shape {tuple(pixels.shape)}; LLaVA-OneVision's image processor gives "
            f"[images, tiles, channels, height, width] (do_pad=True, return_tensors='pt' or 'np'): "
            f"{IMAGE_PROCESSOR_HINT}"
        )
    sizes = int_rows(required(batch, SIZES_KEY, IMAGE_PROCESSOR_HINT), SIZES_KEY)
    per_sample = whole_numbers(
        required(
            batch, SAMPLES_KEY, f"it says which images came in a sample of several; {IMAGE_PROCESSOR_HINT}"
        ),
        SAMPLES_KEY,
    )
    num_images = pixels.shape[0]
    if len(sizes) != num_images or sum(per_sample) != num_images:
        raise ValueError(
            f"pixel_values holds {num_images} images; {SIZES_KEY} has {len(sizes)} rows and {SAMPLES_KEY} "
            f"{per_sample} counts {sum(per_sample)}"
        )
    alone = [count == 1 for count in per_sample for _ in range(count)]
    cut = []
    for index, (size, is_alone) in enumerate(zip(sizes, alone)):
        if len(size) != 2 or min(size) < 1:
            raise ValueError(
                f"{SIZES_KEY} row {index} is {size}; expected (height, width) of positive integers"
            )
        tiles = _real_tiles(pixels[index], f"image {index}")
        if not is_alone and tiles != 1:
            raise ValueError(
                f"image {index} is one of a sample of several ({SAMPLES_KEY} {per_sample}), for which the "
                f"processor gives its base tile alone, but it has {tiles} real tiles"
            )
        cut.append(ProcessorItem(IMAGE, pixels[index, :tiles], (size[0], size[1])))
    return cut


def _videos(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    videos = required(batch, VIDEO_KEY, "")
    check_array(videos, VIDEO_KEY)
    if len(videos.shape) != 5:
        raise ValueError(
            f"{VIDEO_KEY} has shape {tuple(videos.shape)}; LLaVA-OneVision's video processor gives "
            "[videos, frames, channels, height, width]"
        )
    cut = []
    for index in range(videos.shape[0]):
        frames = videos[index]
        empty = [frame for frame in range(frames.shape[0]) if not bool((frames[frame] != 0).any())]
        if empty:
            raise ValueError(
                f"video {index}: frames {empty} are all zeros, which no frame the processor normalises is; "
                "pass each video's own frames"
            )
        cut.append(ProcessorItem(VIDEO, frames))
    return cut


def _real_tiles(tiles: Any, name: str) -> int:
    """How many of an image's tiles come before the batch's padding (all-zero tiles).

    Raises:
        ValueError: no real tile, or a real tile after padding.
    """
    real = [bool((tile != 0).any()) for tile in tiles]
    count = real.index(False) if False in real else len(real)
    if count == 0 or any(real[count:]):
        raise ValueError(
            f"{name}: its tiles are {['real' if r else 'zero' for r in real]}; the processor gives real "
            "tiles first, then all-zero padding"
        )
    return count
