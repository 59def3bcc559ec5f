"""PaliGemma and PaliGemma 2 (`SiglipVisionModel`) and their `multi_modal_projector`
(`PaliGemmaMultiModalProjector`).

An image is one view: `SiglipImageProcessor` resizes it to the checkpoint's square (224², 448² or
896²), so an image's item is [1, 3, S, S]; an item of several views (a prompt's images, stacked as
the processor stacks them) gives their tokens in order, as the model scatters them into its prompt
(`TileRules`, as Gemma 3's views). Each view is one fixed-length attention sequence ((S / 14)²
patches: 256, 1024 or 4096, no class token) and the tower runs views as its batch dimension, so a
batch needs no metadata: a padding view is a zero view whose tokens nobody reads. After the tower,
as `PaliGemmaModel.get_image_features` does, the projector maps every patch's features (the last
hidden state, after `post_layernorm`) into the LLM's width: the LLM receives exactly that, one token
a patch. No scaling follows: transformers 5 gives the projector's output as it is (Gemma's embedding
layer scales the text embeddings itself); transformers 4 divided the image features by the square
root of the text width instead, and vLLM's model still does.

`PaliGemmaEncoder` holds the tower and the projector (state keys `vision_tower.*` and
`multi_modal_projector.*`). A full checkpoint keeps them under those names (transformers 5 saves
them so; a model's state_dict has them under `model.`), and the releases keep SigLIP's inner
`vision_model.` level (`vision_tower.vision_model.*`), which transformers 5's `SiglipVisionModel`
no longer has.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import SiglipVisionConfig

from vitpool.models.adapter_base import ConfigField, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import TowerWithProjector, tower_and_projector
from vitpool.models.tiled import TiledAdapter, install_kernels
from vitpool.rules.tiles import TileRules

# A tower-only save's model_type: SigLIP's own (`siglip_vision_model`) is Gemma 3's family's.
TOWER_MODEL_TYPE = "paligemma_vision"
TOWER_PARTS = ("embeddings", "encoder", "post_layernorm")
# The default budgets hold up to MAX_GRAPH_VIEWS views (one an image: calls close together share a
# batch) and no more than MAX_GRAPH_TOKENS tokens: 16 views of 224² or 448², 4 of 896². Larger batches
# run eager at their own size: there the tower is compute-bound and a graph saves little of the time
# (as for the other towers' large inputs); the caps are not yet tuned on a GPU for this family.
MAX_GRAPH_VIEWS = 16
MAX_GRAPH_TOKENS = 16384


class PaliGemmaVisionConfig(SiglipVisionConfig):
    """SigLIP's vision config under vitpool's own model_type, with the projector's `projection_dim`:
    what a tower-only save of `PaliGemmaEncoder` writes (SigLIP's type would load as Gemma 3's)."""

    model_type = TOWER_MODEL_TYPE


class PaliGemmaEncoder(TowerWithProjector):
    """The tower and the projector, as `PaliGemmaModel` holds them."""


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> PaliGemmaEncoder:
    """Fresh tower and projector from a full PaliGemmaConfig or a vision config with the adapter's
    PROJECTOR_FIELDS (`projection_dim`, the LLM's width)."""
    from transformers import SiglipVisionModel
    from transformers.models.paligemma.modeling_paligemma import PaliGemmaMultiModalProjector

    full = PaliGemmaAdapter.projector_config(config)
    tower, projector = tower_and_projector(SiglipVisionModel, PaliGemmaMultiModalProjector, full, dtype)
    return PaliGemmaEncoder(tower, projector)


def read_tower_config(directory: Any) -> PaliGemmaVisionConfig:
    """A tower-only save's config (TOWER_MODEL_TYPE, which AutoConfig does not know)."""
    return PaliGemmaVisionConfig.from_pretrained(directory)


def graph_views(tokens_per_view: int) -> int:
    """The most views the default budgets hold: MAX_GRAPH_VIEWS, fewer where they would pass
    MAX_GRAPH_TOKENS (at least one)."""
    return max(1, min(MAX_GRAPH_VIEWS, MAX_GRAPH_TOKENS // tokens_per_view))


class PaliGemmaAdapter(TiledAdapter):
    """Adapter for `PaliGemmaEncoder`: rows are views (one an image), no metadata."""

    # What a tower-only save's vision config carries besides SigLIP's fields: the projector's output
    # width (PaliGemmaConfig copies its projection_dim into the vision config; read it from there).
    PROJECTOR_FIELDS = (ConfigField("projection_dim", "vision_config.projection_dim", int),)
    PROJECTOR_SUBJECT = "a PaliGemma vision config"
    PROJECTOR_ADVICE = (
        "to build its multi_modal_projector; give the full model's config (PaliGemmaConfig) or a tower-only "
        "save written from tower_only_config (a plain SigLIP tower has no projector for vitpool to run)"
    )
    # Another model's projector is not this one's (Gemma 3's pools and normalises first).
    FULL_MODEL_TYPES = ("paligemma",)
    OTHER_MODEL = (
        "a {model_type} checkpoint: vitpool's paligemma family runs PaliGemma's projector only "
        "(model_type {expected})"
    )
    # Tensors keyed as saved: `vision_tower.*` / `multi_modal_projector.*` (transformers 5's
    # save_pretrained, tower-only saves), the same under `model.` (a model's state_dict),
    # `vision_tower.vision_model.*` (the releases keep SigLIP's tower one level down; transformers 5's
    # module has no such level).
    CHECKPOINT_RENAMES = renames(
        (r"^(?:model\.)?vision_tower\.vision_model\.", "vision_tower."), (r"^model\.", "")
    )

    VISION_CONFIG = PaliGemmaVisionConfig

    def __init__(self, tower: PaliGemmaEncoder) -> None:
        vision = tower.vision_tower
        check_tower_parts("PaliGemma", vision, TOWER_PARTS)
        config = vision.config
        side = int(config.image_size) // int(config.patch_size)
        install_kernels(tower)
        self.tower = tower
        self.tokens_per_tile = side * side  # one token a patch: the projector neither pools nor merges
        self.max_graph_tiles = graph_views(self.tokens_per_tile)
        self.item_rules = TileRules(
            int(config.num_channels),
            int(config.image_size),
            self.tokens_per_tile,
            ((int(tower.multi_modal_projector.linear.out_features),),),
        )

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [views, C, S, S] -> patches [views, (S/P)², D] -> tokens [views * (S/P)², LLM width]
        patches = self.tower.vision_tower(pixel_values=pixels).last_hidden_state
        tokens = self.tower.multi_modal_projector(patches)
        return [tokens.reshape(-1, tokens.shape[-1])]


# The loader's hooks (`vitpool.models.family.adapter_checkpoint`).
projector_config = PaliGemmaAdapter.projector_config
tower_only_config = PaliGemmaAdapter.tower_only_config
convert_checkpoint = PaliGemmaAdapter.convert_checkpoint
