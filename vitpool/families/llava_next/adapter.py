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

import copy
import dataclasses
import functools
import math
import random
import re
from collections.abc import Sequence
from typing import Any

import torch
from transformers import CLIPVisionConfig

from vitpool.errors import ConfigError
from vitpool.families.llava.adapter import clip_features, feature_layers
from vitpool.families.llava_next.rules import LlavaNextRules
from vitpool.families.llava_onevision.taps import NEWLINE, item_taps
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, AdapterBase, ConfigField, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import BudgetRange, TensorSpec, zero_metadata
from vitpool.models.tiled import install_kernels
from vitpool.packing import SEQUENCES, Budget
from vitpool.specs import IMAGE, ItemSpec

# A tower-only save's model_type: CLIP's own (`clip_vision_model`) is LLaVA 1.5's family's.
TOWER_MODEL_TYPE = "llava_next_vision"
TOWER_PARTS = (
    "vision_tower.embeddings",
    "vision_tower.pre_layrnorm",
    "vision_tower.encoder.layers",
    "multi_modal_projector.linear_2",
)
# Sampled check batches keep their images within this factor of the largest pinpoint.
MAX_SAMPLE_ATTEMPTS = 60
SAMPLED_SIZE_FACTOR = 1.5
Tensors = dict[str, torch.Tensor]


class LlavaNextVisionConfig(CLIPVisionConfig):
    """CLIP's vision config under vitpool's own model_type, with the adapter's PROJECTOR_FIELDS:
    what a tower-only save of `LlavaNextEncoder` writes (CLIP's type would load as LLaVA 1.5's)."""

    model_type = TOWER_MODEL_TYPE


class LlavaNextEncoder(torch.nn.Module):
    """The tower, the projector and the newline embedding, with what `get_image_features` reads of
    the full config (`settings`: vision_feature_layer, vision_feature_select_strategy,
    image_grid_pinpoints)."""

    def __init__(
        self,
        vision_tower: torch.nn.Module,
        projector: torch.nn.Module,
        image_newline: torch.Tensor,
        settings: Any,
    ) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector
        self.image_newline = torch.nn.Parameter(image_newline.detach().clone(), requires_grad=False)
        self.config = vision_tower.config
        self.vision_feature_layer = copy.deepcopy(settings.vision_feature_layer)
        self.vision_feature_select_strategy = settings.vision_feature_select_strategy
        self.image_grid_pinpoints = tuple(tuple(int(v) for v in pin) for pin in settings.image_grid_pinpoints)


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> LlavaNextEncoder:
    """Fresh tower, projector and newline embedding from a full LlavaNextConfig or a vision config
    with the adapter's PROJECTOR_FIELDS."""
    from transformers import CLIPVisionModel
    from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector

    full = LlavaNextAdapter.projector_config(config)
    tower, projector = tower_and_projector(CLIPVisionModel, LlavaNextMultiModalProjector, full, dtype)
    width = int(projector.linear_2.out_features)
    # as the model initialises it; a checkpoint's replaces it
    newline = torch.randn(width, dtype=dtype or torch.get_default_dtype()) / math.sqrt(width)
    return LlavaNextEncoder(tower, projector, newline, full)


def read_tower_config(directory: Any) -> LlavaNextVisionConfig:
    """A tower-only save's config (TOWER_MODEL_TYPE, which AutoConfig does not know)."""
    return LlavaNextVisionConfig.from_pretrained(directory)


class LlavaNextAdapter(AdapterBase):
    """Adapter for `LlavaNextEncoder`: tiles in, what the LLM receives out."""

    # What a tower-only save's vision config carries besides CLIP's fields (the full model's
    # LlavaNextConfig holds them): the projector's, the feature selection, the grids.
    PROJECTOR_FIELDS = (
        dataclasses.replace(TEXT_HIDDEN_SIZE, cast=int),
        *(
            ConfigField(name, name, copy.deepcopy)
            for name in (
                "projector_hidden_act",
                "multimodal_projector_bias",
                "vision_feature_layer",
                "vision_feature_select_strategy",
                "image_grid_pinpoints",
            )
        ),
    )
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
    # Tensors keyed as saved: `vision_tower.vision_model.*` (the releases), `vision_tower.*`
    # (transformers 5, tower-only saves), `multi_modal_projector.*`, `image_newline`, any of them under
    # `model.` (a model's state_dict).
    CHECKPOINT_RENAMES = renames(
        (r"^(?:model\.)?vision_tower\.vision_model\.", "vision_tower."), (r"^model\.", "")
    )
    # Older CLIP saves keep the position ids, a non-persistent buffer the module makes itself.
    CHECKPOINT_IGNORED = (re.compile(r"vision_tower\.(?:vision_model\.)?embeddings\.position_ids$"),)
    MAX_SAMPLED_ITEMS = 6

    @classmethod
    def vision_config_of(cls, full_config: Any) -> LlavaNextVisionConfig:
        """The full model's CLIP vision config under TOWER_MODEL_TYPE: what a tower-only save of
        `LlavaNextEncoder` writes as its config.json (and what a full checkpoint is built from)."""
        fields = full_config.vision_config.to_dict()
        fields.pop("model_type", None)  # the class's own
        return LlavaNextVisionConfig.from_dict(fields)

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

    def max_rows(self, num_tokens: int) -> int:
        return self.item_rules.max_tiles(num_tokens)

    def budget_range(self, device: torch.device) -> BudgetRange:
        """Whole tiles, from an image of the smallest pinpoint's crops and its base tile (no image
        has fewer tiles) to one of the largest's."""
        rules = self.item_rules
        step = rules.tokens_per_tile
        fewest = min((h // rules.tile_size) * (w // rules.tile_size) for h, w in rules.pinpoints) + 1
        return BudgetRange(fewest * step, rules.max_item_tiles * step, step)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {"gather": TensorSpec((budget.num_tokens,), torch.long)}  # rows of the table

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> Tensors:
        num_tiles = sum(spec.num_rows for spec in specs)
        num_tokens = sum(spec.num_tokens for spec in specs)
        if num_tiles > num_rows or num_tokens > budget.num_tokens:
            raise ValueError(
                f"{len(specs)} items need {num_tiles} tiles and {num_tokens} tokens; the buffers hold "
                f"{num_rows} tiles and {budget.num_tokens} tokens"
            )
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))  # padding tokens: row 0
        newline_row = num_rows * self._tile_features
        tile = token = 0
        for spec in specs:
            rows = self._gather_of(spec.num_rows, tuple(spec.layout))
            end = token + rows.shape[0]
            first_row = tile * self._tile_features  # the item's first tile's first feature
            metadata["gather"][token:end] = torch.where(rows == NEWLINE, newline_row, rows + first_row)
            tile += spec.num_rows
            token = end
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [tiles, C, S, S] -> features [tiles, side², D_vision * layers] -> [tiles * side², LLM width]
        features = clip_features(self.tower.vision_tower, pixels, self.feature_layers, drops_class_token=True)
        projected = self.tower.multi_modal_projector(features).flatten(0, 1)
        table = torch.cat([projected, self.tower.image_newline.to(projected.dtype)[None]])
        return [table[metadata["gather"]]]

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        """Images of random sizes (log-uniform sides, small grids as often as large ones) that fit
        the budget's tiles and tokens; an empty list where not even the smallest grid fits."""
        rules = self.item_rules
        tiles_left = min(num_rows, budget.limit(SEQUENCES) or num_rows)
        tokens_left = budget.num_tokens
        log_largest = math.log(max(max(pin) for pin in rules.pinpoints) * SAMPLED_SIZE_FACTOR)
        specs: list[ItemSpec] = []
        for _ in range(MAX_SAMPLE_ATTEMPTS):
            if len(specs) >= self.sampled_items(budget):
                break
            size = tuple(max(1, int(math.exp(rng.uniform(0, log_largest)))) for _ in range(2))
            tiles = rules.packed_grid(*size).num_crops + 1
            spec = rules.item_spec(IMAGE, (tiles, *self.row_shape), "float32", size)
            if spec.num_rows <= tiles_left and spec.num_tokens <= tokens_left:
                specs.append(spec)
                tiles_left -= spec.num_rows
                tokens_left -= spec.num_tokens
        return specs


# The loader's hooks (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = LlavaNextAdapter.tower_only_config
convert_checkpoint = LlavaNextAdapter.convert_checkpoint
