"""Item rules of Molmo 2: what an item is, how many tokens it gives, which patches each token pools,
and the budgets, without the weights. Importing neither torch nor transformers (a pool's callers
unpickle these rules); the pooling windows are NumPy arrays.

A crop is the tower's fixed input: side x side patches (side = 378 // 14 = 27 in the releases, the
tower's `num_position_embeddings`), each a row of P*P*C pixels, so an item's pixels are its crops
[n, side², P*P*C], as `Molmo2ImageProcessor` emits them. What the LLM receives is one token per
pooling window: the mean of the window's patch features (the layers of `vision_feature_layer`, side
by side) attends to the window's patches, then the projector. Which patches each window holds is
the processor's geometry, which the item's layout gives as plain integers:

- an image: (tiling_h, tiling_w, pool_h, pool_w, left, right), its grid's crops and the processor's
  `pooling_size` and `overlap_margins`. Its crops are the global view (the image resized to one
  crop) and tiling_h x tiling_w overlapping crops, n = tiling_h * tiling_w + 1. The global view's
  side x side patches are pooled in windows of pool_h x pool_w (the grid padded with -1 around, as
  `arange_for_pooling` does), then the canvas the crops tile: each crop without the margins its
  neighbours overlap, side by side, pooled the same way;
- a video: (pool_h, pool_w), the video processor's `pooling_size`: every frame is one crop, its
  patches pooled in those windows, frame after frame.

Every crop is one attention sequence ("sequences"), and crops do not come in proportion to tokens
(the overlap and the pooling size see to that), so every budget also bounds its crops.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import SEQUENCES, Budget
from vitpool.rules.base import RulesBase
from vitpool.rules.tiles import tile_bounded_budgets
from vitpool.specs import IMAGE, VIDEO, ItemSpec, is_int

IMAGE_LAYOUT = "(tiling_h, tiling_w, pool_h, pool_w, left_margin, right_margin)"
VIDEO_LAYOUT = "(pool_h, pool_w)"
HINT = "vitpool.items_from(out, family='molmo2') cuts the processor's output into items"
# The pooling the releases' processors use: 2 x 2 for images, 3 x 3 for video frames. A budget holds
# a crop for every ceil(side / 2)² tokens, the most one crop gives at the finer of the two.
BUDGET_POOL = 2


def pooling_windows(index_grid: np.ndarray, pool_h: int, pool_w: int) -> np.ndarray:
    """`arange_for_pooling` of Molmo 2's processors: a [h, w] grid of patch indices (-1: none) padded
    with -1 to whole windows (the padding split around it, the larger half after) -> one row of
    pool_h * pool_w indices per window, row by row."""
    height, width = index_grid.shape
    pad_h = -(-height // pool_h) * pool_h - height
    pad_w = -(-width // pool_w) * pool_w - width
    padded = np.pad(
        index_grid, ((pad_h // 2, (pad_h + 1) // 2), (pad_w // 2, (pad_w + 1) // 2)), constant_values=-1
    )
    rows, cols = padded.shape[0] // pool_h, padded.shape[1] // pool_w
    return padded.reshape(rows, pool_h, cols, pool_w).transpose(0, 2, 1, 3).reshape(rows * cols, -1)


def canvas_grid(side: int, tiling_h: int, tiling_w: int, left: int, right: int) -> np.ndarray:
    """The canvas the crops tile, as patch indices into the crops (crop-major, from 0): each crop's
    patches less the margins its neighbours overlap (`_build_overlapping_crops`)."""
    grid = np.arange(tiling_h * tiling_w * side * side, dtype=np.int64).reshape(
        tiling_h, tiling_w, side, side
    )
    keep = np.ones_like(grid, dtype=bool)
    if left:
        keep[1:, :, :left, :] = False
        keep[:, 1:, :, :left] = False
    if right:
        keep[:-1, :, -right:, :] = False
        keep[:, :-1, :, -right:] = False
    rows = tiling_h * (side - left - right) + left + right
    return grid.transpose(0, 2, 1, 3)[keep.transpose(0, 2, 1, 3)].reshape(rows, -1)


@functools.lru_cache(maxsize=256)
def item_windows(side: int, modality: str, num_crops: int, layout: tuple[int, ...]) -> np.ndarray:
    """An item's pooling windows [tokens, pool_h * pool_w]: indices into its crops' patches, flattened
    from its first crop's first patch; -1 where a window is padding. Read-only (it is cached)."""
    square = np.arange(side * side, dtype=np.int64).reshape(side, side)
    if modality == VIDEO:
        pool_h, pool_w = layout
        frame = pooling_windows(square, pool_h, pool_w)
        frames = [np.where(frame >= 0, frame + index * side * side, -1) for index in range(num_crops)]
        windows = np.concatenate(frames)
    else:
        tiling_h, tiling_w, pool_h, pool_w, left, right = layout
        crops = pooling_windows(canvas_grid(side, tiling_h, tiling_w, left, right), pool_h, pool_w)
        crops = np.where(crops >= 0, crops + side * side, -1)  # after the global view's patches
        windows = np.concatenate([pooling_windows(square, pool_h, pool_w), crops])
    windows.setflags(write=False)
    return windows


@dataclass(frozen=True)
class Molmo2Rules(RulesBase):
    """Molmo 2's items: images and videos of crops [n, side², patch_width], with their layout."""

    side: int  # patches along a crop's side (the tower's num_position_embeddings is side²)
    patch_width: int  # P * P * C
    output_width: int  # the LLM's hidden size (the projector's output)
    max_pool_slots: int = 9  # patches a window pools at most: the metadata's width (the videos' 3 x 3)
    capacities: tuple[str, ...] = (SEQUENCES,)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.side * self.side, self.patch_width)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    @property
    def tokens_per_crop(self) -> int:
        """Tokens a budget holds per crop (`BUDGET_POOL`): a budget of k times this holds k crops."""
        return math.ceil(self.side / BUDGET_POOL) ** 2

    def max_crops(self, num_tokens: int) -> int:
        """The crops a budget of `num_tokens` tokens holds (its buffers' rows)."""
        return -(-num_tokens // self.tokens_per_crop)

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        pixel_shape = tuple(pixel_shape)
        if len(pixel_shape) != 3 or pixel_shape[1:] != self.row_shape:
            raise ValueError(
                f"pixel_values must be crops [n, {self.side * self.side}, {self.patch_width}] (an image's "
                f"global view and crops, or a video's frames, each {self.side} x {self.side} patches); got "
                f"shape {pixel_shape}. {HINT}"
            )
        num_crops = pixel_shape[0]
        if num_crops < 1:
            raise ValueError("pixel_values hold no crops")
        values = self.layout_of(modality, layout)
        if modality == IMAGE and num_crops != values[0] * values[1] + 1:
            raise ValueError(
                f"an image tiled {values[0]} x {values[1]} has {values[0] * values[1] + 1} crops (its global "
                f"view first); got {num_crops}"
            )
        tokens = len(item_windows(self.side, modality, num_crops, values))
        return ItemSpec(modality, pixel_shape, pixel_dtype, values, tokens, ((SEQUENCES, num_crops),))

    def layout_of(self, modality: str, layout: Any) -> tuple[int, ...]:
        """An item's layout as plain integers, checked.

        Raises:
            ValueError: not the modality's integers, or a geometry the processor cannot give.
        """
        expected = VIDEO_LAYOUT if modality == VIDEO else IMAGE_LAYOUT
        values = layout.tolist() if hasattr(layout, "tolist") else layout
        length = 2 if modality == VIDEO else 6
        if (
            not isinstance(values, (list, tuple))
            or len(values) != length
            or not all(is_int(v) for v in values)
        ):
            raise ValueError(
                f"a Molmo 2 {modality} needs its layout {expected} as the grid; got {layout!r}. {HINT}"
            )
        values = tuple(int(v) for v in values)
        pool_h, pool_w = values[-2:] if modality == VIDEO else values[2:4]
        if min(values[:4] if modality == IMAGE else values) < 1 or min(values) < 0:
            raise ValueError(f"layout {expected} = {values}: tilings and pooling sizes are positive")
        if pool_h * pool_w > self.max_pool_slots:
            raise ValueError(
                f"a pooling of {pool_h} x {pool_w} patches is over the encoder's {self.max_pool_slots} slots "
                "a token (max_pool_slots of its rules)"
            )
        if modality == IMAGE and values[4] + values[5] >= self.side:
            raise ValueError(f"overlap margins {values[4:]} leave nothing of a crop of {self.side} patches")
        return values

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        check_capacity_limits(capacity_limits, self.capacities)
        return tile_bounded_budgets(token_budgets, max_items_per_batch, capacity_limits, self.max_crops)
