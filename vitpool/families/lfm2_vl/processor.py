"""LFM2-VL's processor output cut into items (`vitpool.items_from`).

`Lfm2VlImageProcessor` (torchvision only) gives every entry of every image (a small image whole;
a large one's rows x cols tiles row by row, then its thumbnail where `use_thumbnail` is on) one
row of `pixel_values` [entries, max_patches, C*P*P], padded with zeros to the most patches an
entry may have, one row (h, w) of `spatial_shapes` and one of `pixel_attention_mask` (h*w ones,
then zeros). Which entries are one image's it says only with `return_row_col_info=True`: then
`image_rows` and `image_cols` give each image's tile grid (1 x 1 for an image not split) and
`image_sizes` its thumbnail's size. `use_thumbnail` itself is not in the output. `Lfm2VlProcessor`
asks for that information and drops it (`image_rows`, `image_cols`, `image_sizes` are its
`unused_input_names`); in their place it writes the prompt: per image `<|image_start|>`, then
for a split image `<|img_row_R_col_C|>` and the tile's `<image>` tokens for each tile, and
`<|img_thumbnail|>` and the thumbnail's tokens; for an image not split its tokens alone; then
`<|image_end|>` (`use_image_special_tokens=True`, the default).

An item is one image: its entries' real patches, packed, and their `spatial_shapes` rows, as the
processor gives them for that image alone (`rules.py` says why). Each image's entry count is
taken
- from `image_rows` and `image_cols` where the batch holds them (the image processor's output
  with `return_row_col_info=True`): rows * cols tiles, and a thumbnail after each split image
  where the entries add up only so (the processor adds one to every split image or to none);
- else, for a batch of one entry, that entry;
- else from the prompt, `input_ids` with `mm_token_type_ids` (`return_mm_token_type_ids=True`):
  each run of `<image>` tokens (type 1) is one entry, in `spatial_shapes`' order, holding its
  h*w / f² tokens; two runs are one image's where exactly one token (a tile or thumbnail marker)
  stands between them, and every image's last run is followed by one and the same token
  (`<|image_end|>`). A prompt written otherwise (`use_image_special_tokens=False` joins an
  image's tiles into one run) or cut short is refused, not guessed;
- else (the full processor's output without `mm_token_type_ids`) each entry is an item of its own,
  as the model's `get_image_features` answers, entry by entry: their tokens joined are its output.

No torch here: slicing and indexing work on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from vitpool.models.processor_items import (
    IMAGE,
    ProcessorItem,
    check_array,
    int_rows,
    required,
    whole_numbers,
)

SHAPES_KEY = "spatial_shapes"
MASK_KEY = "pixel_attention_mask"
GRID_KEYS = ("image_rows", "image_cols")
TOKEN_TYPES_KEY = "mm_token_type_ids"
IMAGE_TOKEN_TYPE = 1  # transformers' mm_token_type_ids: 0 text, 1 image, 2 video
AS_RETURNED = "pass what LFM2-VL's processor returned (do_pad=True)"
HOW_TO_CUT = (
    "Lfm2VlProcessor drops image_rows and image_cols, which say how many tiles each image has; pass the "
    "image processor's output instead (processor.image_processor(images, return_row_col_info=True, "
    "return_tensors='pt')), or the full processor's output with mm_token_type_ids "
    "(return_mm_token_type_ids=True, with its default use_image_special_tokens=True), or call the processor "
    "one image at a time"
)


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image, in the processor's order: its entries' real patch rows and their
    `spatial_shapes` rows.

    Raises:
        ValueError: pixels that are not [entries, max_patches, C*P*P]; shapes or masks that
            do not fit them; no way to tell each image's entries (see the module's opening); or
            counts, tokens and entries that do not add up.
    """
    pixels = required(batch, "pixel_values", "")
    check_array(pixels, "pixel_values")
    if len(pixels.shape) != 3:
        raise ValueError(
            f"pixel_values has shape {tuple(pixels.shape)}; LFM2-VL's processor gives padded entries "
            "[entries, max_patches, C*P*P] (do_pad=True, return_tensors='pt' or 'np')"
        )
    shapes = entry_shapes(required(batch, SHAPES_KEY, AS_RETURNED))
    if len(shapes) != pixels.shape[0]:
        raise ValueError(f"pixel_values holds {pixels.shape[0]} entries; {SHAPES_KEY} has {len(shapes)} rows")
    check_masks(required(batch, MASK_KEY, AS_RETURNED), shapes, pixels)
    cut, start = [], 0
    for count in entries_per_image(batch, shapes):
        rows = real_rows(pixels, shapes, start, count)
        cut.append(ProcessorItem(IMAGE, rows, batch[SHAPES_KEY][start : start + count]))
        start += count
    return cut


def entry_shapes(value: Any) -> list[tuple[int, int]]:
    """`spatial_shapes` [entries, 2] as (h, w) pairs of positive integers."""
    rows = int_rows(value, SHAPES_KEY)
    if not rows or any(len(row) != 2 or min(row) < 1 for row in rows):
        raise ValueError(f"{SHAPES_KEY} must be one (h, w) row of positive integers per entry; got {rows}")
    return [(h, w) for h, w in rows]


def check_masks(masks: Any, shapes: Sequence[tuple[int, int]], pixels: Any) -> None:
    """Each entry's mask: h*w real patches first, then padding, as the processor marks them."""
    check_array(masks, MASK_KEY)
    if tuple(masks.shape) != tuple(pixels.shape[:2]):
        raise ValueError(
            f"{MASK_KEY} has shape {tuple(masks.shape)}; pixel_values' entries are {tuple(pixels.shape[:2])}"
        )
    for entry, (h, w) in enumerate(shapes):
        real = h * w
        marked = real <= pixels.shape[1] and bool((masks[entry, :real] != 0).all())
        if not marked or bool((masks[entry, real:] != 0).any()):
            raise ValueError(
                f"entry {entry}: {SHAPES_KEY} row ({h}, {w}) says {real} real patches of {pixels.shape[1]}; "
                f"its {MASK_KEY} row marks others"
            )


def real_rows(pixels: Any, shapes: Sequence[tuple[int, int]], start: int, count: int) -> Any:
    """Entries start .. start+count-1's real patch rows, one after the other [sum h*w, C*P*P]: a
    view for one entry, a copy (one gather) for several."""
    if count == 1:
        h, w = shapes[start]
        return pixels[start, : h * w]
    max_patches = pixels.shape[1]
    rows = [
        entry * max_patches + patch
        for entry in range(start, start + count)
        for patch in range(shapes[entry][0] * shapes[entry][1])
    ]
    return pixels.reshape(-1, pixels.shape[2])[rows]


def entries_per_image(batch: Mapping[str, Any], shapes: Sequence[tuple[int, int]]) -> list[int]:
    """How many entries (tiles and thumbnail) each image has, in order (see the module's opening).

    Raises:
        ValueError: none of the ways applies, or what the batch says does not add up.
    """
    if any(batch.get(key) is not None for key in GRID_KEYS):
        rows, cols = (whole_numbers(required(batch, key, HOW_TO_CUT), key) for key in GRID_KEYS)
        return entries_from_grids(rows, cols, shapes)
    if batch.get("input_ids") is None or batch.get(TOKEN_TYPES_KEY) is None:
        return [1] * len(shapes)  # which image an entry is of, nothing says: the model's own unit
    return entries_from_prompt(batch["input_ids"], batch[TOKEN_TYPES_KEY], shapes)


def entries_from_grids(rows: list[int], cols: list[int], shapes: Sequence[tuple[int, int]]) -> list[int]:
    """Each image's entries from its tile grid: rows * cols tiles, plus a thumbnail after each
    split image if and only if that is what makes the entries add up."""
    if len(rows) != len(cols) or not rows or min(rows + cols) < 1:
        raise ValueError(
            f"image_rows {rows} and image_cols {cols} must give one grid of at least 1 x 1 per image"
        )
    tiles = [r * c for r, c in zip(rows, cols)]
    with_thumbnails = [t + (t > 1) for t in tiles]
    if sum(with_thumbnails) == len(shapes):
        counts = with_thumbnails
    elif sum(tiles) == len(shapes):
        counts = tiles
    else:
        raise ValueError(
            f"image_rows {rows} and image_cols {cols} give {sum(tiles)} tiles ({sum(with_thumbnails)} with a "
            f"thumbnail after each split image); {SHAPES_KEY} has {len(shapes)} rows"
        )
    start = 0
    for image, (count, tile_count) in enumerate(zip(counts, tiles)):
        if tile_count > 1 and len(set(shapes[start : start + tile_count])) != 1:
            raise ValueError(
                f"image {image}: its {tile_count} tiles have shapes {shapes[start : start + tile_count]}; "
                "the processor cuts one size of tile"
            )
        start += count
    return counts


def entries_from_prompt(input_ids: Any, token_types: Any, shapes: Sequence[tuple[int, int]]) -> list[int]:
    """Each image's entry count from the prompt's runs of image tokens (see the module's opening).

    Raises:
        ValueError: the runs are not one per entry of its length, or do not follow the processor's
            markers.
    """
    id_rows, type_rows = int_rows(input_ids, "input_ids"), int_rows(token_types, TOKEN_TYPES_KEY)
    if [len(row) for row in id_rows] != [len(row) for row in type_rows]:
        raise ValueError(f"input_ids and {TOKEN_TYPES_KEY} differ in shape")
    runs = []  # (prompt, first position, end position) of each run of image tokens
    for prompt, types in enumerate(type_rows):
        start = 0
        for token_type, run in itertools.groupby(types):
            length = len(list(run))
            if token_type == IMAGE_TOKEN_TYPE:
                runs.append((prompt, start, start + length))
            start += length
    if len(runs) != len(shapes):
        raise ValueError(
            f"the prompt holds {len(runs)} runs of image tokens ({TOKEN_TYPES_KEY} == {IMAGE_TOKEN_TYPE}), "
            f"one per tile or thumbnail, and {SHAPES_KEY} {len(shapes)} rows: a prompt cut short, written "
            "with use_image_special_tokens=False (an image's tiles then form one run), or pixels of another "
            f"prompt. {HOW_TO_CUT}"
        )
    check_run_lengths(runs, shapes)
    # a run and the next are one image's where one token (a marker) stands between them
    joined = [b[0] == a[0] and b[1] == a[2] + 1 for a, b in itertools.pairwise(runs)] + [False]
    counts: list[int] = []
    closers, markers = set(), set()  # the tokens after each image's last run; between one image's runs
    for number, (prompt, _, end) in enumerate(runs):
        if number and joined[number - 1]:
            counts[-1] += 1
        else:
            counts.append(1)
        after = id_rows[prompt][end] if end < len(id_rows[prompt]) else None
        (markers if joined[number] else closers).add(after)
    if None in closers or len(closers) != 1 or closers & markers:
        raise ValueError(
            "the prompt's image tokens do not follow the processor's markers (one token between an image's "
            "tiles and thumbnail, <|image_end|> after its last): the tokens after its images' last runs are "
            f"{sorted(closers, key=str)}, those between one image's runs {sorted(markers, key=str)}. "
            f"{HOW_TO_CUT}"
        )
    return counts


def check_run_lengths(runs: Sequence[tuple[int, int, int]], shapes: Sequence[tuple[int, int]]) -> None:
    """Every run holds its entry's h*w / f² tokens, for one downsample factor f."""
    ratios = {(h * w) / (end - start) for (_, start, end), (h, w) in zip(runs, shapes)}
    ratio = next(iter(ratios))
    factor = math.isqrt(int(ratio)) if ratio == int(ratio) else 0
    if len(ratios) != 1 or factor < 1 or factor * factor != ratio:
        lengths = [end - start for _, start, end in runs]
        raise ValueError(
            f"the prompt's runs of image tokens are {lengths} long; {SHAPES_KEY} "
            f"{[list(s) for s in shapes]} give h*w / f² tokens each for one downsample factor f. {HOW_TO_CUT}"
        )
