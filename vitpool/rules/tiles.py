"""Item rules of tiled towers: an image is whole tiles of one fixed size, each a fixed number of
output tokens (InternVL's 448² tiles, 256 tokens each). Plain data: no torch, no transformers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import SEQUENCES, Budget, plain_budgets
from vitpool.rules.base import RulesBase
from vitpool.specs import IMAGE, ItemSpec


@dataclass(frozen=True)
class TileRules(RulesBase):
    """Items are images of whole tiles: pixels [tiles, channels, tile_size, tile_size], as the
    family's processor emits them for one image, and no grid. A tile attends within itself: it is
    one attention sequence ("sequences", what the pool's cost model reads to price attention),
    and a batch is bounded by its tokens and items, and by its tiles only where the user sets
    `max_frames_per_batch`."""

    channels: int
    tile_size: int
    tokens_per_tile: int
    output_row_shapes: tuple[tuple[int, ...], ...]
    capacities: tuple[str, ...] = (SEQUENCES,)
    max_tiles_per_item: int | None = None  # Step-3.7's global view: one tile an image
    # Where `tile_size` was set and how to change it, named when square tiles of another size are
    # refused (a processor setting: Step-3.7's and DeepSeek-OCR-2's crops); "" gives the plain error.
    tile_size_source: str = ""

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.channels, self.tile_size, self.tile_size)

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality != IMAGE:
            raise ValueError("this model takes images (tiles) only; send each frame as an Image")
        if layout is not None and layout != ():  # (): a spec's own layout, given back to check it
            raise ValueError(f"tiled items have no grid; pass Image(pixels) without grid_thw, got {layout!r}")
        if (
            self.tile_size_source
            and len(pixel_shape) == 4
            and pixel_shape[1] == self.channels
            and (pixel_shape[2] == pixel_shape[3] != self.tile_size)
        ):
            raise ValueError(
                f"tiles of {pixel_shape[2]} pixels; this encoder was built for tiles of {self.tile_size} "
                f"({self.tile_size_source})"
            )
        if len(pixel_shape) != 4 or tuple(pixel_shape[1:]) != self.row_shape:
            raise ValueError(
                f"pixel_values must be tiles [tiles, {self.channels}, {self.tile_size}, {self.tile_size}]; "
                f"got shape {tuple(pixel_shape)}"
            )
        if pixel_shape[0] < 1:
            raise ValueError("pixel_values hold no tiles")
        if self.max_tiles_per_item is not None and pixel_shape[0] > self.max_tiles_per_item:
            raise ValueError(
                f"pixel_values hold {pixel_shape[0]} tiles; an item has at most {self.max_tiles_per_item} "
                "(one image: pass each image as its own item)"
            )
        tiles = pixel_shape[0]
        return ItemSpec(
            modality, tuple(pixel_shape), pixel_dtype, (), tiles * self.tokens_per_tile, ((SEQUENCES, tiles),)
        )

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        check_capacity_limits(capacity_limits, self.capacities)
        budgets = plain_budgets(token_budgets, max_items_per_batch)
        max_tiles = capacity_limits.get(SEQUENCES)
        if max_tiles is None:  # the buffers hold whole tiles: tokens bound them already
            return budgets
        return [dataclasses.replace(budget, limits=((SEQUENCES, max_tiles),)) for budget in budgets]
