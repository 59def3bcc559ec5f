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

import importlib
from typing import Any

import torch

from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, ConfigField, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.tiled import TiledAdapter, install_kernels
from vitpool.rules.tiles import TileRules

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


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Idefics3VisionEncoder:
    """Fresh tower and connector from a full config or a vision config with the adapter's
    PROJECTOR_FIELDS; the classes are SmolVLM's for a SmolVLM vision config, Idefics3's otherwise."""
    full = Idefics3Adapter.projector_config(config)
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


class Idefics3Adapter(TiledAdapter):
    """Adapter for `Idefics3VisionEncoder`: rows are full splits, no metadata."""

    max_graph_tiles = MAX_GRAPH_TILES
    # What a tower-only save's vision config carries besides Hugging Face's fields, for the connector
    # (the full model's config holds them).
    PROJECTOR_FIELDS = (TEXT_HIDDEN_SIZE, ConfigField("scale_factor", "scale_factor"))
    PROJECTOR_SUBJECT = "an Idefics3 / SmolVLM vision config"
    PROJECTOR_ADVICE = (
        "to build its connector; give the full model's config (Idefics3Config, SmolVLMConfig) or a "
        "tower-only save that carries them"
    )
    # A full checkpoint's `model.vision_model.*` and `model.connector.*` lose `model.` (a tower-only
    # save's keys are the module's own already).
    CHECKPOINT_RENAMES = renames((r"^model\.", ""))

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


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
connector_config = Idefics3Adapter.projector_config
tower_only_config = Idefics3Adapter.tower_only_config
convert_checkpoint = Idefics3Adapter.convert_checkpoint
