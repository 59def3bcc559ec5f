"""InternVL 3 / 3.5 (`InternVLVisionModel`, InternViT) and its `multi_modal_projector`.

An image is whole tiles of one size (448² in the releases: a thumbnail and up to 12 crops, as
`GotOcr2ImageProcessor` cuts them), and each tile is one fixed-length attention sequence: the
class token and (448 / 14)² patches. The tower runs tiles as its batch dimension, so a batch of
tiles needs no metadata at all: a padding tile is a zero tile whose tokens nobody reads. After
the tower, as `InternVLModel.get_image_features` does: drop the class token, pixel-shuffle the
patch grid by `downsample_ratio` (0.5: 2 x 2 patches into one token of 4x the width, 256 tokens a
tile) and project into the LLM's width. The pixel shuffle is a method of Hugging Face's full
model, which vitpool does not build; `pixel_shuffle` here is the same reshape.

`InternVLEncoder` holds the tower and the projector (state keys `vision_tower.*` and
`multi_modal_projector.*`; a full checkpoint in transformers' layout has them under `model.`).
OpenGVLab's own releases (InternVL2 / 2.5 / 3, remote code `InternVLChatModel`) keep the original
layout: config.json of model_type "internvl_chat" with the tower's config (model_type
"intern_vit_6b" for every size) and the LLM's (`llm_config`), the tower under `vision_model.`
with a fused `qkv`, the projector as `mlp1`. `checkpoint.py` reads them as transformers' converter
(convert_internvl_weights_to_hf.py) does. InternViT-6B is the same
tower with RMSNorm, q/k RMSNorm and no qkv bias (`norm_type`, `use_qk_norm`, `attention_bias`).
"""

from __future__ import annotations

from typing import Any

import torch

from vitpool.families.internvl import checkpoint
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, ConfigField
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import tower_and_projector
from vitpool.models.tiled import TiledAdapter, install_kernels
from vitpool.rules.tiles import TileRules

# Keys of a full checkpoint (transformers' layout) that belong to the tower or the projector.
CHECKPOINT_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")
# The default budgets hold up to this many tiles (a 12-crop image and its thumbnail); a batch of
# more runs eager at its own size.
MAX_GRAPH_TILES = 13
TOWER_PARTS = ("embeddings", "encoder", "layernorm")


class InternVLEncoder(torch.nn.Module):
    """The tower and its projector, with what `get_image_features` reads of the full config."""

    def __init__(self, vision_tower: torch.nn.Module, projector: torch.nn.Module, settings: Any) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector
        self.config = vision_tower.config
        self.downsample_ratio = float(settings.downsample_ratio)
        self.vision_feature_layer = settings.vision_feature_layer
        self.vision_feature_select_strategy = settings.vision_feature_select_strategy


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> InternVLEncoder:
    """Fresh tower and projector from a full InternVLConfig or a vision config with the adapter's
    PROJECTOR_FIELDS."""
    from transformers.models.internvl.modeling_internvl import (
        InternVLMultiModalProjector,
        InternVLVisionModel,
    )

    full = InternVLAdapter.projector_config(config)
    tower, projector = tower_and_projector(InternVLVisionModel, InternVLMultiModalProjector, full, dtype)
    return InternVLEncoder(tower, projector, full)


def pixel_shuffle(features: torch.Tensor, scale_factor: float) -> torch.Tensor:
    """`InternVLModel.pixel_shuffle`: [tiles, w, h, c] -> [tiles, w*s, h*s, c/s²]."""
    tiles, width, height, channels = features.shape
    features = features.view(tiles, width, int(height * scale_factor), int(channels / scale_factor))
    features = features.permute(0, 2, 1, 3).contiguous()
    features = features.view(
        tiles, int(height * scale_factor), int(width * scale_factor), int(channels / (scale_factor**2))
    )
    return features.permute(0, 2, 1, 3).contiguous()


class InternVLAdapter(TiledAdapter):
    """Adapter for `InternVLEncoder`: rows are tiles, no metadata."""

    max_graph_tiles = MAX_GRAPH_TILES
    # What a tower-only save's vision config carries besides Hugging Face's fields, for the projector
    # and the feature selection (the full model's InternVLConfig holds them).
    PROJECTOR_FIELDS = (
        TEXT_HIDDEN_SIZE,
        *(
            ConfigField(name, name)
            for name in (
                "downsample_ratio",
                "projector_hidden_act",
                "vision_feature_layer",
                "vision_feature_select_strategy",
            )
        ),
    )
    PROJECTOR_SUBJECT = "an InternVL vision config"
    PROJECTOR_ADVICE = (
        "to build its projector; give the full model's config (InternVLConfig) or a tower-only save that "
        "carries them"
    )
    # transformers' layouts and OpenGVLab's release (`vitpool.families.internvl.checkpoint`).
    convert_checkpoint = staticmethod(checkpoint.encoder_state)

    def __init__(self, tower: InternVLEncoder) -> None:
        vision = tower.vision_tower
        config = vision.config
        check_tower_parts("InternVL", vision, TOWER_PARTS)
        if tower.vision_feature_layer != -1 or tower.vision_feature_select_strategy != "default":
            raise ValueError(
                "vitpool runs InternVL with vision_feature_layer=-1 and vision_feature_select_strategy="
                f"'default' (the releases' settings); got {tower.vision_feature_layer!r}, "
                f"{tower.vision_feature_select_strategy!r}"
            )
        image_size, patch_size = tuple(config.image_size), tuple(config.patch_size)
        if image_size[0] != image_size[1] or patch_size[0] != patch_size[1]:
            raise ValueError(
                f"InternVL tiles must be square; image_size {image_size}, patch_size {patch_size}"
            )
        side = image_size[0] // patch_size[0]
        self._side = side
        self._scale = tower.downsample_ratio
        tokens_per_tile = int(side * self._scale) ** 2
        install_kernels(tower)
        self.tower = tower
        self.tokens_per_tile = tokens_per_tile
        self.item_rules = TileRules(
            int(config.num_channels),
            image_size[0],
            tokens_per_tile,
            ((int(tower.multi_modal_projector.linear_2.out_features),),),
        )

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        hidden = self.tower.vision_tower(pixel_values=pixels).last_hidden_state[:, 1:, :]  # no class token
        tiles = hidden.shape[0]
        grid = hidden.reshape(tiles, self._side, self._side, -1)
        shuffled = pixel_shuffle(grid, self._scale)
        tokens = self.tower.multi_modal_projector(shuffled.reshape(tiles, -1, shuffled.shape[-1]))
        return [tokens.reshape(tiles * self.tokens_per_tile, -1)]


# The loader's hook and its long-standing name (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = InternVLAdapter.tower_only_config
