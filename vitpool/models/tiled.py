"""What the adapters of tiled towers share: rows are whole tiles, each a fixed-length attention
sequence that the tower runs as its batch dimension, so a batch needs no metadata; a padding
tile is a zero tile whose tokens nobody reads. A family subclass sets `tower`, `item_rules`
(`TileRules`), `tokens_per_tile` and `max_graph_tiles`, and writes `forward`.

A global-view-and-crops tower (Step-3.7, DeepSeek-OCR-2) takes crops of any size its patch
convolution can cut, but the size is its image processor's setting, not the model's: `crop_size_of`
reads it where the checkpoint says it. An encoder's crop path has buffers and graphs of that one
size, the fast path. Square crops of another size the tower takes are items too (the crop path's
`TileRules.other_sides`): of their own shape and tokens, no graph serves them, so each such item
runs eagerly, alone, at its own size, the path of an item over every budget, and `PathTiles`
warns once per encoder and size, naming where the encoder's size was set and how to make theirs
the fast path. The towers make what their forwards precompute per size (rotary positions, masks)
for such a size on the fly, kept per size (`TablesBySize`). Non-square crops, crops smaller than a
patch and a wrong channel count are refused where the caller's items are checked.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vitpool.errors import CheckpointError
from vitpool.kernels.compiled import install_compiled_blocks
from vitpool.kernels.fused import install_fused_ops
from vitpool.models.adapter_base import AdapterBase
from vitpool.models.loading import IMAGE_PROCESSOR_ATTRIBUTE
from vitpool.models.protocol import BudgetRange, TensorSpec
from vitpool.packing import Budget
from vitpool.rules.paths import PathRules
from vitpool.rules.tiles import SquareTiles, TileRules
from vitpool.specs import IMAGE, ItemSpec

logger = logging.getLogger(__name__)

# The inputs of a tower that runs a global view and local crops (Step-3.7, DeepSeek-OCR-2), as
# their processors name them: one view an image, any number of crops.
GLOBAL_VIEW = "pixel_values"
LOCAL_CROPS = "pixel_values_local"
# How to make crops of another size the fast path, wherever the encoder's crop size came from.
OTHER_CROP_SIZES = (
    "set local_image_size in the vision config (config.json) or save the processor's config that cuts "
    "them beside the checkpoint"
)


@dataclass(frozen=True)
class CropSize:
    """The side of a global-view-and-crops tower's local crops in pixels, where it was set, and how
    to set another (named when crops of another size run eagerly: `PathTiles`)."""

    pixels: int
    source: str
    change: str = OTHER_CROP_SIZES

    @classmethod
    def of(cls, size: int | CropSize) -> CropSize:
        """`size` as it is, or a number of pixels given to the encoder module directly."""
        if isinstance(size, CropSize):
            return size
        return cls(
            int(size),
            "the local_image_size the encoder module was built with",
            "build the module with their size",
        )


def crop_size_of(config: Any, processor_class: str, processor_key: str, default: int) -> CropSize:
    """The side of the crops a tower's image processor cuts, the first of:

    1. `local_image_size` in the vision config: vitpool's own setting, for crops of another size than
       the saved processor config's (a processor called with another size) or a checkpoint without
       one;
    2. the image processor's `processor_key` in the processor config saved beside the checkpoint
       (`vitpool.models.loading` attaches it to the config it builds the tower from);
    3. `processor_class`'s default, `default`.

    Raises:
        CheckpointError: a size that is no positive whole number of pixels (names where it was set).
    """
    explicit = getattr(config, "local_image_size", None)
    if explicit is not None:
        where = "local_image_size in the checkpoint's vision config"
        return CropSize(_pixels(explicit, where), where, "change it there")
    saved = getattr(config, IMAGE_PROCESSOR_ATTRIBUTE, None)
    if saved is not None and saved["settings"].get(processor_key) is not None:
        where = f"{processor_key} in {saved['file']}"
        return CropSize(_pixels(saved["settings"][processor_key], where), where)
    return CropSize(
        default,
        f"{processor_class}'s default {processor_key}: the checkpoint has no processor config that sets it",
    )


def _pixels(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where} is {value!r}; a crop's side is a positive whole number of pixels")
    return value


def check_tiles_fit(specs: Sequence[ItemSpec], num_rows: int, budget: Budget, unit: str = "tiles") -> None:
    """Raise ValueError where the items' tiles (`unit`: what the family calls them) or tokens are
    more than the buffers of `num_rows` tiles and `budget`'s tokens hold."""
    num_tiles = sum(spec.num_rows for spec in specs)
    num_tokens = sum(spec.num_tokens for spec in specs)
    if num_tiles > num_rows or num_tokens > budget.num_tokens:
        raise ValueError(
            f"{len(specs)} items need {num_tiles} {unit} and {num_tokens} tokens; the buffers hold "
            f"{num_rows} {unit} and {budget.num_tokens} tokens"
        )


def install_kernels(tower: torch.nn.Module) -> None:
    """The fused ops (`fused_ops`: the patch convolution as a GEMM, the rotary embedding) and the
    compiled blocks (`compiled_blocks`) for a tiled tower, each in effect only under its setting;
    a tile's attention is plain SDPA over the tile (the batch dimension), so no attention hook."""
    install_fused_ops(tower)
    install_compiled_blocks(tower)


class TiledAdapter(AdapterBase):
    """The adapter protocol's sizes, metadata, budgets and samples for a tiled tower."""

    item_rules: TileRules
    tokens_per_tile: int
    max_graph_tiles: int  # the default budgets hold up to this many tiles; more run eager
    MAX_SAMPLED_ITEMS = 6  # tiles are large: a few make a batch

    def max_rows(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_tile)

    def budget_range(self, device: torch.device) -> BudgetRange:
        """Whole tiles: a budget between two tile counts would only add padding."""
        step = self.tokens_per_tile
        return BudgetRange(step, self.max_graph_tiles * step, step)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {}

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        needed = sum(spec.num_rows for spec in specs)
        if needed > num_rows:
            raise ValueError(f"{len(specs)} items need {needed} tiles; the buffers hold {num_rows}")
        return {}

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        specs: list[ItemSpec] = []
        tiles_left = min(num_rows, budget.num_tokens // self.tokens_per_tile)
        while tiles_left > 0 and len(specs) < self.sampled_items(budget):
            # Sometimes fill the rest, usually not, so that padding tiles are exercised too.
            tiles = tiles_left if rng.random() < 0.2 else rng.randint(1, max(1, tiles_left // 2))
            tiles = min(tiles, self.item_rules.max_tiles_per_item or tiles)
            specs.append(self.item_rules.item_spec(IMAGE, (tiles, *self.row_shape), "float32", None))
            tiles_left -= tiles
        return specs


class PathTiles(TiledAdapter):
    """One path of a global-view-and-crops tower: its tiles of one size, `tokens_per_tile` each,
    one tile an item on the global view's path. A family subclass writes `forward_tiles`.

    Args:
        crop: the crop path's size and where it was set (None: the global view's path); with
            `other_sides`, the square sides besides it that the tower takes (`TileRules`).
    """

    def __init__(
        self,
        tower: torch.nn.Module,
        path: str,
        channels: int,
        tile_size: int,
        tokens_per_tile: int,
        output_width: int,
        max_graph_tiles: int,
        crop: CropSize | None = None,
        other_sides: SquareTiles | None = None,
    ) -> None:
        self.tower = tower
        self.path = path
        self.max_graph_tiles = max_graph_tiles
        self.tokens_per_tile = tokens_per_tile
        self.crop = crop
        self.item_rules = TileRules(
            channels,
            tile_size,
            tokens_per_tile,
            ((output_width,),),
            max_tiles_per_item=1 if path == GLOBAL_VIEW else None,
            other_sides=other_sides,
        )
        self._warned_sides: set[int] = set()  # sides run eagerly and warned of (runs hold the runner's lock)

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """`forward_tiles` on tiles [n, C, S, S]; crops of a side no graph serves (an eager run)
        are warned of, once a side."""
        side = int(pixels.shape[-1])
        if self.crop is not None and side != self.crop.pixels and side not in self._warned_sides:
            self._warned_sides.add(side)
            logger.warning(
                "crops of %d pixels: no graph serves them (the encoder's crops are %d, from %s); they "
                "run eagerly at their own size. To make crops of %d pixels the fast path (graphs), %s",
                side,
                self.crop.pixels,
                self.crop.source,
                side,
                self.crop.change,
            )
        return self.forward_tiles(pixels)

    def forward_tiles(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """The tower on tiles [n, C, S, S] of this path: [n * tokens a tile, width], per output."""
        raise NotImplementedError(f"{type(self).__name__} writes forward_tiles")


class TablesBySize:
    """Shape-only tensors a tower's forward reads (rotary positions, masks) for a size whose
    tiles no graph serves: made on first use, kept per size and device. The sizes the graphs run
    keep theirs as the module's buffers (which a capture holds); these are for eager runs only."""

    def __init__(self) -> None:
        self._tables: dict[tuple[Hashable, torch.device], Any] = {}

    def get(self, key: Hashable, device: torch.device, make: Callable[[], Any]) -> Any:
        """The tables under `key` on `device`: `make()`'s tensor (or tuple of tensors), moved there once."""
        kept = self._tables.get((key, device))
        if kept is None:
            made = make()
            kept = tuple(t.to(device) for t in made) if isinstance(made, tuple) else made.to(device)
            self._tables[(key, device)] = kept
        return kept


class ViewAndCropsAdapter(AdapterBase):
    """A tower that runs a global view and local crops, each a path of its own (`PathRules`): an
    image's crops' tokens first, then its view's, as Step-3.7 and DeepSeek-OCR-2 hand them over.

    Its crops' side is its image processor's setting: `crop_size` reads it where the checkpoint
    says it, from `CROP_SETTING` (the processor class, its key for the side, its default).
    """

    CROP_SETTING: tuple[str, str, int]

    def __init__(self, tower: torch.nn.Module, crops: PathTiles, view: PathTiles) -> None:
        self.tower = tower
        self.paths = {LOCAL_CROPS: crops, GLOBAL_VIEW: view}
        self.item_rules = PathRules(
            tuple((path, adapter.item_rules) for path, adapter in self.paths.items()), required=(GLOBAL_VIEW,)
        )

    @classmethod
    def crop_size(cls, config: Any) -> CropSize:
        """The side of the checkpoint's crops: the vision config's `local_image_size`, else the
        processor config's setting, else the processor's default (`crop_size_of`).

        Raises:
            CheckpointError: a size that is no positive whole number of pixels.
        """
        return crop_size_of(config, *cls.CROP_SETTING)
