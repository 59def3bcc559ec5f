"""InternVL's processor output cut into items (`vitpool.items_from`).

`GotOcr2ImageProcessor(crop_to_patches=True)` stacks every image's tiles (its crops, then a
thumbnail) into one `pixel_values` [total tiles, 3, S, S] and says how many each image has in
`num_patches`; an item is one image's tiles. `InternVLProcessor` drops `num_patches` (and joins
videos' frames into `pixel_values`, in the prompt's order), so its output cannot be cut.

The helpers below (counts per item, rows cut by them) are what the tiled families' cutters share.
No torch here: slicing works on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array

TILES_KEY = "num_patches"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image: its `num_patches` consecutive tiles of `pixel_values`.

    Raises:
        ValueError: no `num_patches` (InternVLProcessor's output), videos, or counts that do not
            add up to the tiles.
    """
    refuse_videos(batch, "InternVL")
    pixels = required(batch, "pixel_values", "")
    counts = whole_numbers(
        required(batch, TILES_KEY,
                 "InternVLProcessor drops it; cut the image processor's output instead "
                 "(processor.image_processor(images, return_tensors='pt') keeps it), or set "
                 "batch['num_patches'] to each image's tile count"),
        TILES_KEY,
    )
    return [ProcessorItem(IMAGE, tiles) for tiles in cut_by_counts(pixels, "pixel_values", counts, TILES_KEY)]


def required(batch: Mapping[str, Any], key: str, hint: str) -> Any:
    """`batch[key]`; a ValueError naming the key (and what to do, `hint`) where it is absent."""
    if batch.get(key) is None:
        raise ValueError(f"the batch has no {key}" + (f": {hint}" if hint else ""))
    return batch[key]


def refuse_videos(batch: Mapping[str, Any], family: str) -> None:
    """A family that takes no videos refuses a batch holding some, rather than dropping them (its
    prompt would then have placeholders no item fills)."""
    if "pixel_values_videos" in batch:
        raise ValueError(
            f"the batch holds pixel_values_videos: vitpool takes {family} images only; pass the images' "
            "output alone"
        )


def whole_numbers(value: Any, key: str) -> list[int]:
    """A 1-D integer tensor, array or list (a processor's count per image) as non-negative ints."""
    numbers = value.tolist() if hasattr(value, "tolist") else value
    counts = isinstance(numbers, Sequence) and not isinstance(numbers, str) and all(map(_is_count, numbers))
    if not counts:
        raise ValueError(f"{key} must be one non-negative whole number per image; got {numbers!r}")
    return [int(number) for number in numbers]


def cut_by_counts(rows: Any, rows_key: str, counts: list[int], counts_key: str) -> list[Any]:
    """`rows` (a tensor or an array) cut into consecutive runs of `counts[i]` rows.

    Raises:
        ValueError: not a tensor or an array, or counts that do not add up to its rows.
    """
    check_array(rows, rows_key)
    if sum(counts) != len(rows):
        raise ValueError(
            f"{rows_key} has {len(rows)} rows; {counts_key} {counts} accounts for {sum(counts)}"
        )
    runs, start = [], 0
    for count in counts:
        runs.append(rows[start : start + count])
        start += count
    return runs


def _is_count(number: Any) -> bool:
    try:
        return not isinstance(number, bool) and int(number) == number and number >= 0
    except (TypeError, ValueError):
        return False
