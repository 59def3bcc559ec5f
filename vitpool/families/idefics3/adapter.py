"""Idefics3 and SmolVLM (`Idefics3VisionTransformer` / `SmolVLMVisionTransformer`, SigLIP) and
their `connector`.

An image is whole splits of one size (the vision config's `image_size`: 364² in Idefics3-8B, 512²
in SmolVLM-256M / 500M, 384² in SmolVLM-2.2B): its processor resizes it to a whole number of splits
per side, cuts them row by row and appends the whole image resized to one split (the global image;
an image that already fits one split is that split alone). Every split the processor emits is full:
`resize_for_vision_encoder` rounds both sides up to multiples of the split size before cutting, and
without splitting every image is resized to exactly one split, so `pixel_attention_mask` is all
ones on real splits and the processor's padding is whole all-zero splits, which the model drops.
A split is one attention sequence with no mask; the tower runs splits as its batch dimension, so a
batch needs no metadata. The model's position ids for a full split (its bucketized fractional
coordinates) are computed once (`split_position_ids`), not per forward.

After the tower (its `post_layernorm` included), as `get_image_features` does: the connector
pixel-shuffles each split's patch grid by `scale_factor` and projects it into the LLM's width,
(side / scale_factor)² tokens a split, the splits in the processor's order (the global image
last).

`Idefics3VisionEncoder` holds the tower and the connector (state keys `vision_model.*` and
`connector.*`; a full checkpoint has them under `model.`).
"""

from __future__ import annotations

import copy
import importlib
from types import SimpleNamespace
from typing import Any

import torch

from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import require_fields
from vitpool.models.tiled import TiledAdapter, install_kernels
from vitpool.rules.tiles import TileRules

# What a tower-only save's vision config carries besides Hugging Face's fields, for the connector
# (the full model's config holds them).
CONNECTOR_FIELDS = ("text_hidden_size", "scale_factor")
# The default budgets hold up to this many splits: a 4 x 4 split image and its global image (the
# processors' default `size` is 4 splits on the longest side); a batch of more runs eager.
MAX_GRAPH_TILES = 17
TOWER_PARTS = ("embeddings.patch_embedding", "embeddings.position_embedding", "encoder", "post_layernorm")
# Where the split size comes from, named when tiles of another size are refused.
SPLIT_SIZE_SOURCE = (
    "the vision config's image_size; the image processor's max_image_size['longest_edge'] must equal it"
)
# The Hugging Face classes of each vision config: SmolVLM's are Idefics3's under other names.
_CLASSES = {
    "SmolVLMVisionConfig": (
        "transformers.models.smolvlm.modeling_smolvlm",
        "SmolVLMVisionTransformer",
        "SmolVLMConnector",
    ),
}
_IDEFICS3_CLASSES = (
    "transformers.models.idefics3.modeling_idefics3",
    "Idefics3VisionTransformer",
    "Idefics3Connector",
)


class Idefics3VisionEncoder(torch.nn.Module):
    """The tower and its connector, with the position ids of a full split (not saved)."""

    def __init__(self, vision_model: torch.nn.Module, connector: torch.nn.Module) -> None:
        super().__init__()
        self.vision_model = vision_model
        self.connector = connector
        self.config = vision_model.config
        side = int(self.config.image_size) // int(self.config.patch_size)
        self.register_buffer("split_position_ids", split_position_ids(side), persistent=False)


def split_position_ids(side: int) -> torch.Tensor:
    """The position ids `Idefics3VisionEmbeddings` gives a full split of side x side patches: each
    patch's fractional coordinates bucketized into the side x side position table, as its forward
    computes them (float32), row-major [side * side]."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    coordinates = torch.arange(side, dtype=torch.float32) * (1.0 / torch.tensor(float(side)))
    buckets = torch.bucketize(torch.clamp(coordinates, max=1.0 - 1e-6), boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1)


def connector_config(config: Any) -> Any:
    """What the connector reads, from a full `Idefics3Config` / `SmolVLMConfig` or from a vision
    config carrying CONNECTOR_FIELDS (a tower-only save)."""
    if getattr(config, "text_config", None) is not None:
        return config
    require_fields(
        config,
        CONNECTOR_FIELDS,
        "an Idefics3 / SmolVLM vision config",
        "to build its connector; give the full "
        "model's config (Idefics3Config, SmolVLMConfig) or a tower-only save that carries them",
    )
    return SimpleNamespace(
        vision_config=config,
        text_config=SimpleNamespace(hidden_size=config.text_hidden_size),
        scale_factor=config.scale_factor,
    )


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Idefics3VisionEncoder:
    """Fresh tower and connector from a full config or a vision config with CONNECTOR_FIELDS; the
    classes are SmolVLM's for a SmolVLM vision config, Idefics3's otherwise."""
    full = connector_config(config)
    module_name, tower_name, connector_name = _CLASSES.get(
        type(full.vision_config).__name__, _IDEFICS3_CLASSES
    )
    module = importlib.import_module(module_name)
    tower_class, connector_class = getattr(module, tower_name), getattr(module, connector_name)
    if dtype is None:
        tower = tower_class._from_config(full.vision_config)
        connector = connector_class(full)
    else:
        tower = tower_class._from_config(full.vision_config, dtype=dtype)
        connector = connector_class(full).to(dtype)
    return Idefics3VisionEncoder(tower, connector)


def tower_only_config(full_config: Any) -> Any:
    """The vision config of a full Idefics3Config / SmolVLMConfig with CONNECTOR_FIELDS added: what
    a tower-only save of `Idefics3VisionEncoder` writes as its config.json (and what a full
    checkpoint is built from)."""
    config = copy.deepcopy(full_config.vision_config)
    config.text_hidden_size = full_config.text_config.hidden_size
    config.scale_factor = full_config.scale_factor
    return config


def convert_checkpoint(checkpoint: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The loader's hook: a full checkpoint's `model.vision_model.*` and `model.connector.*` less
    the `model.` (a tower-only save's keys are the module's own already)."""
    return {key.removeprefix("model."): tensor for key, tensor in checkpoint.items()}


class Idefics3Adapter(TiledAdapter):
    """Adapter for `Idefics3VisionEncoder`: rows are full splits, no metadata."""

    max_graph_tiles = MAX_GRAPH_TILES

    def __init__(self, tower: Idefics3VisionEncoder) -> None:
        vision = tower.vision_model
        config = vision.config
        check_tower_parts("Idefics3", vision, TOWER_PARTS)
        image_size, patch_size = int(config.image_size), int(config.patch_size)
        scale = int(tower.connector.scale_factor)
        side = image_size // patch_size
        if image_size % patch_size or side % scale:
            raise ValueError(
                f"Idefics3 / SmolVLM splits of {image_size} pixels in patches of {patch_size} give {side} "
                f"patches a side, which scale_factor {scale} does not divide: the connector cannot "
                "pixel-shuffle them"
            )
        install_kernels(tower)
        self.tower = tower
        self.tokens_per_tile = (side // scale) ** 2
        self.item_rules = TileRules(
            int(config.num_channels),
            image_size,
            self.tokens_per_tile,
            ((int(tower.connector.modality_projection.proj.out_features),),),
            tile_size_source=SPLIT_SIZE_SOURCE,
        )

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [splits, C, S, S]; every split full, so no attention mask and fixed position ids.
        # The tower's own forward is not called: it turns its all-ones patch mask into an attention
        # mask through `create_bidirectional_mask`, whose SDPA skip test (`mask.all()`) syncs with
        # the host, which a captured graph cannot do.
        vision = self.tower.vision_model
        patches = vision.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [splits, side², D]
        hidden = patches + vision.embeddings.position_embedding(self.tower.split_position_ids)
        hidden = vision.post_layernorm(
            vision.encoder(inputs_embeds=hidden, attention_mask=None).last_hidden_state
        )
        tokens = self.tower.connector(hidden)  # [splits, tokens a split, LLM width]
        return [tokens.reshape(-1, tokens.shape[-1])]
