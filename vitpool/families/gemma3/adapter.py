"""Gemma 3 (`SiglipVisionModel`) and its `multi_modal_projector` (`Gemma3MultiModalProjector`).

An image is whole views of one size (896² in the releases): the image resized, then, with
pan-and-scan (`Gemma3ImageProcessor(do_pan_and_scan=True)`), up to `pan_and_scan_max_num_crops`
crops of it, each resized to the same square. Each view is one fixed-length attention sequence
((896 / 14)² = 4096 patches, no class token) and the tower runs views as its batch dimension, so a
batch needs no metadata: a padding view is a zero view whose tokens nobody reads. After the tower,
as `Gemma3Model.get_image_features` does, the projector average-pools each view's patch grid to
`mm_tokens_per_image` tokens (256: 4 x 4 patches each), normalises them (Gemma's RMSNorm) and
projects them into the LLM's width: the LLM receives exactly that, view after view.

`Gemma3Encoder` holds the tower and the projector (state keys `vision_tower.*` and
`multi_modal_projector.*`). A full checkpoint keeps them under those names, under `model.` when
saved by transformers 4.52 to 4.x, and the releases keep SigLIP's inner `vision_model.` level
(`vision_tower.vision_model.*`), which transformers 5's `SiglipVisionModel` no longer has.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, ConfigField, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import TowerWithProjector, tower_and_projector
from vitpool.models.tiled import TiledAdapter, install_kernels
from vitpool.rules.tiles import TileRules

# The default budgets hold up to this many views: one image with the processor's most crops
# (pan_and_scan_max_num_crops=4) and the whole image. A batch of more runs eager at its own size.
MAX_GRAPH_VIEWS = 5
TOWER_PARTS = ("embeddings", "encoder", "post_layernorm")


class Gemma3Encoder(TowerWithProjector):
    """The tower and the projector, as `Gemma3Model` holds them."""


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Gemma3Encoder:
    """Fresh tower and projector from a full Gemma3Config or a vision config with the adapter's
    PROJECTOR_FIELDS."""
    from transformers import SiglipVisionModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    full = Gemma3Adapter.projector_config(config)
    check_pooling(full.vision_config, full.mm_tokens_per_image)
    tower, projector = tower_and_projector(SiglipVisionModel, Gemma3MultiModalProjector, full, dtype)
    return Gemma3Encoder(tower, projector)


def check_pooling(vision_config: Any, mm_tokens_per_image: int) -> None:
    """Refuse sizes under which `Gemma3MultiModalProjector` would not give `mm_tokens_per_image`
    tokens a view (the processor's placeholders): the patch grid average-pooled in square windows.

    Raises:
        ValueError: a token count that is no square, or a pooling window that does not tile the grid.
    """
    image_size, patch_size = int(vision_config.image_size), int(vision_config.patch_size)
    side = image_size // patch_size
    tokens_side = math.isqrt(int(mm_tokens_per_image))
    if (
        image_size % patch_size
        or tokens_side < 1
        or tokens_side**2 != mm_tokens_per_image
        or side % tokens_side
    ):
        raise ValueError(
            f"Gemma 3 views of {image_size}² pixels in {patch_size}-pixel patches ({side}² patches) cannot "
            f"be pooled to mm_tokens_per_image={mm_tokens_per_image}: it must be a square whose side divides "
            f"{side}"
        )


class Gemma3Adapter(TiledAdapter):
    """Adapter for `Gemma3Encoder`: rows are views, no metadata."""

    max_graph_tiles = MAX_GRAPH_VIEWS
    # What a tower-only save's vision config carries besides SigLIP's fields, for the projector (the
    # full model's Gemma3Config holds them: the LLM's width, the tokens a view is pooled to).
    PROJECTOR_FIELDS = (TEXT_HIDDEN_SIZE, ConfigField("mm_tokens_per_image", "mm_tokens_per_image"))
    PROJECTOR_SUBJECT = "a Gemma 3 vision config"
    PROJECTOR_ADVICE = (
        "to build its multi_modal_projector; give the full model's config (Gemma3Config) or a tower-only "
        "save that carries them (a plain SigLIP tower has no projector for vitpool to run)"
    )
    # The full checkpoints whose SigLIP tower and projector this family runs (PaliGemma's is another).
    FULL_MODEL_TYPES = ("gemma3",)
    OTHER_MODEL = (
        "a {model_type} checkpoint with a SigLIP vision tower: vitpool runs SigLIP towers with Gemma 3's "
        "projector only (model_type {expected})"
    )
    # Tensors keyed as saved: `model.vision_tower.*` / `model.multi_modal_projector.*` (transformers
    # 4.52 and later 4.x), `vision_tower.*` / `multi_modal_projector.*` (transformers 5, tower-only
    # saves), `vision_tower.vision_model.*` (the releases keep SigLIP's tower one level down;
    # transformers 5's module has no such level).
    CHECKPOINT_RENAMES = renames(
        (r"^(?:model\.)?vision_tower\.vision_model\.", "vision_tower."), (r"^model\.", "")
    )

    def __init__(self, tower: Gemma3Encoder) -> None:
        vision = tower.vision_tower
        check_tower_parts("Gemma 3", vision, TOWER_PARTS)
        config = vision.config
        projector = tower.multi_modal_projector
        # AvgPool2d's output grid: what the projector gives a view, whatever the config says
        tokens = (projector.patches_per_image // projector.kernel_size) ** 2
        install_kernels(tower)
        self.tower = tower
        self.tokens_per_tile = tokens
        self.item_rules = TileRules(
            int(config.num_channels),
            int(config.image_size),
            tokens,
            ((int(projector.mm_input_projection_weight.shape[1]),),),
        )

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [views, C, S, S] -> patches [views, (S/P)², D] -> tokens [views, tokens a view, LLM width]
        patches = self.tower.vision_tower(pixel_values=pixels).last_hidden_state
        tokens = self.tower.multi_modal_projector(patches)
        return [tokens.reshape(-1, tokens.shape[-1])]


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
projector_config = Gemma3Adapter.projector_config
tower_only_config = Gemma3Adapter.tower_only_config
convert_checkpoint = Gemma3Adapter.convert_checkpoint
