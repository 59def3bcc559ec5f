"""What the adapters of tiled towers share: rows are whole tiles, each a fixed-length attention
sequence that the tower runs as its batch dimension, so a batch needs no metadata; a padding
tile is a zero tile whose tokens nobody reads. A family subclass sets `tower`, `item_rules`
(`TileRules`), `tokens_per_tile` and `max_graph_tiles`, and writes `forward`.

A global-view-and-crops tower (Step-3.7, DeepSeek-OCR-2) takes crops of any size its patch
convolution can cut, but the size is its image processor's setting, not the model's: `crop_size_of`
reads it where the checkpoint says it. An encoder runs one crop size (each path's buffers and
graphs are of one tile shape); crops of another size are refused where the caller's items are
checked, with a message that says where the size was set.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
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
from vitpool.rules.tiles import TileRules
from vitpool.specs import IMAGE, ItemSpec

# The inputs of a tower that runs a global view and local crops (Step-3.7, DeepSeek-OCR-2), as
# their processors name them: one view an image, any number of crops.
GLOBAL_VIEW = "pixel_values"
LOCAL_CROPS = "pixel_values_local"
# What to do about crops of another size, wherever the encoder's crop size came from.
OTHER_CROP_SIZES = (
    "for crops of another size, set local_image_size in the vision config (config.json) or save the "
    "processor's config that cuts them beside the checkpoint"
)


@dataclass(frozen=True)
class CropSize:
    """The side of a global-view-and-crops tower's local crops in pixels, and where it was set (named
    when crops of another size are refused)."""

    pixels: int
    source: str

    @classmethod
    def of(cls, size: int | CropSize) -> CropSize:
        """`size` as it is, or a number of pixels given to the encoder module directly."""
        if isinstance(size, CropSize):
            return size
        return cls(int(size), f"the local_image_size the encoder module was built with; {OTHER_CROP_SIZES}")


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
        return CropSize(_pixels(explicit, where), f"{where}; for crops of another size, change it there")
    saved = getattr(config, IMAGE_PROCESSOR_ATTRIBUTE, None)
    if saved is not None and saved["settings"].get(processor_key) is not None:
        where = f"{processor_key} in {saved['file']}"
        return CropSize(_pixels(saved["settings"][processor_key], where), f"{where}; {OTHER_CROP_SIZES}")
    return CropSize(
        default,
        (
            f"{processor_class}'s default {processor_key}: the checkpoint has no processor config that sets "
            f"it; {OTHER_CROP_SIZES}"
        ),
    )


def _pixels(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where} is {value!r}; a crop's side is a positive whole number of pixels")
    return value


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
    one tile an item on the global view's path. A family subclass writes `forward`."""

    def __init__(
        self,
        tower: torch.nn.Module,
        path: str,
        channels: int,
        tile_size: int,
        tokens_per_tile: int,
        output_width: int,
        max_graph_tiles: int,
        tile_size_source: str = "",
    ) -> None:
        self.tower = tower
        self.path = path
        self.max_graph_tiles = max_graph_tiles
        self.tokens_per_tile = tokens_per_tile
        self.item_rules = TileRules(
            channels,
            tile_size,
            tokens_per_tile,
            ((output_width,),),
            max_tiles_per_item=1 if path == GLOBAL_VIEW else None,
            tile_size_source=tile_size_source,
        )


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
