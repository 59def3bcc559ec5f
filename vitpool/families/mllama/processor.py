"""Llama 3.2 Vision's processor output cut into items (`vitpool.items_from`).

`MllamaImageProcessor` pads every sample to the batch's most images and every image to
`max_image_tiles` tiles: `pixel_values` [batch, images, tiles, 3, S, S], `aspect_ratio_ids`
[batch, images] (0: a padding image), `aspect_ratio_mask` [batch, images, tiles] (1: a real tile;
a padding image has its first tile set) and, from the image processor alone, `num_tiles` (per
sample, per image; `MllamaProcessor` drops it). An item is one real image: its real tiles,
`pixel_values[b, i, :h*w]`, and its canvas (h, w) from its aspect ratio id, in sample order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.families.mllama.rules import supported_aspect_ratios
from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array, int_rows, required

RATIO_KEY = "aspect_ratio_ids"
MASK_KEY = "aspect_ratio_mask"
HINT = "MllamaImageProcessor and MllamaProcessor both return it; pass their output as it is"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per real image (aspect ratio id above 0), sample by sample.

    Raises:
        ValueError: pixels not [batch, images, tiles, C, S, S], ids or a mask not shaped to them,
            an id the processor does not give, a mask or `num_tiles` that disagrees with the ids.
    """
    pixels = required(batch, "pixel_values", "")
    check_array(pixels, "pixel_values")
    if len(pixels.shape) != 6:
        raise ValueError(
            f"pixel_values must be [batch, images, tiles, channels, height, width] as MllamaImageProcessor "
            f"returns them (what the model takes); got shape {tuple(pixels.shape)}"
        )
    samples, images, max_tiles = (int(n) for n in pixels.shape[:3])
    ratios = supported_aspect_ratios(max_tiles)
    ids = int_rows(required(batch, RATIO_KEY, HINT), RATIO_KEY)
    if [len(row) for row in ids] != [images] * samples:
        raise ValueError(f"{RATIO_KEY} must be [batch, images] = [{samples}, {images}], as pixel_values")
    masks = _masks(batch.get(MASK_KEY), samples, images, max_tiles)
    counts = batch.get("num_tiles")
    found: list[ProcessorItem] = []
    for sample, row in enumerate(ids):
        real = [image for image, ratio_id in enumerate(row) if ratio_id != 0]
        if real != list(range(len(real))):
            raise ValueError(f"{RATIO_KEY} row {sample} is {row}: padding images (id 0) come after real ones")
        for image in real:
            where = f"image {image} of sample {sample} (item {len(found)})"
            if not 1 <= row[image] <= len(ratios):
                raise ValueError(
                    f"{where}: aspect ratio id {row[image]} is not one of 1..{len(ratios)} for {max_tiles} "
                    "tiles"
                )
            canvas = ratios[row[image] - 1]
            tiles = canvas[0] * canvas[1]
            if masks is not None and masks[sample][image] != [1] * tiles + [0] * (max_tiles - tiles):
                raise ValueError(
                    f"{where}: {MASK_KEY} {masks[sample][image]} does not mark the {tiles} tiles of its "
                    f"canvas {canvas}"
                )
            found.append(ProcessorItem(IMAGE, pixels[sample, image, :tiles], canvas))
        if counts is not None:
            _check_counts(counts, sample, found[len(found) - len(real) :])
    return found


def _masks(value: Any, samples: int, images: int, max_tiles: int) -> list[list[list[int]]] | None:
    if value is None:
        return None
    masks = value.tolist() if hasattr(value, "tolist") else value
    shaped = (
        isinstance(masks, list)
        and len(masks) == samples
        and all(isinstance(row, list) and len(row) == images for row in masks)
        and all(isinstance(m, list) and len(m) == max_tiles for row in masks for m in row)
    )
    if not shaped:
        raise ValueError(f"{MASK_KEY} must be [batch, images, tiles] = [{samples}, {images}, {max_tiles}]")
    return masks


def _check_counts(counts: Any, sample: int, cut: list[ProcessorItem]) -> None:
    """`num_tiles` (the image processor's count per sample, per image) agrees with the ids."""
    try:
        given = [int(n) for n in counts[sample]]
    except (TypeError, ValueError, IndexError, KeyError):
        raise ValueError(f"num_tiles must be a count per image of each sample; got {counts!r}") from None
    derived = [item.grid[0] * item.grid[1] for item in cut]
    if given != derived:
        raise ValueError(
            f"num_tiles {given} of sample {sample} disagrees with its {RATIO_KEY}' canvases ({derived} tiles)"
        )
