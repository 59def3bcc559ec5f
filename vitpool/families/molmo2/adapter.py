"""Molmo 2 (`Molmo2Model`): its ViT (`Molmo2VisionModel`) on crops and its adapter (`Molmo2Adapter`:
the attention pooling of patch features and the projector), all in one graph.

In the graph: the tower on the buffer's crops as its batch dimension (each crop one fixed-length
sequence of side² patches, the learned position table added whole: no metadata), the hidden states
of `vision_feature_layer` side by side, then for every output token a gather of its pooling
window's patch features, their mean over the window's real patches as the query, the adapter's
attention over the window (padding slots masked) and the projector. On the host (`build_metadata`):
the windows themselves, `rules.item_windows` of each item's layout, offset to the item's first crop
in the buffer: `pool_index` [tokens, max_pool_slots] (rows of the buffer's flattened patches) and
`pool_valid` (False: a padding slot). A padding token pools patch 0 alone, so that every row is
finite; nobody reads it.

`Molmo2Encoder` holds the tower and the adapter (state keys `vision_tower.*` and
`multi_modal_projector.*`; a model's state_dict has them under `model.`). allenai's releases keep the
original layout (`vision_backbone.image_vit.*`, `vision_backbone.image_pooling_2d.*`,
`vision_backbone.image_projector.*`, the original names inside), which `convert_checkpoint` renames
as transformers' conversion mapping does.
"""

from __future__ import annotations

import copy
import functools
import random
import re
from collections.abc import Sequence
from typing import Any

import torch

from vitpool.errors import ConfigError
from vitpool.families.molmo2.rules import BUDGET_POOL, Molmo2Rules, item_windows
from vitpool.models.adapter_base import AdapterBase, ConfigField
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import TowerWithProjector
from vitpool.models.protocol import BudgetRange, TensorSpec, zero_metadata
from vitpool.models.tiled import check_tiles_fit, install_kernels
from vitpool.packing import SEQUENCES, Budget
from vitpool.specs import IMAGE, VIDEO, ItemSpec

TOWER_PARTS = (
    "vision_tower.patch_embedding",
    "vision_tower.positional_embedding",
    "vision_tower.layers",
    "multi_modal_projector.image_pooling_2d",
    "multi_modal_projector.image_projector",
)
# An image's most crops in the budgets vitpool captures by default: the processor's max_crops (8)
# and the global view.
MAX_GRAPH_CROPS = 9
MAX_SAMPLE_ATTEMPTS = 40
# allenai's release keys -> transformers' (its conversion_mapping.py for "molmo2"), applied in turn.
RELEASE_RENAMES = tuple(
    (re.compile(pattern), target)
    for pattern, target in (
        (r"^(?:model\.)?vision_backbone\.image_vit\.transformer\.resblocks\.", "vision_tower.layers."),
        (r"^(?:model\.)?vision_backbone\.image_vit\.", "vision_tower."),
        (r"^(?:model\.)?vision_backbone\.image_pooling_2d\.", "multi_modal_projector.image_pooling_2d."),
        (r"^(?:model\.)?vision_backbone\.image_projector\.", "multi_modal_projector.image_projector."),
        (r"^model\.", ""),
        (r"\.attention\.w([qkvo])\.", r".self_attn.\1_proj."),
        (r"\.feed_forward\.w1\.", ".mlp.fc1."),
        (r"\.feed_forward\.w2\.", ".mlp.fc2."),
        (r"\.attention_norm\.", ".layer_norm1."),
        (r"\.ffn_norm\.", ".layer_norm2."),
        (r"image_pooling_2d\.w([qkvo])\.", r"image_pooling_2d.\1_proj."),
        (r"image_projector\.w1\.", "image_projector.gate_proj."),
        (r"image_projector\.w2\.", "image_projector.down_proj."),
        (r"image_projector\.w3\.", "image_projector.up_proj."),
    )
)
Tensors = dict[str, torch.Tensor]


class Molmo2Encoder(TowerWithProjector):
    """The tower and the adapter (pooling and projector), as `Molmo2Model` holds them."""


def adapter_config_of(config: Any) -> Any:
    """The `Molmo2AdapterConfig` of a full Molmo2Config or of a tower-only vision config carrying it
    (as a dict, `PROJECTOR_FIELDS`)."""
    from transformers.models.molmo2.configuration_molmo2 import Molmo2AdapterConfig

    adapter = Molmo2Adapter.projector_config(config).adapter_config
    return adapter if isinstance(adapter, Molmo2AdapterConfig) else Molmo2AdapterConfig(**dict(adapter))


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Molmo2Encoder:
    """Fresh tower and adapter from a full Molmo2Config or a vision config with PROJECTOR_FIELDS."""
    from transformers.models.molmo2.modeling_molmo2 import Molmo2Adapter as HfAdapter
    from transformers.models.molmo2.modeling_molmo2 import Molmo2VisionModel

    vision = config.vision_config if getattr(config, "vision_config", None) is not None else config
    adapter_config = adapter_config_of(config)
    for sub_config in (vision, adapter_config):
        sub_config._attn_implementation = "sdpa"  # a crop, a window: plain SDPA over the batch dimension
    if dtype is None:
        return Molmo2Encoder(Molmo2VisionModel(vision), HfAdapter(adapter_config))
    return Molmo2Encoder(
        Molmo2VisionModel._from_config(vision, dtype=dtype),
        HfAdapter._from_config(adapter_config, dtype=dtype),
    )


def feature_layers(vision_feature_layer: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The hidden states `get_image_features` reads (0: the embeddings; layer i's output at i + 1;
    a negative layer counts from the last), in the order they are concatenated.

    Raises:
        ConfigError: a layer outside the tower.
    """
    indices = []
    for layer in vision_feature_layer:
        index = int(layer) + 1 if int(layer) >= 0 else num_layers + 1 + int(layer)
        if not 1 <= index <= num_layers:
            raise ConfigError(
                f"Molmo 2: vision_feature_layer {layer} is outside the tower's {num_layers} layers"
            )
        indices.append(index)
    return tuple(indices)


class Molmo2Adapter(AdapterBase):
    """Adapter for `Molmo2Encoder`: crops in, what the LLM receives out."""

    # A tower-only save's vision config carries the adapter's config whole (Molmo2Config holds it).
    PROJECTOR_FIELDS = (ConfigField("adapter_config", "adapter_config", lambda config: _as_dict(config)),)
    PROJECTOR_SUBJECT = "a Molmo 2 vision config"
    PROJECTOR_ADVICE = (
        "to build its pooling and projector; give the full model's config (Molmo2Config) or a tower-only "
        "save written from tower_only_config"
    )
    FULL_MODEL_TYPES = ("molmo2",)
    MAX_SAMPLED_ITEMS = 6

    def __init__(self, tower: Molmo2Encoder) -> None:
        check_tower_parts("Molmo 2", tower, TOWER_PARTS)
        vision = tower.vision_tower
        config = vision.config
        projector = tower.multi_modal_projector
        side = int(config.image_size[0]) // int(config.patch_size)
        if int(config.num_position_embeddings) != side * side or config.image_size[0] != config.image_size[1]:
            raise ConfigError(
                f"Molmo 2: vitpool runs square crops whose patches match the position table; image_size "
                f"{config.image_size}, patch_size {config.patch_size}, num_position_embeddings "
                f"{config.num_position_embeddings}"
            )
        self.tower = tower
        self.feature_layers = feature_layers(projector.config.vision_feature_layer, len(vision.layers))
        self.item_rules = Molmo2Rules(
            side=side,
            patch_width=int(vision.patch_embedding.in_features),
            output_width=int(projector.image_projector.down_proj.out_features),
        )
        self._windows = functools.lru_cache(maxsize=1024)(self._item_windows)
        install_kernels(tower)

    def max_rows(self, num_tokens: int) -> int:
        return self.item_rules.max_crops(num_tokens)

    def budget_range(self, device: torch.device) -> BudgetRange:
        """Whole crops, up to an image of the processor's most crops."""
        step = self.item_rules.tokens_per_crop
        return BudgetRange(step, MAX_GRAPH_CROPS * step, step)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        slots = self.item_rules.max_pool_slots
        return {
            "pool_index": TensorSpec((budget.num_tokens, slots), torch.long),  # rows of the flattened patches
            "pool_valid": TensorSpec((budget.num_tokens, slots), torch.bool),
        }

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> Tensors:
        check_tiles_fit(specs, num_rows, budget, "crops")
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        metadata["pool_valid"][:, 0] = True  # padding tokens: patch 0 alone
        patches_per_crop = self.item_rules.side**2
        crop = token = 0
        for spec in specs:
            windows = self._windows(spec.modality, spec.num_rows, spec.layout)
            end = token + windows.shape[0]
            valid = windows >= 0
            width = windows.shape[1]
            metadata["pool_index"][token:end, :width] = torch.where(
                valid, windows + crop * patches_per_crop, 0
            )
            metadata["pool_valid"][token:end] = False
            metadata["pool_valid"][token:end, :width] = valid
            crop += spec.num_rows
            token = end
        return metadata

    def _item_windows(self, modality: str, num_crops: int, layout: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(item_windows(self.item_rules.side, modality, num_crops, tuple(layout)).copy())

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [crops, side², P*P*C] -> features [crops * side², D_vision * layers]
        features = self._features(pixels).flatten(0, 1)
        index, valid = metadata["pool_index"], metadata["pool_valid"]
        weights = valid.to(features.dtype)
        patches = features[index] * weights[..., None]  # [tokens, slots, D]
        query = patches.sum(1, keepdim=True) / weights.sum(1).clamp(min=1)[:, None, None]
        pooled = self._pool(query, patches, valid)
        return [self.tower.multi_modal_projector.image_projector(pooled)]

    def _pool(self, query: torch.Tensor, patches: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`Molmo2Adapter.image_pooling_2d`: the query [tokens, 1, D] attends to its window's patches
        [tokens, slots, D], padding slots masked -> [tokens, width]."""
        attention = self.tower.multi_modal_projector.image_pooling_2d
        tokens, head_dim = query.shape[0], attention.head_dim
        q = attention.q_proj(query).view(tokens, 1, -1, head_dim).transpose(1, 2)
        k = attention.k_proj(patches).view(tokens, patches.shape[1], -1, head_dim).transpose(1, 2)
        v = attention.v_proj(patches).view(tokens, patches.shape[1], -1, head_dim).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=valid[:, None, None, :],
            scale=attention.scaling,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return attention.o_proj(out.transpose(1, 2).reshape(tokens, -1))

    def _features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The hidden states of `feature_layers`, side by side: [crops, side², D_vision * layers].
        Layers past the last one read are not run."""
        vision = self.tower.vision_tower
        hidden = vision.patch_embedding(pixels.to(vision.patch_embedding.weight.dtype))
        hidden = hidden + vision.positional_embedding[None].to(hidden.dtype)
        states = {}
        for number, layer in enumerate(vision.layers[: max(self.feature_layers)], start=1):
            hidden = layer(hidden, None)
            states[number] = hidden
        return torch.cat([states[index] for index in self.feature_layers], dim=-1)

    @classmethod
    def convert_checkpoint(cls, state: Tensors, config: Any = None) -> Tensors:
        """The module's state from a checkpoint's tensors: transformers' keys with or without `model.`,
        or allenai's release keys (`RELEASE_RENAMES`, each that matches applied in turn)."""
        converted = {}
        for key, tensor in state.items():
            name = key
            for pattern, target in RELEASE_RENAMES:
                name = pattern.sub(target, name)
            converted[name] = tensor
        return converted

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        crops_left = min(num_rows, budget.limit(SEQUENCES) or num_rows)
        tokens_left = budget.num_tokens
        specs: list[ItemSpec] = []
        for _ in range(MAX_SAMPLE_ATTEMPTS):
            if len(specs) >= self.sampled_items(budget) or crops_left < 1:
                break
            spec = self._random_spec(rng, crops_left)
            if spec.num_rows <= crops_left and spec.num_tokens <= tokens_left:
                specs.append(spec)
                crops_left -= spec.num_rows
                tokens_left -= spec.num_tokens
        return specs

    def _random_spec(self, rng: random.Random, crops_left: int) -> ItemSpec:
        """An image of a random tiling with the processor's pooling, or a short video."""
        rules, side = self.item_rules, self.item_rules.side
        if rng.random() < 0.25:
            pool = min(3, side)
            return rules.item_spec(
                VIDEO, (rng.randint(1, min(3, crops_left)), *self.row_shape), "float32", (pool, pool)
            )
        tiling_h, tiling_w = rng.randint(1, 3), rng.randint(1, 3)
        margin = rng.randint(0, max(0, (side - 1) // 4))
        layout = (tiling_h, tiling_w, BUDGET_POOL, BUDGET_POOL, margin, margin)
        return rules.item_spec(IMAGE, (tiling_h * tiling_w + 1, *self.row_shape), "float32", layout)


def _as_dict(config: Any) -> dict[str, Any]:
    """A sub-config as the plain dict a tower-only save's config.json holds."""
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    fields.pop("model_type", None)
    return copy.deepcopy(fields)


# The loader's hooks (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = Molmo2Adapter.tower_only_config
convert_checkpoint = Molmo2Adapter.convert_checkpoint
