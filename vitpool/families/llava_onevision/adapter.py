"""LLaVA-OneVision (`LlavaOnevisionModel`): the SigLIP tower (`SiglipVisionModel`), the
`multi_modal_projector` and the packing of `get_image_features` / `get_video_features` (the
unpadding, the pooling, the `image_newline` tokens), all in one graph.

The tower runs tiles (an image's base tile and crops, a video's frames: `rules.py`) as its batch
dimension, each tile one fixed-length attention sequence (side² patches, no class token), so the
tower needs no metadata. The projector maps each patch's features (the hidden state of
`vision_feature_layer`, before `post_layernorm`) into the LLM's width. What the LLM receives is
then a rearrangement of those rows and the newline embedding, a mix of them where features are
pooled, and which rows go where depends only on each item's size and tile count, which its spec
holds. So the host computes it (`build_metadata`), and the graph does one static gather:

    output token t = sum over k of tap_weights[t, k] * table[taps[t, k]],   k < 4,

over `table`, the projected features of every tile in the buffer, then the newline embedding
(`taps.py`: a copied feature is one tap of weight 1, a pooled one the four of PyTorch's bilinear
interpolation). The sum runs in float32 (the weights' dtype) and is rounded once to the model's
dtype; padding tokens take row 0 with weight 0.

`LlavaOnevisionEncoder` holds the tower, the projector and the newline embedding (state keys
`vision_tower.*`, `multi_modal_projector.*` and `image_newline`). The releases keep SigLIP's inner
level (`vision_tower.vision_model.*`); transformers 5 saves without it; a model's state_dict has all
three under `model.`.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import torch
from transformers import SiglipVisionConfig

from vitpool.errors import ConfigError
from vitpool.families.llava_onevision.rules import LlavaOnevisionRules, max_num_patches_of
from vitpool.families.llava_onevision.taps import TAPS, item_taps
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
from vitpool.specs import IMAGE, VIDEO, ItemSpec

# A tower-only save's model_type: SigLIP's own (`siglip_vision_model`) is Gemma 3's family's.
TOWER_MODEL_TYPE = "llava_onevision_vision"
TOWER_PARTS = ("vision_tower.embeddings", "vision_tower.encoder.layers", "multi_modal_projector.linear_2")
Tensors = dict[str, torch.Tensor]


class LlavaOnevisionVisionConfig(SiglipVisionConfig):
    """SigLIP's vision config under vitpool's own model_type, with the adapter's PROJECTOR_FIELDS:
    what a tower-only save of `LlavaOnevisionEncoder` writes (SigLIP's type would load as Gemma 3's)."""

    model_type = TOWER_MODEL_TYPE


class LlavaOnevisionEncoder(TileTableEncoder):
    """The tower, the projector and the newline embedding, with what `get_image_features` reads of
    the full config (`settings`: vision_feature_layer, vision_feature_select_strategy,
    image_grid_pinpoints, vision_aspect_ratio)."""

    PACKING_SETTINGS = ("vision_aspect_ratio",)


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> LlavaOnevisionEncoder:
    """Fresh tower, projector and newline embedding from a full LlavaOnevisionConfig or a vision
    config with the adapter's PROJECTOR_FIELDS."""
    from transformers import SiglipVisionModel
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionMultiModalProjector

    return build_tile_table_encoder(  # type: ignore[return-value]
        LlavaOnevisionEncoder,
        LlavaOnevisionAdapter,
        SiglipVisionModel,
        LlavaOnevisionMultiModalProjector,
        config,
        dtype,
    )


def read_tower_config(directory: Any) -> LlavaOnevisionVisionConfig:
    """A tower-only save's config (TOWER_MODEL_TYPE, which AutoConfig does not know)."""
    return LlavaOnevisionVisionConfig.from_pretrained(directory)


def feature_layers(vision_feature_layer: Any, num_layers: int) -> tuple[int, ...]:
    """The hidden states `get_image_features` reads (0: the embeddings, `num_layers`: the last
    layer's output, before `post_layernorm`), concatenated in this order where there are several.

    Raises:
        ConfigError: a layer outside the tower.
    """
    layers = (
        vision_feature_layer if isinstance(vision_feature_layer, (list, tuple)) else [vision_feature_layer]
    )
    indices = []
    for layer in layers:
        index = int(layer) if int(layer) >= 0 else num_layers + 1 + int(layer)
        if not 0 <= index <= num_layers:
            raise ConfigError(
                f"LLaVA-OneVision: vision_feature_layer {layer} is outside the tower's {num_layers} layers"
            )
        indices.append(index)
    return tuple(indices)


class LlavaOnevisionAdapter(TileTableAdapter):
    """Adapter for `LlavaOnevisionEncoder`: tiles in, what the LLM receives out."""

    # What a tower-only save's vision config carries besides SigLIP's fields (the full model's
    # LlavaOnevisionConfig holds them): the projector's, the feature selection, the packing.
    PROJECTOR_FIELDS = projector_fields("vision_aspect_ratio")
    PROJECTOR_SUBJECT = "a LLaVA-OneVision vision config"
    PROJECTOR_ADVICE = (
        "to build its projector and pack its features; give the full model's config (LlavaOnevisionConfig) "
        "or a tower-only save written from tower_only_config"
    )
    # Another model's projector or packing is not this one's.
    FULL_MODEL_TYPES = ("llava_onevision",)
    OTHER_MODEL = (
        "a {model_type} checkpoint: vitpool's llava_onevision family runs LLaVA-OneVision's packing and "
        "projector only (model_type {expected})"
    )
    VISION_CONFIG = LlavaOnevisionVisionConfig
    TAPS_KEY, WEIGHTS_KEY = "taps", "tap_weights"

    def __init__(self, tower: LlavaOnevisionEncoder) -> None:
        check_tower_parts("LLaVA-OneVision", tower, TOWER_PARTS)
        if tower.vision_feature_select_strategy != "full":
            # "default" drops each tile's first patch as if SigLIP had a class token: the crops'
            # features then no longer form a grid, and Hugging Face's model fails on them too
            raise ConfigError(
                "vitpool runs LLaVA-OneVision with vision_feature_select_strategy='full' (the releases' "
                f"setting); got {tower.vision_feature_select_strategy!r}"
            )
        vision = tower.vision_tower
        config = vision.config
        self.tower = tower
        self.feature_layers = feature_layers(tower.vision_feature_layer, len(vision.encoder.layers))
        self.item_rules = LlavaOnevisionRules(
            channels=int(config.num_channels),
            tile_size=int(config.image_size),
            patch_size=int(config.patch_size),
            pinpoints=tower.image_grid_pinpoints,
            max_num_patches=max_num_patches_of(tower.vision_aspect_ratio),
            output_width=int(tower.multi_modal_projector.linear_2.out_features),
        )
        self._tile_features = self.item_rules.side**2
        self._taps_of = functools.lru_cache(maxsize=1024)(functools.partial(item_taps, self.item_rules))
        install_kernels(tower)

    def budget_range(self, device: torch.device) -> BudgetRange:
        """Whole tiles, up to an image of the largest pinpoint's crops and its base tile."""
        step = self.item_rules.tokens_per_tile
        return BudgetRange(step, self.item_rules.max_item_tiles * step, step)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "taps": TensorSpec((budget.num_tokens, TAPS), torch.long),  # rows of the table
            "tap_weights": TensorSpec((budget.num_tokens, TAPS), torch.float32),
        }

    def _item_taps(self, spec: ItemSpec) -> tuple[torch.Tensor, torch.Tensor]:
        return self._taps_of(spec.modality, spec.num_rows, spec.layout)

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [tiles, C, S, S] -> features [tiles, side², D_vision * layers] -> [tiles * side², LLM width]
        projected = self.tower.multi_modal_projector(self._features(pixels)).flatten(0, 1)
        newline = self.tower.image_newline.to(projected.dtype)
        table = torch.cat([projected, newline[None]])
        taps, weights = metadata["taps"], metadata["tap_weights"]
        # float32: the weights' dtype; a copied row stays exact (x * 1 + 0), pooled ones round once
        tokens = table[taps[:, 0]] * weights[:, :1]
        for k in range(1, TAPS):
            tokens.addcmul_(table[taps[:, k]], weights[:, k : k + 1])
        return [tokens.to(projected.dtype)]

    def _features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The hidden states of `feature_layers`, side by side: [tiles, side², D_vision * layers].
        Layers past the last one read are not run; `post_layernorm` is not read."""
        vision = self.tower.vision_tower
        hidden = vision.embeddings(pixels)
        states = {0: hidden}
        for index, layer in enumerate(vision.encoder.layers[: max(self.feature_layers)], start=1):
            hidden = layer(hidden, None)
            states[index] = hidden
        return torch.cat([states[index] for index in self.feature_layers], dim=-1)

    def _smallest_spec(self) -> ItemSpec:
        return self.item_rules.item_spec(VIDEO, (1, *self.row_shape), "float32", ())

    def _random_spec(self, rng: random.Random) -> ItemSpec:
        """An image of a random size (its tiles, or its base tile alone), or a short video."""
        rules = self.item_rules
        kind = rng.random()
        if kind < 0.15:
            return rules.item_spec(VIDEO, (rng.randint(1, 3), *self.row_shape), "float32", ())
        while True:
            size = self.random_size(rng)
            try:
                tiles = 1 if kind < 0.3 else rules.packed_grid(*size).num_crops + 1
            except ValueError:  # pooled to nothing: no image of this size is run
                continue
            return rules.item_spec(IMAGE, (tiles, *self.row_shape), "float32", size)


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = LlavaOnevisionAdapter.tower_only_config
convert_checkpoint = LlavaOnevisionAdapter.convert_checkpoint
