"""Item rules of Llama 3.2 Vision (mllama): an image is its tiles, 1 to `max_num_tiles` of one size,
with its canvas (h, w) in tiles, which names its aspect ratio id. Plain data: no torch, no
transformers (a pool's callers unpickle these rules).

The tower runs every image as `max_num_tiles` tiles whatever it holds (the model's padding tiles
are zeros that the image's real tokens attend to), so an image is one attention sequence
(`sequences`: 1 an image), and a budget's image slots are what its compute is: by default one slot
per `max_num_tiles` tiles of the budget, so that a budget costs about the tiles it is named for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import SEQUENCES, Budget, plain_budgets
from vitpool.rules.base import RulesBase
from vitpool.specs import IMAGE, ItemSpec, is_int


def supported_aspect_ratios(max_num_tiles: int) -> tuple[tuple[int, int], ...]:
    """The canvases (h, w) in tiles that `MllamaImageProcessor` cuts for `max_num_tiles`, in the order
    of their aspect ratio ids (id = position + 1; 0 is a padding image)."""
    return tuple(
        (first, second)
        for first in range(1, max_num_tiles + 1)
        for second in range(1, max_num_tiles + 1)
        if first * second <= max_num_tiles
    )


def parse_canvas(layout: Any) -> tuple[int, int]:
    """(h, w) from an item's grid: a tensor, array or sequence, as [h, w] or [[h, w]]."""
    values = layout.tolist() if hasattr(layout, "tolist") else layout
    if isinstance(values, (list, tuple)) and len(values) == 1 and isinstance(values[0], (list, tuple)):
        values = values[0]
    if not isinstance(values, (list, tuple)) or len(values) != 2 or not all(is_int(v) for v in values):
        raise ValueError(
            f"the grid must be the image's canvas (h, w) in tiles, two integers; got {layout!r}: pass "
            "Image(tiles, (h, w)), or cut the processor's output with vitpool.items_from"
        )
    return int(values[0]), int(values[1])


@dataclass(frozen=True)
class MllamaRules(RulesBase):
    """Items are one image each: pixels [tiles, channels, tile_size, tile_size] (its real tiles, the
    processor's padding tiles left out) and its canvas (h, w), h * w tiles, one of
    `aspect_ratios`; each tile gives `tokens_per_tile` tokens (its patches and a class token)."""

    channels: int
    tile_size: int
    tokens_per_tile: int
    max_num_tiles: int
    aspect_ratios: tuple[tuple[int, int], ...]  # (h, w) of aspect ratio id 1, 2, ...
    output_row_shapes: tuple[tuple[int, ...], ...]
    capacities: tuple[str, ...] = (SEQUENCES,)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.channels, self.tile_size, self.tile_size)

    def aspect_ratio_id(self, canvas: tuple[int, int]) -> int:
        """The model's id of a canvas (h, w): its position among `aspect_ratios`, plus one."""
        return self.aspect_ratios.index(canvas) + 1

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality != IMAGE:
            raise ValueError("this model takes images (tiles) only; send each frame as an Image")
        if len(pixel_shape) != 4 or tuple(pixel_shape[1:]) != self.row_shape:
            raise ValueError(
                f"pixel_values must be tiles [tiles, {self.channels}, {self.tile_size}, {self.tile_size}] "
                f"(one image of the processor's [batch, images, tiles, ...]); got shape {tuple(pixel_shape)}"
            )
        tiles = pixel_shape[0]
        if tiles < 1:
            raise ValueError("pixel_values hold no tiles")
        if layout is None:
            raise ValueError(
                "an image needs its canvas (h, w) in tiles, which names its aspect ratio id: pass "
                "Image(tiles, (h, w)), or cut the processor's output with vitpool.items_from"
            )
        canvas = parse_canvas(layout)
        if canvas not in self.aspect_ratios:
            raise ValueError(
                f"canvas {canvas} is not one of the model's aspect ratios {list(self.aspect_ratios)} (h, w)"
            )
        if tiles != canvas[0] * canvas[1]:
            raise ValueError(
                f"pixel_values hold {tiles} tiles; canvas {canvas} has {canvas[0] * canvas[1]} (pass the "
                "image's real tiles, pixel_values[b, i, :h*w], without the processor's padding tiles)"
            )
        return ItemSpec(
            modality, tuple(pixel_shape), pixel_dtype, canvas, tiles * self.tokens_per_tile, ((SEQUENCES, 1),)
        )

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """Each budget bounds its images (`sequences`): by default one per `max_num_tiles` of its
        tiles, rounded up; `capacity_limits["sequences"]` sets that bound instead (at most its tiles)."""
        check_capacity_limits(capacity_limits, self.capacities)
        chosen = capacity_limits.get(SEQUENCES)
        budgets = []
        for budget in plain_budgets(token_budgets, max_items_per_batch):
            tiles = -(-budget.num_tokens // self.tokens_per_tile)
            images = min(tiles, chosen) if chosen is not None else -(-tiles // self.max_num_tiles)
            images = min(images, budget.max_items)
            budgets.append(dataclasses.replace(budget, limits=((SEQUENCES, images),), max_items=images))
        return sorted(budgets)
