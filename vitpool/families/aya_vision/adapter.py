"""Aya Vision (`AyaVisionModel`): the SigLIP tower (`SiglipVisionModel`) and its
`multi_modal_projector` (`AyaVisionMultiModalProjector`), run in one graph.

An image is whole tiles of one size (364² in the releases: up to `max_patches` crops and a
thumbnail of the whole image, last, as `GotOcr2ImageProcessor(crop_to_patches=True)` cuts them; an
image that fits one tile is that tile alone). Each tile is one fixed-length attention sequence
((364 / 14)² = 676 patches, no class token) and the tower runs tiles as its batch dimension, so a
batch needs no metadata: a padding tile is a zero tile whose tokens nobody reads.

What `get_image_features` reads is the hidden state of `vision_feature_layer` (-1 in the releases:
the last layer's output, before `post_layernorm`), every patch kept (`vision_feature_select_strategy`
"full"). The forward runs the layers up to that one and no further; `post_layernorm`, whose output
the model discards, is not run. The projector then pixel-shuffles each tile's patch grid by
`downsample_factor` (2: 2 x 2 patches into one token four times as wide, 169 tokens a tile),
normalises, and maps it through its SwiGLU MLP into the LLM's width: the LLM receives that, tile
after tile. The projector is Hugging Face's own module, its pixel shuffle included.

`AyaVisionEncoder` holds the tower and the projector (state keys `vision_tower.*` and
`multi_modal_projector.*`). A full checkpoint saved by transformers 5 keeps them under `model.`; a
save of transformers 4.x before the `model.` level keeps SigLIP's inner `vision_model.` level
(`vision_tower.vision_model.*`), which transformers 5's `SiglipVisionModel` no longer has.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
from transformers import SiglipVisionConfig

from vitpool.errors import ConfigError
from vitpool.families.llava.adapter import LlavaEncoder
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, ConfigField, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import tower_and_projector
from vitpool.models.tiled import TiledAdapter, install_kernels
from vitpool.rules.tiles import TileRules

# A tower-only save's model_type: SigLIP's own (`siglip_vision_model`) is Gemma 3's family's.
TOWER_MODEL_TYPE = "aya_vision_vision"
# The default budgets hold up to this many tiles (the processor's default max_patches=12 crops and the
# thumbnail); a batch of more runs eager at its own size.
MAX_GRAPH_TILES = 13
TOWER_PARTS = (
    "vision_tower.embeddings",
    "vision_tower.encoder.layers",
    "multi_modal_projector.layernorm",
    "multi_modal_projector.linear_2",
)
# Where the tile size comes from, named when tiles of another size are refused.
TILE_SIZE_SOURCE = (
    "the vision config's image_size (364 in the releases); the image processor's size must equal it "
    "(AyaVisionProcessor's img_size)"
)


@dataclasses.dataclass(frozen=True)
class FieldOr(ConfigField):
    """A `ConfigField` that a full model's config may leave out; then `fallback` (a dotted path
    there) holds its value, as the model reads it."""

    fallback: str = ""

    def read(self, full_config: Any) -> Any:
        if getattr(full_config, self.source, None) is not None:
            return super().read(full_config)
        return self.kept(functools.reduce(getattr, self.fallback.split("."), full_config))


class AyaVisionVisionConfig(SiglipVisionConfig):
    """SigLIP's vision config under vitpool's own model_type, with the adapter's PROJECTOR_FIELDS:
    what a tower-only save of `AyaVisionEncoder` writes (SigLIP's type would load as Gemma 3's)."""

    model_type = TOWER_MODEL_TYPE


class AyaVisionEncoder(LlavaEncoder):
    """The tower and its projector, with what `get_image_features` reads of the full config
    (`settings`: vision_feature_layer, vision_feature_select_strategy), as LLaVA's holds them."""


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> AyaVisionEncoder:
    """Fresh tower and projector from a full AyaVisionConfig or a vision config with the adapter's
    PROJECTOR_FIELDS."""
    from transformers import SiglipVisionModel
    from transformers.models.aya_vision.modeling_aya_vision import AyaVisionMultiModalProjector

    full = AyaVisionAdapter.projector_config(config)
    tower, projector = tower_and_projector(SiglipVisionModel, AyaVisionMultiModalProjector, full, dtype)
    return AyaVisionEncoder(tower, projector, full)


def read_tower_config(directory: Any) -> AyaVisionVisionConfig:
    """A tower-only save's config (TOWER_MODEL_TYPE, which AutoConfig does not know)."""
    return AyaVisionVisionConfig.from_pretrained(directory)


def feature_layer(vision_feature_layer: Any, num_layers: int) -> int:
    """How many of the tower's layers give the hidden state `get_image_features` reads (0: the
    embeddings; `num_layers`: the last layer's output, before `post_layernorm`).

    Raises:
        ConfigError: several layers (their features side by side are wider than the projector's
            LayerNorm, so Hugging Face's model fails on them too), or one outside the tower.
    """
    if isinstance(vision_feature_layer, bool) or not isinstance(vision_feature_layer, int):
        raise ConfigError(
            f"Aya Vision: vision_feature_layer must be one layer (an int; -1 in the releases), got "
            f"{vision_feature_layer!r}: the projector's LayerNorm takes one layer's features"
        )
    index = vision_feature_layer if vision_feature_layer >= 0 else num_layers + 1 + vision_feature_layer
    if not 0 <= index <= num_layers:
        raise ConfigError(
            f"Aya Vision: vision_feature_layer {vision_feature_layer} is outside the tower's {num_layers} "
            "layers"
        )
    return index


class AyaVisionAdapter(TiledAdapter):
    """Adapter for `AyaVisionEncoder`: rows are tiles, no metadata."""

    max_graph_tiles = MAX_GRAPH_TILES
    # What a tower-only save's vision config carries besides SigLIP's fields, for the projector and the
    # feature selection (the full model's AyaVisionConfig holds them; it may leave out
    # alignment_intermediate_size, which the projector then takes as the LLM's width).
    PROJECTOR_FIELDS = (
        dataclasses.replace(TEXT_HIDDEN_SIZE, cast=int),
        ConfigField("downsample_factor", "downsample_factor", int),
        ConfigField("adapter_layer_norm_eps", "adapter_layer_norm_eps", float),
        FieldOr("alignment_intermediate_size", "alignment_intermediate_size", int, "text_config.hidden_size"),
        ConfigField("vision_feature_layer", "vision_feature_layer", copy.deepcopy),
        ConfigField("vision_feature_select_strategy", "vision_feature_select_strategy"),
    )
    PROJECTOR_SUBJECT = "an Aya Vision vision config"
    PROJECTOR_ADVICE = (
        "to build its projector; give the full model's config (AyaVisionConfig) or a tower-only save "
        "written from tower_only_config"
    )
    # Another model's SigLIP tower and projector are not this one's (Command A Vision's projector has
    # no LayerNorm and reads the tower's post_layernorm output).
    FULL_MODEL_TYPES = ("aya_vision",)
    OTHER_MODEL = (
        "a {model_type} checkpoint with a SigLIP vision tower: vitpool's aya_vision family runs Aya "
        "Vision's projector only (model_type {expected})"
    )
    # Tensors keyed as saved: `model.vision_tower.*` / `model.multi_modal_projector.*` (transformers 5),
    # `vision_tower.vision_model.*` (transformers 4.x before the `model.` level), the module's own
    # keys (tower-only saves).
    CHECKPOINT_RENAMES = renames(
        (r"^(?:model\.)?vision_tower\.vision_model\.", "vision_tower."), (r"^model\.", "")
    )

    VISION_CONFIG = AyaVisionVisionConfig

    def __init__(self, tower: AyaVisionEncoder) -> None:
        check_tower_parts("Aya Vision", tower, TOWER_PARTS)
        if tower.vision_feature_select_strategy != "full":
            # "default" drops each tile's first patch as if SigLIP had a class token: the rest no
            # longer form a square grid to pixel-shuffle, and Hugging Face's model fails on them too
            raise ConfigError(
                "vitpool runs Aya Vision with vision_feature_select_strategy='full' (the releases' "
                f"setting); got {tower.vision_feature_select_strategy!r}"
            )
        vision = tower.vision_tower
        config = vision.config
        image_size, patch_size = int(config.image_size), int(config.patch_size)
        factor = int(tower.multi_modal_projector.downsample_factor)
        side = image_size // patch_size
        if image_size % patch_size or side % factor:
            raise ValueError(
                f"Aya Vision tiles of {image_size} pixels in patches of {patch_size} give {side} patches a "
                f"side, which downsample_factor {factor} does not divide: the projector cannot "
                "pixel-shuffle them"
            )
        self.feature_layer = feature_layer(tower.vision_feature_layer, len(vision.encoder.layers))
        install_kernels(tower)
        self.tower = tower
        self.tokens_per_tile = (side // factor) ** 2
        self.item_rules = TileRules(
            int(config.num_channels),
            image_size,
            self.tokens_per_tile,
            ((int(tower.multi_modal_projector.linear_2.out_features),),),
            tile_size_source=TILE_SIZE_SOURCE,
        )

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels [tiles, C, S, S] -> patches [tiles, side², D] -> tokens [tiles, side/f, side/f, LLM width]
        vision = self.tower.vision_tower
        hidden = vision.embeddings(pixels)
        # The layers are called one by one, not through the tower's forward: the hidden state read is
        # a layer's output before post_layernorm, and the layers past it would be wasted work.
        for layer in vision.encoder.layers[: self.feature_layer]:
            hidden = layer(hidden, None)
        tokens = self.tower.multi_modal_projector(hidden)
        return [tokens.reshape(-1, tokens.shape[-1])]


# The loader's hooks (`vitpool.models.family.adapter_checkpoint`).
projector_config = AyaVisionAdapter.projector_config
tower_only_config = AyaVisionAdapter.tower_only_config
convert_checkpoint = AyaVisionAdapter.convert_checkpoint
