"""LLaVA-NeXT (`LlavaNextModel`): the CLIP tower (`CLIPVisionModel`), the feature selection and the
`multi_modal_projector` of `get_image_features`, and its packing (`pack_image_features`: the
unpadding and the `image_newline` tokens), all in one graph.

The tower runs tiles (an image's base tile and crops: `rules.py`) as its batch dimension, each tile
one fixed-length attention sequence (its class token and side² patches), so the tower needs no
metadata. The features are LLaVA 1.5's (`vitpool.families.llava.adapter.clip_features`): the hidden
states `vision_feature_layer` reads (layers past the deepest are not run), the class token dropped
after the layers ("default", the releases' and the only strategy whose features form a grid: under
"full" Hugging Face's `pack_image_features` cannot view them as one). The projector maps each
patch's features into the LLM's width. What the LLM receives is then a rearrangement of those rows
and the newline embedding that depends only on each image's size and grid, which its spec holds: the
host computes it (`build_metadata`, from OneVision's geometry without pooling, `item_taps`), and the
graph does one static gather over `table`, the projected features of every tile in the buffer and
then the newline embedding. Padding tokens gather row 0; nobody reads them.

`LlavaNextEncoder` holds the tower, the projector and the newline embedding (state keys
`vision_tower.*`, `multi_modal_projector.*`, `image_newline`). The releases (transformers 4) keep
CLIP's inner level (`vision_tower.vision_model.*`); transformers 5 saves without it; a model's
state_dict has all three under `model.`.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any

import torch
from transformers import CLIPVisionConfig

from vitpool.errors import ConfigError
from vitpool.families.llava.adapter import clip_features, feature_layers
from vitpool.families.llava_next.rules import LlavaNextRules
from vitpool.families.llava_onevision.taps import item_taps
from vitpool.families.llava_onevision.tile_table import (
    TileTableAdapter,
    TileTableEncoder,
    build_tile_table_encoder,
    projector_fields,
)
from vitpool.models.compat import check_tower_parts
from vitpool.models.protocol import BudgetRange, TensorSpec
from vitpool.models.tiled import install_kernels
from vitpool.packing import Budget
from vitpool.specs import IMAGE, ItemSpec

# A tower-only save's model_type: CLIP's own (`clip_vision_model`) is LLaVA 1.5's family's.
TOWER_MODEL_TYPE = "llava_next_vision"
TOWER_PARTS = (
    "vision_tower.embeddings",
    "vision_tower.pre_layrnorm",
    "vision_tower.encoder.layers",
    "multi_modal_projector.linear_2",
)


class LlavaNextVisionConfig(CLIPVisionConfig):
    """CLIP's vision config under vitpool's own model_type, with the adapter's PROJECTOR_FIELDS:
    what a tower-only save of `LlavaNextEncoder` writes (CLIP's type would load as LLaVA 1.5's)."""

    model_type = TOWER_MODEL_TYPE


class LlavaNextEncoder(TileTableEncoder):
    """The tower, the projector and the newline embedding, with what `get_image_features` reads of
    the full config (`settings`: vision_feature_layer, vision_feature_select_strategy,
    image_grid_pinpoints)."""


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> LlavaNextEncoder:
    """Fresh tower, projector and newline embedding from a full LlavaNextConfig or a vision config
    with the adapter's PROJECTOR_FIELDS."""
    from transformers import CLIPVisionModel
    from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector

    return build_tile_table_encoder(  # type: ignore[return-value]
        LlavaNextEncoder, LlavaNextAdapter, CLIPVisionModel, LlavaNextMultiModalProjector, config, dtype
    )


def read_tower_config(directory: Any) -> LlavaNextVisionConfig:
    """A tower-only save's config (TOWER_MODEL_TYPE, which AutoConfig does not know)."""
    return LlavaNextVisionConfig.from_pretrained(directory)


class LlavaNextAdapter(TileTableAdapter):
    """Adapter for `LlavaNextEncoder`: tiles in, what the LLM receives out."""

    # What a tower-only save's vision config carries besides CLIP's fields (the full model's
    # LlavaNextConfig holds them): the projector's, the feature selection, the grids.
    PROJECTOR_FIELDS = projector_fields()
    PROJECTOR_SUBJECT = "a LLaVA-NeXT vision config"
    PROJECTOR_ADVICE = (
        "to build its projector and pack its features; give the full model's config (LlavaNextConfig) "
        "or a tower-only save written from tower_only_config"
    )
    # Another model's projector or packing (LLaVA 1.5's fixed views, LLaVA-NeXT-Video's pooled
    # frames) is not this one's.
    FULL_MODEL_TYPES = ("llava_next",)
    OTHER_MODEL = (
        "a {model_type} checkpoint: vitpool's llava_next family runs LLaVA-NeXT's anyres packing and "
        "projector only (model_type {expected})"
    )
    # Older CLIP saves keep the position ids, a non-persistent buffer the module makes itself.
    CHECKPOINT_IGNORED = (re.compile(r"vision_tower\.(?:vision_model\.)?embeddings\.position_ids$"),)
    VISION_CONFIG = LlavaNextVisionConfig
    TAPS_KEY = "gather"

    def __init__(self, tower: LlavaNextEncoder) -> None:
        check_tower_parts("LLaVA-NeXT", tower, TOWER_PARTS)
        if tower.vision_feature_select_strategy != "default":
            raise ConfigError(
                "vitpool runs LLaVA-NeXT with vision_feature_select_strategy='default' (the releases'; "
                "under 'full' each tile keeps its class token and Hugging Face's pack_image_features "
                f"cannot view the crops' features as a grid); got {tower.vision_feature_select_strategy!r}"
            )
        vision = tower.vision_tower
        config = vision.config
        self.tower = tower
        self.feature_layers = feature_layers(tower.vision_feature_layer, len(vision.encoder.layers))
        self.item_rules = LlavaNextRules.of(
            channels=int(config.num_channels),
            tile_size=int(config.image_size),
            patch_size=int(config.patch_size),
            pinpoints=tower.image_grid_pinpoints,
            output_width=int(tower.multi_modal_projector.linear_2.out_features),
        )
        self._tile_features = self.item_rules.side**2
        self._gather_of = functools.lru_cache(maxsize=1024)(self._item_gather)
        install_kernels(tower)

    def _item_gather(self, num_tiles: int, size: tuple[int, int]) -> torch.Tensor:
        """One image's rows of its own tiles' features from 0 (NEWLINE: the newline embedding), in
        the order the LLM receives them: OneVision's taps, every one a copy (nothing is pooled)."""
        taps, weights = item_taps(self.item_rules, IMAGE, num_tiles, size)
        assert bool((weights[:, 0] == 1).all()), "LLaVA-NeXT pools no features"
        return taps[:, 0]

    def budget_range(self, device: torch.device) -> BudgetRange:
        """Whole tiles, from an image of the smallest pinpoint's crops and its base tile (no image
        has fewer tiles) to one of the largest's."""
        rules = self.item_rules
        step = rules.tokens_per_tile
        fewest = min((h // rules.tile_size) * (w // rules.tile_size) for h, w in rules.pinpoints) + 1
        return BudgetRange(fewest * step, rules.max_item_tiles * step, step)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {"gather": TensorSpec((budget.num_tokens,), torch.long)}  # rows of the table

    def _item_taps(self, spec: ItemSpec) -> tuple[torch.Tensor, None]:
        return self._gather_of(spec.num_rows, tuple(spec.layout)), None

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [tiles, C, S, S] -> features [tiles, side², D_vision * layers] -> [tiles * side², LLM width]
        features = clip_features(self.tower.vision_tower, pixels, self.feature_layers, drops_class_token=True)
        projected = self.tower.multi_modal_projector(features).flatten(0, 1)
        table = torch.cat([projected, self.tower.image_newline.to(projected.dtype)[None]])
        return [table[metadata["gather"]]]

    def _random_spec(self, rng: random.Random) -> ItemSpec:
        """An image of a random size, its base tile and crops."""
        size = self.random_size(rng)
        tiles = self.item_rules.packed_grid(*size).num_crops + 1
        return self.item_rules.item_spec(IMAGE, (tiles, *self.row_shape), "float32", size)


# The loader's hooks (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = LlavaNextAdapter.tower_only_config
convert_checkpoint = LlavaNextAdapter.convert_checkpoint
