"""Item rules of tiled towers: an image is whole tiles of one fixed size, each a fixed number of
output tokens (InternVL's 448² tiles, 256 tokens each). A tower that takes square tiles of any
side (`SquareTiles`: Step-3.7's and DeepSeek-OCR-2's crops) takes tiles of another side too: such
an item fits no graph (its spec needs `vitpool.specs.NO_GRAPH`) and runs eagerly at its own size.
Plain data: no torch, no transformers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import SEQUENCES, Budget, plain_budgets
from vitpool.rules.base import RulesBase
from vitpool.specs import IMAGE, NO_GRAPH, ItemSpec


@dataclass(frozen=True)
class SquareTiles:
    """The square tiles of any side a tower takes, and their tokens: the patch convolution reads
    floor(S / patch_size) patches a side (pixels past the last whole patch are not read), which
    shrink by `reduction` a side, rounding up (Step-3.7's and DeepSeek-OCR-2's two stride-2
    convolutions: 4). A tile gives that many tokens squared, or, with `query_tables`, the rows of
    the first table that holds them, else of the last (DeepSeek-OCR-2's 144 and 256 learned
    queries, which the tower picks by its SAM token count).

    Raises:
        ValueError: a size that is not positive, or tables not in increasing order.
    """

    patch_size: int
    reduction: int
    query_tables: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.reduction < 1:
            raise ValueError(
                f"patch_size and reduction must be positive; got {self.patch_size}, {self.reduction}"
            )
        if list(self.query_tables) != sorted(set(self.query_tables)) or any(q < 1 for q in self.query_tables):
            raise ValueError(f"query_tables must be positive and increasing; got {self.query_tables}")

    def tokens(self, side: int) -> int:
        """Output tokens of one tile `side` pixels a side (at least one patch)."""
        per_side = -(-(side // self.patch_size) // self.reduction)
        reduced = per_side * per_side
        if not self.query_tables:
            return reduced
        return next((rows for rows in self.query_tables if reduced <= rows), self.query_tables[-1])


@dataclass(frozen=True)
class TileRules(RulesBase):
    """Items are images of whole tiles: pixels [tiles, channels, tile_size, tile_size], as the
    family's processor emits them for one image, and no grid. A tile attends within itself: it is
    one attention sequence ("sequences", what the pool's cost model reads to price attention),
    and a batch is bounded by its tokens and items, and by its tiles only where the user sets
    `max_frames_per_batch`.

    With `other_sides`, square tiles of another side the tower takes are items too, of their own
    shape and tokens (`SquareTiles`); the buffers and graphs hold `tile_size` only, so such an item
    needs `NO_GRAPH`, which every budget limits to 0: it runs eagerly, alone, at its own size.

    Raises:
        ValueError: `other_sides` counts `tile_size`'s tiles otherwise than `tokens_per_tile`.
    """

    channels: int
    tile_size: int
    tokens_per_tile: int
    output_row_shapes: tuple[tuple[int, ...], ...]
    capacities: tuple[str, ...] = (SEQUENCES,)
    max_tiles_per_item: int | None = None  # Step-3.7's global view: one tile an image
    # Where `tile_size` was set and how to change it, named when square tiles of another size are
    # refused (a processor setting: Aya Vision's, Idefics3's tiles); "" gives the plain error.
    tile_size_source: str = ""
    # The other square sides the tower takes (Step-3.7's and DeepSeek-OCR-2's crops); None: none.
    other_sides: SquareTiles | None = None

    def __post_init__(self) -> None:
        counted = None if self.other_sides is None else self.other_sides.tokens(self.tile_size)
        if counted is not None and counted != self.tokens_per_tile:
            raise ValueError(
                f"tiles of {self.tile_size} pixels give {self.tokens_per_tile} tokens; "
                f"other_sides counts {counted}"
            )

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
        if len(pixel_shape) != 4 or pixel_shape[1] != self.channels:
            raise ValueError(self._shape_error(pixel_shape))
        served = tuple(pixel_shape[2:]) == (self.tile_size, self.tile_size)
        tokens_per_tile = self.tokens_per_tile if served else self._other_side_tokens(pixel_shape)
        if pixel_shape[0] < 1:
            raise ValueError("pixel_values hold no tiles")
        if self.max_tiles_per_item is not None and pixel_shape[0] > self.max_tiles_per_item:
            raise ValueError(
                f"pixel_values hold {pixel_shape[0]} tiles; an item has at most {self.max_tiles_per_item} "
                "(one image: pass each image as its own item)"
            )
        tiles = pixel_shape[0]
        needs = ((SEQUENCES, tiles),) if served else ((NO_GRAPH, 1), (SEQUENCES, tiles))
        return ItemSpec(modality, tuple(pixel_shape), pixel_dtype, (), tiles * tokens_per_tile, needs)

    def _other_side_tokens(self, pixel_shape: tuple[int, ...]) -> int:
        """Tokens of one of these tiles, not of `tile_size`: square tiles of a side the tower takes
        (`other_sides`); ValueError naming what is wrong otherwise."""
        side = pixel_shape[2]
        if side != pixel_shape[3] or (self.other_sides is None and not self.tile_size_source):
            raise ValueError(self._shape_error(pixel_shape))
        if self.other_sides is None:
            raise ValueError(
                f"tiles of {side} pixels; this encoder was built for tiles of {self.tile_size} "
                f"({self.tile_size_source})"
            )
        if side < self.other_sides.patch_size:
            raise ValueError(
                f"tiles of {side} pixels are smaller than one {self.other_sides.patch_size}-pixel patch: "
                "the tower cannot take them"
            )
        return self.other_sides.tokens(side)

    def _shape_error(self, pixel_shape: tuple[int, ...]) -> str:
        tiles = f"[tiles, {self.channels}, {self.tile_size}, {self.tile_size}]"
        if self.other_sides is not None:
            tiles += (
                f" (or square tiles of another side of at least {self.other_sides.patch_size} pixels, "
                "which run eagerly)"
            )
        return f"pixel_values must be tiles {tiles}; got shape {tuple(pixel_shape)}"

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """Budgets bounded by tokens and items; by tiles where `capacity_limits` bounds them (the
        buffers hold whole tiles: tokens bound them already); with `other_sides`, room for no
        item of another side (`NO_GRAPH`)."""
        check_capacity_limits(capacity_limits, self.capacities)
        budgets = plain_budgets(token_budgets, max_items_per_batch)
        limits = {NO_GRAPH: 0} if self.other_sides is not None else {}
        if SEQUENCES in capacity_limits:
            limits[SEQUENCES] = capacity_limits[SEQUENCES]
        if not limits:
            return budgets
        return [dataclasses.replace(budget, limits=tuple(sorted(limits.items()))) for budget in budgets]


def tile_bounded_budgets(
    token_budgets: Sequence[int],
    max_items_per_batch: int | None,
    capacity_limits: Mapping[str, int],
    max_tiles: Callable[[int], int],
) -> list[Budget]:
    """Budgets of rules whose items are whole tiles of unlike token counts (LLaVA-OneVision's
    pooled tiles, Molmo 2's crops): each bounded by the tiles its tokens can hold (`max_tiles` of
    its tokens), or fewer where `capacity_limits` bounds them, and by as many items (an item has a
    tile at least). The caller checked `capacity_limits` against its capacities."""
    user_tiles = capacity_limits.get(SEQUENCES)
    budgets = []
    for budget in plain_budgets(token_budgets, max_items_per_batch):
        tiles = max_tiles(budget.num_tokens)
        tiles = tiles if user_tiles is None else min(tiles, user_tiles)
        budgets.append(
            dataclasses.replace(budget, limits=((SEQUENCES, tiles),), max_items=min(budget.max_items, tiles))
        )
    return sorted(budgets)
