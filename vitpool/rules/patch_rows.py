"""What the item rules of patch-row towers share (Kimi-K2.5, PaddleOCR-VL): plain Python.

Both towers take the processor's patches one per row, [rows, C, P, P], with a (t, h, w) grid in
patches, attend over a whole item at once, and turn each kh x kw block of patches into one output
token of the LLM's width. `PatchRows` gives their rules' sizes, `patch_grid` checks an item's
pixels against its grid, and `sample_grids` draws random grids that fit a budget (the adapters'
`sample_specs`, which capture and its checks rely on).

Importing neither torch nor transformers: the rules that use it are unpickled by a pool's callers.
"""

from __future__ import annotations

import random
from typing import Any

from vitpool.rules.base import RulesBase
from vitpool.rules.grids import check_patch_rows, checked_grid

Grid = tuple[int, int, int]
# The capacity of clips whose frames pool into one frame's tokens (Kimi-K2.5): rows past each
# item's first frame, (t - 1) * h * w.
EXTRA_ROWS = "extra_rows"


class PatchRows(RulesBase):
    """Sizes of rules with the fields `channels`, `patch_size` and `output_width` and a
    `merge_kernel` (kh, kw): rows of [C, P, P], output rows of [output_width], kh*kw patches per
    output token. A mixin of frozen dataclasses: it adds no fields."""

    channels: int
    patch_size: int
    output_width: int  # the LLM's hidden size (the projector's output)
    merge_kernel: tuple[int, int]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.channels, self.patch_size, self.patch_size)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    @property
    def merge_unit(self) -> int:
        """Patches per output token of a frame."""
        return self.merge_kernel[0] * self.merge_kernel[1]


def patch_grid(
    rules: PatchRows,
    modality: str,
    pixel_shape: tuple[int, ...],
    grid_thw: Any,
    merge_name: str,
    takes_video: bool = True,
) -> Grid:
    """An item's (t, h, w), checked as every grid family checks it (`checked_grid`), with pixels
    of one patch per row, t*h*w rows (h*w for a family without video). ValueError naming what is
    wrong."""
    grid = checked_grid(modality, grid_thw, rules.merge_kernel, merge_name, takes_video)
    t, h, w = grid
    check_patch_rows(pixel_shape, rules.row_shape, grid, t * h * w, "t*h*w" if takes_video else "h*w")
    return grid


def sample_grids(
    rng: random.Random,
    merge_kernel: tuple[int, int],
    num_rows: int,
    num_tokens: int,
    max_items: int,
    frames: tuple[int, int] = (1, 1),
    extra_rows: int = 0,
    max_side_blocks: int | None = None,
) -> list[Grid]:
    """Random grids of `frames[0]` to `frames[1]` frames that together use at most `num_rows` rows,
    `num_tokens` tokens (kh x kw patches of a frame each), `max_items` items and `extra_rows` rows
    past the first frame of each, no side past `max_side_blocks` blocks (None: any): some fill what
    is left, most take a part of it."""
    kh, kw = merge_kernel
    unit = kh * kw
    grids: list[Grid] = []

    def most_blocks(t: int) -> int:  # tokens of the largest t-frame item that still fits
        by_extra = extra_rows // ((t - 1) * unit) if t > 1 else num_tokens
        return min(num_tokens, num_rows // (t * unit), by_extra)

    while len(grids) < max_items:
        fitting = [t for t in range(frames[0], frames[1] + 1) if most_blocks(t) >= 1]
        if not fitting:
            break
        t = rng.choice(fitting)
        max_blocks = most_blocks(t)
        num_blocks = max_blocks if rng.random() < 0.2 else rng.randint(1, max(1, max_blocks // 2))
        side = num_blocks if max_side_blocks is None else min(num_blocks, max_side_blocks)
        height_blocks = rng.randint(1, side)
        width_blocks = max(1, num_blocks // height_blocks)
        if max_side_blocks is not None:
            width_blocks = min(width_blocks, max_side_blocks)
        h, w = height_blocks * kh, width_blocks * kw
        grids.append((t, h, w))
        num_rows -= t * h * w
        num_tokens -= height_blocks * width_blocks
        extra_rows -= (t - 1) * h * w
    return grids
