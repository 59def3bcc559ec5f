"""What LLaVA-OneVision's adapter (`adapter.py` here) and LLaVA-NeXT's
(`vitpool.families.llava_next.adapter`) share: a tower that runs an item's tiles as its batch, a
projector, a newline embedding, and a packing that is one static gather over a table of every
tile's projected features, then the newline embedding. Which rows of the table each output token
reads depends only on the item's tile count and size, so the host computes it (`taps.py`), each
item's rows offset to its first tile in the buffer.

A family subclass sets the tower-only config class (`VISION_CONFIG`), the settings of the full
config its packing reads (`PACKING_SETTINGS`), the metadata keys (`TAPS_KEY`, and `WEIGHTS_KEY`
where tokens mix several rows), and writes `_item_taps`, `_random_spec`, `metadata_specs` and
`forward`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from vitpool.families.llava.adapter import LlavaEncoder
from vitpool.families.llava_onevision.taps import NEWLINE
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, AdapterBase, ConfigField, renames
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import zero_metadata
from vitpool.models.tiled import check_tiles_fit
from vitpool.packing import SEQUENCES, Budget
from vitpool.specs import ItemSpec

# Sampled check batches keep their images within this factor of the largest pinpoint.
MAX_SAMPLE_ATTEMPTS = 60
SAMPLED_SIZE_FACTOR = 1.5
Tensors = dict[str, torch.Tensor]


class TileTableEncoder(LlavaEncoder):
    """The tower, the projector and the newline embedding, with what `get_image_features` reads of
    the full config (`settings`): the feature selection (as LLaVA's encoder holds it), the
    pinpoints and the subclass's `PACKING_SETTINGS`."""

    PACKING_SETTINGS: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        vision_tower: torch.nn.Module,
        projector: torch.nn.Module,
        image_newline: torch.Tensor,
        settings: Any,
    ) -> None:
        super().__init__(vision_tower, projector, settings)
        self.image_newline = torch.nn.Parameter(image_newline.detach().clone(), requires_grad=False)
        self.image_grid_pinpoints = tuple(tuple(int(v) for v in pin) for pin in settings.image_grid_pinpoints)
        for name in self.PACKING_SETTINGS:
            setattr(self, name, getattr(settings, name))


def build_tile_table_encoder(
    encoder_class: type[TileTableEncoder],
    adapter_class: type[AdapterBase],
    tower_class: type,
    projector_class: type,
    config: Any,
    dtype: torch.dtype | None,
) -> TileTableEncoder:
    """Fresh tower, projector and newline embedding from a full config or a vision config with
    `adapter_class`'s PROJECTOR_FIELDS."""
    full = adapter_class.projector_config(config)
    tower, projector = tower_and_projector(tower_class, projector_class, full, dtype)
    width = int(projector.linear_2.out_features)
    # as the model initialises it; a checkpoint's replaces it
    newline = torch.randn(width, dtype=dtype or torch.get_default_dtype()) / math.sqrt(width)
    return encoder_class(tower, projector, newline, full)


def projector_fields(*packing: str) -> tuple[ConfigField, ...]:
    """What a tower-only save's vision config carries besides the tower's fields (the full model's
    config holds them): the projector's, the feature selection, the grids, and `packing`'s."""
    names = (
        "projector_hidden_act",
        "multimodal_projector_bias",
        "vision_feature_layer",
        "vision_feature_select_strategy",
        "image_grid_pinpoints",
        *packing,
    )
    return (
        dataclasses.replace(TEXT_HIDDEN_SIZE, cast=int),
        *(ConfigField(name, name, copy.deepcopy) for name in names),
    )


class TileTableAdapter(AdapterBase):
    """The sizes, metadata loop and sampler of an adapter over a `TileTableEncoder`."""

    TAPS_KEY: ClassVar[str]
    WEIGHTS_KEY: ClassVar[str | None] = None
    # Tensors keyed as saved: `vision_tower.vision_model.*` (the releases), `vision_tower.*`
    # (transformers 5, tower-only saves), `multi_modal_projector.*`, `image_newline`, any of them
    # under `model.` (a model's state_dict).
    CHECKPOINT_RENAMES = renames(
        (r"^(?:model\.)?vision_tower\.vision_model\.", "vision_tower."), (r"^model\.", "")
    )
    MAX_SAMPLED_ITEMS = 6
    _tile_features: int  # table rows a tile gives: its patches' features (side²)

    def max_rows(self, num_tokens: int) -> int:
        return self.item_rules.max_tiles(num_tokens)

    def _item_taps(self, spec: ItemSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The item's table rows per output token from its first tile's first feature (NEWLINE:
        the newline embedding), and their weights where `WEIGHTS_KEY` is set."""
        raise NotImplementedError

    def _random_spec(self, rng: random.Random) -> ItemSpec:
        """An item of a random size, as the processor would give it."""
        raise NotImplementedError

    def _smallest_spec(self) -> ItemSpec | None:
        """The smallest item there is, sampled where no random one fits a budget (None: none)."""
        return None

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> Tensors:
        check_tiles_fit(specs, num_rows, budget)
        # padding tokens: row 0 (and weight 0)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))  # type: ignore[attr-defined]
        newline_row = num_rows * self._tile_features
        tile = token = 0
        for spec in specs:
            taps, weights = self._item_taps(spec)
            end = token + taps.shape[0]
            first_row = tile * self._tile_features  # the item's first tile's first feature
            metadata[self.TAPS_KEY][token:end] = torch.where(taps == NEWLINE, newline_row, taps + first_row)
            if self.WEIGHTS_KEY is not None:
                metadata[self.WEIGHTS_KEY][token:end] = weights
            tile += spec.num_rows
            token = end
        return metadata

    def random_size(self, rng: random.Random) -> tuple[int, int]:
        """An image size with log-uniform sides (small grids as often as large ones), up to
        SAMPLED_SIZE_FACTOR times the largest pinpoint."""
        log_largest = math.log(max(max(pin) for pin in self.item_rules.pinpoints) * SAMPLED_SIZE_FACTOR)
        return tuple(max(1, int(math.exp(rng.uniform(0, log_largest)))) for _ in range(2))  # type: ignore[return-value]

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        """Items of random sizes that fit the budget's tiles and tokens; else the smallest item
        where it fits; else none."""
        tiles_left = min(num_rows, budget.limit(SEQUENCES) or num_rows)
        tokens_left = budget.num_tokens
        specs: list[ItemSpec] = []
        for _ in range(MAX_SAMPLE_ATTEMPTS):
            if len(specs) >= self.sampled_items(budget):
                break
            spec = self._random_spec(rng)
            if spec.num_rows <= tiles_left and spec.num_tokens <= tokens_left:
                specs.append(spec)
                tiles_left -= spec.num_rows
                tokens_left -= spec.num_tokens
        smallest = None if specs else self._smallest_spec()
        if smallest is not None and smallest.num_rows <= tiles_left and smallest.num_tokens <= tokens_left:
            specs.append(smallest)
        return specs
