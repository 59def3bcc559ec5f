"""Llama 4 (`Llama4VisionModel`) and its `multi_modal_projector`.

An image is whole tiles of one size (336² in Scout and Maverick: up to 16 crops and, with more
than one, a global tile, as `Llama4ImageProcessor` cuts them). Each tile is one fixed-length
attention sequence (its patches and a class token, 2-D rotary positions from a fixed table), and
the tower runs tiles as its batch dimension, so a batch needs no metadata. The tower itself drops
the class token, pixel-shuffles by `pixel_shuffle_ratio` and runs its adapter MLP
(`get_image_features` returns that); the model then flattens the tokens and projects them into
the LLM's width, which is what its LLM receives: `Llama4Encoder` runs both.

State keys `vision_model.*` and `multi_modal_projector.*`, as in a full checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch

from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE
from vitpool.models.projected import tower_and_projector
from vitpool.models.tiled import TiledAdapter, install_kernels
from vitpool.rules.tiles import TileRules

CHECKPOINT_PREFIXES = ("vision_model.", "multi_modal_projector.")
# 16 crops and the global tile (Llama4ImageProcessor's max_patches=16)
MAX_GRAPH_TILES = 17


class Llama4Encoder(torch.nn.Module):
    """The tower and the projector."""

    def __init__(self, vision_model: torch.nn.Module, projector: torch.nn.Module) -> None:
        super().__init__()
        self.vision_model = vision_model
        self.multi_modal_projector = projector
        self.config = vision_model.config


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Llama4Encoder:
    """Fresh tower and projector from a full Llama4Config or a vision config with text_hidden_size."""
    from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector, Llama4VisionModel

    full = Llama4Adapter.projector_config(config)
    tower, projector = tower_and_projector(Llama4VisionModel, Llama4MultiModalProjector, full, dtype)
    return Llama4Encoder(tower, projector)


class Llama4Adapter(TiledAdapter):
    """Adapter for `Llama4Encoder`: rows are tiles, no metadata. A full checkpoint's tower and
    projector keys are the module's own (`convert_checkpoint`: no renames)."""

    max_graph_tiles = MAX_GRAPH_TILES
    # What a tower-only save's vision config carries besides Hugging Face's fields: the LLM's width.
    PROJECTOR_FIELDS = (TEXT_HIDDEN_SIZE,)
    PROJECTOR_SUBJECT = "a Llama 4 vision config"
    PROJECTOR_ADVICE = (
        "to build its multi_modal_projector; give the full model's config (Llama4Config) or a tower-only "
        "save that carries it"
    )

    def __init__(self, tower: Llama4Encoder) -> None:
        config = tower.config
        side = int(config.image_size) // int(config.patch_size)
        ratio = float(config.pixel_shuffle_ratio)
        install_kernels(tower)
        self.tower = tower
        self.tokens_per_tile = int(side * ratio) ** 2
        self.item_rules = TileRules(
            int(config.num_channels),
            int(config.image_size),
            self.tokens_per_tile,
            ((int(tower.multi_modal_projector.linear_1.out_features),),),
        )

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        features = self.tower.vision_model(pixel_values=pixels).last_hidden_state  # [tiles, tokens, D]
        return [self.tower.multi_modal_projector(features.reshape(-1, features.shape[-1]))]


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = Llama4Adapter.tower_only_config
convert_checkpoint = Llama4Adapter.convert_checkpoint
