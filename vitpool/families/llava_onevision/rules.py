"""Item rules of LLaVA-OneVision: what an item is, how many tokens it gives, and the budgets, without
the weights. Importing neither torch nor transformers (a pool's callers unpickle these rules).

An image is its image processor's tiles [n, C, S, S] (S the tower's `image_size`, 384 in the
releases) with its original size (H, W) in pixels, a row of the processor's `image_sizes`:
`Image(out["pixel_values"][i, :n], out["image_sizes"][i])`. The size is the item's layout because
everything after the tower depends on it alone (with the checkpoint's `image_grid_pinpoints` and
`vision_aspect_ratio`):

- the grid: the pinpoint `select_best_resolution` picks for (H, W), gh x gw crops of S pixels; the
  processor emits the whole image resized to S first (the base tile), then the crops row by row,
  so n = gh * gw + 1;
- the unpadding: the crops' features, side = S // patch_size a crop, form a (gh * side) x (gw * side)
  grid, from which the rows (or the columns) the processor's letterbox padding covered are dropped;
- the pooling: where what is left holds more than about max_num_patches (the 9 of "anyres_max_9")
  tiles' worth of features, it is resized bilinearly to about that many;
- the newlines: one `image_newline` token after each row.

What the LLM receives is the base tile's side² tokens, then the rows with their newlines: side² +
rows * (cols + 1) tokens, the processor's placeholder count. An image of one tile is the base
image alone, as the model runs every image of a multi-image prompt (the processor pads it to a
square and cuts no crops): side² + 1 tokens.

A video is its frames [F, C, S, S], no layout (`Video(out["pixel_values_videos"][i])`): each frame
gives its side x side features pooled bilinearly to ceil(side / 2)² tokens, and one newline token
ends the video: F * ceil(side / 2)² + 1 tokens.

Every tile or frame is one attention sequence ("sequences"), and tiles do not come in proportion to
tokens (the unpadding and the pooling see to that), so every budget also bounds its tiles: the
tiles its buffers hold (`max_tiles`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import SEQUENCES, Budget
from vitpool.rules.base import RulesBase
from vitpool.rules.tiles import tile_bounded_budgets
from vitpool.specs import IMAGE, VIDEO, ItemSpec, is_int

# What `vision_aspect_ratio` is made of in Hugging Face's code: "anyres_max_<N>", read there as
# int(value.strip(...)) with these characters (a strip of characters, not a prefix).
ASPECT_RATIO_CHARACTERS = "anyres_max_"
# HF pools the unpadded features only where they exceed max_num_patches tiles' worth by this factor
# (in side length).
POOL_ABOVE_RATIO = 1.1
SIZE_HINT = (
    "Image(out['pixel_values'][i, :n], out['image_sizes'][i]) "
    "(vitpool.items_from(out, family='llava_onevision') cuts them)"
)


def max_num_patches_of(vision_aspect_ratio: str) -> int:
    """The N of "anyres_max_N", read as Hugging Face reads it.

    Raises:
        ValueError: a value Hugging Face's model cannot read either.
    """
    try:
        return int(str(vision_aspect_ratio).strip(ASPECT_RATIO_CHARACTERS))
    except ValueError:
        raise ValueError(
            f"vision_aspect_ratio {vision_aspect_ratio!r} is not 'anyres_max_<N>': Hugging Face's "
            "LLaVA-OneVision reads the most tiles' worth of features an image keeps from it"
        ) from None


def select_best_resolution(size: tuple[int, int], pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """`transformers.image_processing_utils.select_best_resolution`: the (height, width) among
    `pinpoints` that keeps most of an image of `size` (height, width), then wastes least."""
    height, width = size
    best, most_kept, least_wasted = pinpoints[0], 0, float("inf")
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (pin_height, pin_width), kept, wasted
    return best


@dataclass(frozen=True)
class PackedGrid:
    """Where an image's crop features go in what the LLM receives (`LlavaOnevisionModel.
    pack_image_features`, after the base tile's features).

    Attributes:
        grid_rows, grid_cols: crops down and across (gh, gw).
        first_row, first_col: the first row and column of the crops' feature grid the unpadding keeps.
        kept_rows, kept_cols: how many it keeps.
        out_rows, out_cols: the rows and columns the LLM receives: the kept ones, or fewer where
            they are pooled (each row then ends with a newline token).
    """

    grid_rows: int
    grid_cols: int
    first_row: int
    first_col: int
    kept_rows: int
    kept_cols: int
    out_rows: int
    out_cols: int

    @property
    def num_crops(self) -> int:
        return self.grid_rows * self.grid_cols

    @property
    def is_pooled(self) -> bool:
        return (self.out_rows, self.out_cols) != (self.kept_rows, self.kept_cols)

    @property
    def num_tokens(self) -> int:
        """The crops' tokens: each output row and its newline."""
        return self.out_rows * (self.out_cols + 1)


@dataclass(frozen=True)
class LlavaOnevisionRules(RulesBase):
    """LLaVA-OneVision's items: images of tiles [n, C, S, S] with their size (H, W), and videos of
    frames [F, C, S, S]."""

    channels: int
    tile_size: int  # S: the tower's image_size, the side of a tile, a crop and a frame
    patch_size: int
    pinpoints: tuple[tuple[int, int], ...]  # image_grid_pinpoints, (height, width) each
    max_num_patches: int  # the N of vision_aspect_ratio "anyres_max_N"
    output_width: int  # the LLM's hidden size (the projector's output)
    capacities: tuple[str, ...] = (SEQUENCES,)

    def __post_init__(self) -> None:
        if not self.pinpoints or any(
            len(pin) != 2 or min(pin) < self.tile_size or pin[0] % self.tile_size or pin[1] % self.tile_size
            for pin in self.pinpoints
        ):
            raise ValueError(
                f"image_grid_pinpoints {[list(pin) for pin in self.pinpoints]} must be (height, width) pairs "
                f"in whole tiles of image_size {self.tile_size}: Hugging Face's model views the crops' "
                "features as such a grid"
            )
        if self.max_num_patches < 1:
            raise ValueError(f"vision_aspect_ratio's anyres_max_{self.max_num_patches} keeps no features")

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.channels, self.tile_size, self.tile_size)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    @property
    def side(self) -> int:
        """Patches along a tile's side; a tile gives side² features (384 // 14 = 27: the patch
        convolution leaves the last pixels out)."""
        return self.tile_size // self.patch_size

    @property
    def frame_side(self) -> int:
        """A video frame's tokens along a side after the pooling (`apply_pooling`: half, rounded up)."""
        return math.ceil(self.side / 2)

    @functools.cached_property  # the instance's __dict__, not a field: equality and pickling keep to fields
    def max_item_tiles(self) -> int:
        """An image's most tiles: the largest pinpoint's crops and the base tile."""
        return max((h // self.tile_size) * (w // self.tile_size) for h, w in self.pinpoints) + 1

    @functools.cached_property  # read for every batch's rows (`max_tiles`)
    def tokens_per_tile(self) -> int:
        """The most tokens a tile gives, over a base tile alone and every grid unpadded nothing
        (which gives a grid its most tokens): a budget of k times this many tokens holds k tiles,
        so an image whose padding the unpadding drops, or whose features are pooled, gives fewer
        tokens than its tiles' budget holds; it is the tiles that cost."""
        most = self.side**2 + 1
        for height, width in set(self.pinpoints):
            rows, cols = height // self.tile_size, width // self.tile_size
            out_rows, out_cols = self._pooled(rows * self.side, cols * self.side)
            most = max(most, math.ceil((self.side**2 + out_rows * (out_cols + 1)) / (rows * cols + 1)))
        return most

    def max_tiles(self, num_tokens: int) -> int:
        """The tiles a budget of `num_tokens` tokens holds (its buffers' rows)."""
        return -(-num_tokens // self.tokens_per_tile)

    def packed_grid(self, height: int, width: int) -> PackedGrid:
        """Where the crops of an image of `height` x `width` pixels go (`get_anyres_image_grid_shape`,
        `unpad_image` and the pooling of `pack_image_features`, as Hugging Face computes them).

        Raises:
            ValueError: features Hugging Face's model would pool to nothing.
        """
        best_height, best_width = select_best_resolution((height, width), self.pinpoints)
        grid_rows, grid_cols = best_height // self.tile_size, best_width // self.tile_size
        rows, cols = grid_rows * self.side, grid_cols * self.side
        first_row = first_col = 0
        kept_rows, kept_cols = rows, cols
        # the processor letterboxed the image into the pinpoint, centred: drop what padding covers
        if width / height > cols / rows:
            padding = (rows - int(round(height * (cols / width), 7))) // 2
            first_row, kept_rows = padding, rows - 2 * padding
        else:
            padding = (cols - int(round(width * (rows / height), 7))) // 2
            first_col, kept_cols = padding, cols - 2 * padding
        out_rows, out_cols = self._pooled(kept_rows, kept_cols)
        if kept_rows and kept_cols and not (out_rows and out_cols):
            raise ValueError(
                f"an image of {height} x {width} pixels keeps {kept_rows} x {kept_cols} features, which "
                f"vision_aspect_ratio anyres_max_{self.max_num_patches} pools to {out_rows} x {out_cols}: "
                "Hugging Face's model cannot pool it either"
            )
        return PackedGrid(
            grid_rows, grid_cols, first_row, first_col, kept_rows, kept_cols, out_rows, out_cols
        )

    def _pooled(self, rows: int, cols: int) -> tuple[int, int]:
        """The features' rows and columns after `pack_image_features` pools them (where they hold
        over POOL_ABOVE_RATIO² times max_num_patches tiles' worth)."""
        ratio = math.sqrt(rows * cols / (self.max_num_patches * self.side**2))
        if ratio > POOL_ABOVE_RATIO:
            return int(rows // ratio), int(cols // ratio)
        return rows, cols

    def image_tokens(self, num_tiles: int, size: tuple[int, int]) -> int:
        """Tokens of an image of `num_tiles` tiles and this size (one tile: the base image alone)."""
        if num_tiles == 1:
            return self.side**2 + 1
        return self.side**2 + self.packed_grid(*size).num_tokens

    def video_tokens(self, num_frames: int) -> int:
        return num_frames * self.frame_side**2 + 1

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        pixel_shape = tuple(pixel_shape)
        if len(pixel_shape) != 4 or pixel_shape[1:] != self.row_shape:
            raise ValueError(
                f"pixel_values must be tiles [n, {self.channels}, {self.tile_size}, {self.tile_size}] (an "
                f"image's base tile and crops, or a video's frames); got shape {pixel_shape}"
            )
        num_tiles = pixel_shape[0]
        if num_tiles < 1:
            raise ValueError("pixel_values hold no tiles")
        if modality == VIDEO:
            if layout is not None and tuple(layout) != ():
                raise ValueError(
                    f"a video is its frames alone: pass Video(frames) without a grid; got {layout!r}"
                )
            tokens = self.video_tokens(num_tiles)
            return ItemSpec(VIDEO, pixel_shape, pixel_dtype, (), tokens, ((SEQUENCES, num_tiles),))
        size = self.size_of(layout)
        if num_tiles != 1:
            grid = self.packed_grid(*size)
            if num_tiles != grid.num_crops + 1:
                raise ValueError(
                    f"an image of size {size} is cut into {grid.grid_rows} x {grid.grid_cols} crops and a "
                    f"base tile, {grid.num_crops + 1} tiles (the checkpoint's image_grid_pinpoints); got "
                    f"{num_tiles}. Pass the image's own tiles, not the batch's padding: {SIZE_HINT}"
                )
        tokens = self.image_tokens(num_tiles, size)
        return ItemSpec(IMAGE, pixel_shape, pixel_dtype, size, tokens, ((SEQUENCES, num_tiles),))

    def size_of(self, layout: Any) -> tuple[int, int]:
        """An image's (H, W) in pixels, from a row of `image_sizes` (a sequence, tensor or array).

        Raises:
            ValueError: anything but two positive whole numbers.
        """
        values = layout.tolist() if hasattr(layout, "tolist") else layout
        if isinstance(values, (list, tuple)) and len(values) == 1 and isinstance(values[0], (list, tuple)):
            values = values[0]
        if not isinstance(values, (list, tuple)) or len(values) != 2 or not all(is_int(v) for v in values):
            raise ValueError(
                f"an image needs its original size (H, W) in pixels, its row of the processor's image_sizes: "
                f"{SIZE_HINT}; got {layout!r}"
            )
        height, width = (int(v) for v in values)
        if height < 1 or width < 1:
            raise ValueError(f"image size {(height, width)} has a zero or negative side")
        return height, width

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        check_capacity_limits(capacity_limits, self.capacities)
        return tile_bounded_budgets(token_budgets, max_items_per_batch, capacity_limits, self.max_tiles)
