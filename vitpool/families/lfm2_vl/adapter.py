"""LFM2-VL (LFM2-VL-450M, -1.6B, -3B and their kin): the SigLIP2 NaFlex tower (`Siglip2VisionModel`)
and the model's `Lfm2VlMultiModalProjector`, run together in one graph.

Hugging Face's `Lfm2VlModel.get_image_features` takes every entry (a tile, a thumbnail or a whole
small image) padded to one patch count, [entries, max_patches, C*P*P], with `spatial_shapes`
(h, w) per entry and `pixel_attention_mask` marking the real patches. The tower embeds each
flattened patch with a Linear, adds its position embedding (the learned G x G table resized to the
entry's h x w: bilinear with antialiasing, `Siglip2VisionEmbeddings.resize_positional_embeddings`,
computed as each position's weights over the table), runs its layers with the padding masked out
(each entry attends over itself) and a final LayerNorm. The projector's pixel unshuffle then turns
each f x f block of an entry's patches into one row of f²*d features (the block's patches row by
row, each its d features), LayerNorms it (where the config says so) and runs a GELU MLP into the
LLM's width: (h/f)*(w/f) tokens per entry, blocks row by row.

What differs for static capture (the rows are the entries' real patches, packed: `rules.py`):

- the position embedding: each row's resize weights are separable, a weight per table row times a
  weight per table column; the host computes both [rows, 2, G] per entry size, in float32 (the
  weights of `F.interpolate`'s antialiased bilinear resize, which Hugging Face ran before 5.24 and
  writes out as these weights since), and the forward forms their outer product [rows, G²] and
  multiplies it by the table, without reading the sizes back;
- attention: one sequence per entry through vitpool's packed attention (`cu_seqlens` on the host,
  a trailing sequence for the padding rows, a static `max_seqlen`, the buffer's rows) instead of
  the padding mask, whose construction reads the mask back on the host. Hugging Face's
  `Siglip2Attention` does not hand its layer's keyword arguments on to the attention function,
  so the adapter gives each attention module a forward that does (`packed_attention_forward`:
  the same projections, the packed kernel in between);
- the pixel unshuffle is one gather by a [tokens, f²] index of rows, reshaped to [tokens, f²*d].

Padding rows get zero position weights and their own trailing sequence; padding tokens gather
row 0. A SigLIP2 pooling head (`vision_use_head`; off in LFM2-VL's configs) is loaded where the
checkpoint has one and never run: the projector does not read it.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from vitpool.errors import ConfigError
from vitpool.families.lfm2_vl.rules import Lfm2VlRules, Shape, parse_spatial_shapes
from vitpool.kernels.attention import install_packed_attention, packed_attention
from vitpool.models.adapter_base import (
    TEXT_HIDDEN_SIZE,
    AdapterBase,
    ConfigField,
    is_full_config,
    renames,
    sample_block_parts,
)
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import TowerWithProjector, tower_and_projector
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.packing import Budget
from vitpool.specs import IMAGE, ItemSpec

FAMILY = "LFM2-VL"
# What `Lfm2VlAdapter.forward` and `packed_attention_forward` use of transformers' modules.
TOWER_PARTS = (
    "vision_tower.embeddings.patch_embedding",
    "vision_tower.embeddings.position_embedding",
    "vision_tower.embeddings.position_embedding_size",
    "vision_tower.encoder.layers",
    "vision_tower.post_layernorm",
    *(
        f"vision_tower.encoder.layers.0.self_attn.{name}"
        for name in ("q_proj", "k_proj", "v_proj", "out_proj", "head_dim", "scale")
    ),
    *(
        f"multi_modal_projector.{name}"
        for name in ("factor", "use_layer_norm", "layer_norm", "linear_1", "act", "linear_2")
    ),
)
MAX_SAMPLED_ENTRIES = 3
Tensors = dict[str, torch.Tensor]


class Lfm2VlEncoder(TowerWithProjector):
    """The SigLIP2 tower and LFM2-VL's projector; state keys `vision_tower.*` and
    `multi_modal_projector.*` (a full checkpoint has them under `model.`)."""


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Lfm2VlEncoder:
    """Fresh tower and projector from a full `Lfm2VlConfig` or a vision config written by
    `Lfm2VlAdapter.tower_only_config`."""
    from transformers.models.lfm2_vl.modeling_lfm2_vl import Lfm2VlMultiModalProjector
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionModel

    if is_full_config(config):  # refused unless it is LFM2-VL's
        config = Lfm2VlAdapter.tower_only_config(config)
    full = Lfm2VlAdapter.projector_config(config)
    tower, projector = tower_and_projector(Siglip2VisionModel, Lfm2VlMultiModalProjector, full, dtype)
    return Lfm2VlEncoder(tower, projector)


def packed_attention_forward(
    attention: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`Siglip2Attention.forward` that hands its keyword arguments (the packed boundaries) on to
    vitpool's packed attention; Hugging Face's passes the attention function the mask alone.
    hidden_states: [1, rows, d] -> ([1, rows, d], None)."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, attention.head_dim)
    queries, keys, values = (
        projection(hidden_states).view(hidden_shape).transpose(1, 2)
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj)
    )
    output, _ = packed_attention(
        attention, queries, keys, values, attention_mask, scaling=attention.scale, **kwargs
    )
    return attention.out_proj(output.reshape(*input_shape, -1).contiguous()), None


def install_packed_siglip2_attention(tower: torch.nn.Module) -> None:
    """Route every attention module of the tower's layers through `packed_attention_forward`.
    Doing it again is harmless."""
    for layer in tower.encoder.layers:
        # a partial of a module-level function (not a bound method): the tower still pickles
        layer.self_attn.forward = functools.partial(packed_attention_forward, layer.self_attn)


def axis_weights(length: int, grid_size: int) -> torch.Tensor:
    """The weights [length, grid_size] that resize one axis of the position table from
    `grid_size` to `length` positions: `F.interpolate(mode="bilinear", align_corners=False,
    antialias=True)`'s along that axis, in float32, as `Siglip2VisionEmbeddings.resize_positional_embeddings`
    computes them (a tent as wide as the scale where it shrinks, normalised per position)."""
    size = torch.tensor(float(length))
    scale = grid_size / size
    support = scale.clamp(min=1)
    center = (torch.arange(length, dtype=torch.float32) + 0.5) * scale - 0.5
    source = torch.arange(grid_size, dtype=torch.float32)
    weights = (1 - (source - center[:, None]).abs() / support).clamp(min=0)
    return weights / weights.sum(-1, keepdim=True)


class Lfm2VlAdapter(AdapterBase):
    """Adapter for `Lfm2VlEncoder`: packed patch rows in, the projector's tokens out."""

    # What a tower-only save's vision config carries besides SigLIP2's fields, for the projector
    # (`vision_config.hidden_size`, `text_config.hidden_size` and these).
    PROJECTOR_FIELDS = (
        dataclasses.replace(TEXT_HIDDEN_SIZE, cast=int),
        *(
            ConfigField(name, name)
            for name in (
                "downsample_factor",
                "projector_hidden_size",
                "projector_hidden_act",
                "projector_bias",
                "projector_use_layernorm",
            )
        ),
    )
    PROJECTOR_SUBJECT = "LFM2-VL's projector"
    PROJECTOR_ADVICE = (
        "besides the SigLIP2 vision config: give the full model's config (Lfm2VlConfig) or a tower-only "
        "save written with tower_only_config"
    )
    # Another model with a SigLIP2 tower has another projector.
    FULL_MODEL_TYPES = ("lfm2_vl",)
    OTHER_MODEL = (
        "vitpool's lfm2_vl family runs the SigLIP2 tower with LFM2-VL's pixel-unshuffle projector; a "
        "{model_type} checkpoint has another projector, which vitpool does not run"
    )
    # A full checkpoint's keys (the record's prefixes): the model's own (`model.vision_tower.`,
    # `model.multi_modal_projector.`: what transformers 5 writes), or without `model.`. The releases
    # keep the tower one level down, under `vision_tower.vision_model.` (the SigLIP2 class of their
    # day), which transformers strips on load (`Siglip2VisionModel` takes CLIPVisionModel's prefix
    # change).
    CHECKPOINT_RENAMES = renames(
        (r"^(?:model\.)?vision_tower\.(?:vision_model\.)?", "vision_tower."),
        (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
    )

    def __init__(self, tower: Lfm2VlEncoder) -> None:
        check_tower_parts(FAMILY, tower, TOWER_PARTS)
        vision, projector = tower.vision_tower, tower.multi_modal_projector
        config = vision.config
        embeddings = vision.embeddings
        self.grid_size = int(embeddings.position_embedding_size)
        if self.grid_size**2 != embeddings.position_embedding.num_embeddings:
            raise ConfigError(
                f"{FAMILY}: the position table has {embeddings.position_embedding.num_embeddings} rows; "
                "SigLIP2 resizes a square one (num_patches a square number)"
            )
        self.tower = tower
        self.downsample_factor = int(projector.factor)
        self.item_rules = Lfm2VlRules(
            int(config.num_channels),
            int(config.patch_size),
            self.downsample_factor,
            int(projector.linear_2.out_features),
        )
        self.merge_unit = self.item_rules.merge_unit
        self._per_shape = lru_cache(maxsize=1024)(self._shape_tensors)
        install_packed_attention(vision)
        install_packed_siglip2_attention(vision)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            # each row's resize weights over the table's rows and over its columns
            "position_weights": TensorSpec((num_rows, 2, self.grid_size), torch.float32),
            # one sequence per entry, the padding's, the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
            "merge_index": TensorSpec((budget.num_tokens, self.merge_unit), torch.long),
        }

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> Tensors:
        shapes = [shape for spec in specs for shape in parse_spatial_shapes(spec.layout)]
        rows = sum(h * w for h, w in shapes)
        tokens = rows // self.merge_unit
        if (
            rows > num_rows
            or len(shapes) > budget.max_sequences
            or tokens > budget.num_tokens
            or len(specs) > budget.max_items
        ):
            raise ValueError(
                f"{len(specs)} items need {rows} rows, {len(shapes)} sequences and {tokens} tokens; the "
                f"buffers hold {num_rows} rows, {budget.max_sequences} sequences, {budget.num_tokens} tokens "
                f"and {budget.max_items} items"
            )
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        boundaries, token = [0], 0
        for shape in shapes:
            row = boundaries[-1]
            weights, merge_index = self._per_shape(shape)
            metadata["position_weights"][row : row + weights.shape[0]] = weights
            metadata["merge_index"][token : token + merge_index.shape[0]] = merge_index + row
            boundaries.append(row + weights.shape[0])
            token += merge_index.shape[0]
        # unused entries repeat the end: the padding rows are one trailing sequence
        cu_seqlens = metadata["cu_seqlens"]
        cu_seqlens.fill_(num_rows)
        cu_seqlens[: len(boundaries)] = torch.tensor(boundaries, dtype=torch.int32)
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [rows, C*P*P], one flattened patch per row
        vision, projector = self.tower.vision_tower, self.tower.multi_modal_projector
        embeddings = vision.embeddings
        patches = embeddings.patch_embedding(pixels.to(embeddings.patch_embedding.weight.dtype))  # [rows, d]
        weights = metadata["position_weights"]
        table = embeddings.position_embedding.weight  # [G², d], row-major over the G x G grid
        resize = (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)  # [rows, G²]
        hidden = (patches + (resize @ table.float()).to(table.dtype)).unsqueeze(0)  # [1, rows, d]
        cu_seqlens, num_rows = metadata["cu_seqlens"], pixels.shape[0]
        for layer in vision.encoder.layers:
            hidden = layer(
                hidden,
                None,
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens,
                max_length_q=num_rows,
                max_length_k=num_rows,  # static: Python ints from the buffer's shape
            )
        hidden = vision.post_layernorm(hidden[0])
        merge_index = metadata["merge_index"]
        features = hidden[merge_index].reshape(merge_index.shape[0], -1)  # [tokens, f² * d]
        if projector.use_layer_norm:
            features = projector.layer_norm(features)
        return [projector.linear_2(projector.act(projector.linear_1(features)))]

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        """Random images of one to three entries (blocks of f x f patches, one token each) of
        shapes below and above the position table's, filling the rows or leaving padding."""
        rules, f = self.item_rules, self.downsample_factor
        specs: list[ItemSpec] = []
        blocks = min(num_rows // self.merge_unit, budget.num_tokens)
        for entries in sample_block_parts(
            rng, blocks, budget.max_sequences, self.sampled_items(budget), MAX_SAMPLED_ENTRIES
        ):
            shapes = [(f * height, f * width) for height, width in entries]
            rows = sum(h * w for h, w in shapes)
            specs.append(rules.item_spec(IMAGE, (rows, *rules.row_shape), "float32", shapes))
        return specs

    def _shape_tensors(self, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
        """One entry's position weights [h*w, 2, G] (its row's weights over the table's rows, its
        column's over the table's columns; patches row-major) and its pixel unshuffle's gather
        [tokens, f²] (token (bh, bw) takes rows (bh*f + i) * w + bw*f + j for i, j row-major)."""
        h, w = shape
        f, grid = self.downsample_factor, self.grid_size
        rows = axis_weights(h, grid)[:, None, :].expand(h, w, grid)
        columns = axis_weights(w, grid)[None, :, :].expand(h, w, grid)
        weights = torch.stack([rows, columns], dim=2).reshape(h * w, 2, grid)
        merge_index = torch.arange(h * w).view(h // f, f, w // f, f).transpose(1, 2).reshape(-1, f * f)
        return weights, merge_index


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = Lfm2VlAdapter.tower_only_config
convert_checkpoint = Lfm2VlAdapter.convert_checkpoint
