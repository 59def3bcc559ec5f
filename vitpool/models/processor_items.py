"""Items as a family's Hugging Face processor returns them, before they are `Image`s and `Video`s
(`vitpool.items_from` makes those): each family's record names its cutter
(`vitpool.models.family.ProcessorOutput`), a function from the processor's batch to one
`ProcessorItem` per image, then one per video. The grid families share `grid_items`. A cutter
of an image-only family never sees videos: `items_from` refuses them first.

No torch here: a batch's values are torch tensors or NumPy arrays (`return_tensors="pt"` or
"np"), cut by slicing, which both share.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IMAGE, VIDEO = "image", "video"


@dataclass(frozen=True)
class ProcessorItem:
    """One image or video of a processor's batch: its pixels, its grid or layout (None: it has
    none) and, for a family whose item is several inputs, the others by name."""

    modality: str
    pixel_values: Any
    grid: Any = None
    inputs: Mapping[str, Any] | None = None


def grid_items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """Qwen-style output: patch rows `pixel_values` with a (t, h, w) row of `image_grid_thw` per
    image, then `pixel_values_videos` with `video_grid_thw` per video; an item's rows are t*h*w
    consecutive rows."""
    items = cut_by_grid(batch, "pixel_values", "image_grid_thw", IMAGE)
    return items + cut_by_grid(batch, "pixel_values_videos", "video_grid_thw", VIDEO)


def cut_by_grid(
    batch: Mapping[str, Any], pixels_key: str, grid_key: str, modality: str
) -> list[ProcessorItem]:
    """The items of one modality: `batch[pixels_key]`'s rows, t*h*w per row of `batch[grid_key]`
    (none where the batch holds neither key).

    Raises:
        ValueError: one key without the other, or rows the grids do not account for.
    """
    if pixels_key not in batch and grid_key not in batch:
        return []
    pixels, grids = batch.get(pixels_key), batch.get(grid_key)
    if pixels is None or grids is None:
        missing = pixels_key if pixels is None else grid_key
        raise ValueError(f"the batch has {grid_key if pixels is None else pixels_key} but no {missing}")
    check_array(pixels, pixels_key)
    rows = [grid_row(row, grid_key, index) for index, row in enumerate(int_rows(grids, grid_key))]
    counts = [t * h * w for t, h, w in rows]
    if sum(counts) != len(pixels):
        raise ValueError(
            f"{pixels_key} has {len(pixels)} rows; its {len(rows)} {grid_key} rows account for {sum(counts)} "
            f"({' + '.join(map(str, counts))})"
        )
    items, start = [], 0
    for grid, count in zip(rows, counts):
        items.append(ProcessorItem(modality, pixels[start : start + count], grid))
        start += count
    return items


def check_array(value: Any, key: str) -> None:
    """A batch's pixels come as a tensor or an array (the processor's return_tensors "pt" or "np")."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ValueError(
            f"{key} is a {type(value).__name__}; call the processor with return_tensors='pt' (or 'np') so "
            "that it is one tensor"
        )


def int_rows(value: Any, key: str) -> list[list[int]]:
    """A 2-D integer tensor, array or nested list as lists of ints."""
    rows = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(rows, Sequence) or not all(isinstance(row, Sequence) for row in rows):
        raise ValueError(f"{key} must be rows of integers, got {type(value).__name__}")
    try:
        return [[_as_int(v) for v in row] for row in rows]
    except (TypeError, ValueError):
        raise ValueError(f"{key} must hold whole numbers; got {rows!r}") from None


def grid_row(row: list[int], key: str, index: int) -> tuple[int, int, int]:
    if len(row) != 3 or min(row) < 1:
        raise ValueError(f"{key} row {index} is {row}; expected (t, h, w) of positive integers")
    return row[0], row[1], row[2]


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or int(value) != value:
        raise ValueError(value)
    return int(value)


# counts per item, rows cut by them: what the tiled families' cutters share


def required(batch: Mapping[str, Any], key: str, hint: str) -> Any:
    """`batch[key]`; a ValueError naming the key (and what to do, `hint`) where it is absent."""
    if batch.get(key) is None:
        raise ValueError(f"the batch has no {key}" + (f": {hint}" if hint else ""))
    return batch[key]


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
        raise ValueError(f"{rows_key} has {len(rows)} rows; {counts_key} {counts} accounts for {sum(counts)}")
    runs, start = [], 0
    for count in counts:
        runs.append(rows[start : start + count])
        start += count
    return runs


def tile_items(pixels: Any, key: str) -> list[ProcessorItem]:
    """One image item per row of `pixels` [tiles, C, S, S]: the cut of a tiled family's full
    processor output, which drops where an image's tiles end (`ProcessorOutput.count_keys`).

    Raises:
        ValueError: not a tensor or an array of tiles.
    """
    check_array(pixels, key)
    if len(pixels.shape) != 4:
        raise ValueError(f"{key} has shape {tuple(pixels.shape)}; tiles are [tiles, channels, height, width]")
    return [ProcessorItem(IMAGE, pixels[row : row + 1]) for row in range(pixels.shape[0])]


def _is_count(number: Any) -> bool:
    try:
        return not isinstance(number, bool) and int(number) == number and number >= 0
    except (TypeError, ValueError):
        return False


def other_families_keys(keys: Collection[str], family: str, ignored: Collection[str]) -> dict[str, list[str]]:
    """Each of `keys` that the processor output of a shipped family other than `family` holds
    (not `ignored`: the pixels and a prompt's keys, which many share), with those families' names:
    what tells a batch of bare pixels from another family's output."""
    # the registry reads the families' records, which import this module: read it only when called
    from vitpool.models.registry import RECORDS

    owners: dict[str, list[str]] = {}
    for record in RECORDS:
        output = record.processor_output
        if record.name == family or output is None:
            continue
        for key in (*output.image_keys, *output.video_keys, *output.other_keys):
            if key in keys and key not in ignored:
                owners.setdefault(key, []).append(record.name)
    return owners
