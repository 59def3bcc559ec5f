"""LFM3-VL (LFM3-VL-2B and its kin): `Lfm3VlVisionModel` and the model's `Lfm3VlMultiModalProjector`,
run together in one graph.

Hugging Face's `Lfm3VlModel.get_image_features` (and `get_video_features`, the same call) takes
Qwen-style flattened patches [rows, C*T*P*P] in merge-block order with a (t, h, w) grid per item.
The tower embeds each row with a Linear and an RMSNorm, gives it 2D axial rotary positions (row,
column; Qwen3-VL's), and runs a stack of layers, each a mixer (a gated depthwise k x k convolution
over each frame's patch grid, or bidirectional grouped-query attention with RMSNorm on the query
and key heads over each frame) and an MLP, pre-normed with residuals. The projector LayerNorms every
row, joins each merge block's rows (consecutive in the processor's order) into one row of merge²*d
and runs a GELU MLP into the LLM's width: t*(h/m)*(w/m) tokens per item, frame after frame.

What runs in the graph: all of that, over static buffers. What the host computes per grid (cached)
and hands in as metadata, since Hugging Face derives it from `grid_thw.tolist()`:

- `position_ids` [rows, 2]: the rotary (row, column) of each patch (`get_vision_position_ids`);
- `cu_seqlens`: one attention sequence per frame, the padding rows one trailing sequence
  (`frame_cu_seqlens`); `max_seqlen` is the buffer's row count, a Python int;
- `conv_index` [rows, k²]: for each row, the row of each of its k x k neighbours in its frame, or
  the buffer's row count (a zero row appended to the convolution's input) where the neighbour is
  outside the frame. Hugging Face rasters each frame to its grid, convolves and goes back, which
  needs the sizes on the host; a gather of the neighbours times the depthwise weights is the same
  sum with zero padding, for any mix of grids in one buffer.

Attention runs through vitpool's packed attention with the key and value heads repeated to the query
heads (grouped-query attention; Hugging Face's flash path hands the kernel fewer key heads, which
vitpool's kernels do not take). The layers are run here, not through their forward, so that the
mixers get these tensors.

Padding rows get rotary position (0, 0), their own trailing sequence and only zero neighbours; they
never reach a real row (attention is per sequence, the convolution gathers within frames), and their
tokens are merged from padding rows alone.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from transformers.vision_utils import get_vision_position_ids

from vitpool.kernels.attention import packed_attention
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, ConfigField, is_full_config, renamed_key, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import TowerWithProjector, tower_and_projector
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import Grid, SpatialMergeAdapter, frame_cu_seqlens, grids_of, row_width_of
from vitpool.packing import Budget
from vitpool.rules.grids import SpatialMergeRules
from vitpool.specs import ItemSpec

FAMILY = "LFM3-VL"
# What `Lfm3VlAdapter.forward` uses of transformers' modules.
TOWER_PARTS = (
    "vision_tower.patch_embed",
    "vision_tower.embedding_norm",
    "vision_tower.rotary_pos_emb",
    "vision_tower.layers",
    *(
        f"multi_modal_projector.{name}"
        for name in ("layer_norm", "merged_hidden_size", "linear_1", "act", "linear_2")
    ),
)
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "out_proj", "q_norm", "k_norm", "head_dim", "scaling")
CONV_PARTS = ("in_proj", "spatial_conv", "out_proj")
LAYER_PARTS = ("is_attention_layer", "operator_norm", "ffn_norm", "feed_forward")
# The release's names inside the tower's keys (transformers' conversion_mapping.py, "lfm3_vl_vision").
RELEASE_RENAMES = renames(
    (r"\bpatchifier\b", "patch_embed"), (r"\bq_layernorm\b", "q_norm"), (r"\bk_layernorm\b", "k_norm")
)


class Lfm3VlEncoder(TowerWithProjector):
    """The tower and LFM3-VL's projector; state keys `vision_tower.*` and `multi_modal_projector.*`
    (a full checkpoint has them under `model.`)."""


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Lfm3VlEncoder:
    """Fresh tower and projector from a full `Lfm3VlConfig` or a vision config written by
    `Lfm3VlAdapter.tower_only_config`."""
    from transformers.models.lfm3_vl.modeling_lfm3_vl import Lfm3VlMultiModalProjector, Lfm3VlVisionModel

    if is_full_config(config):  # refused unless it is LFM3-VL's
        config = Lfm3VlAdapter.tower_only_config(config)
    full = Lfm3VlAdapter.projector_config(config)
    tower, projector = tower_and_projector(Lfm3VlVisionModel, Lfm3VlMultiModalProjector, full, dtype)
    return Lfm3VlEncoder(tower, projector)


def attention_mixer(
    attention: torch.nn.Module,
    hidden: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """`Lfm3VlVisionAttention` over packed frames: hidden [rows, d] -> [rows, d]."""
    rows = hidden.shape[0]
    shape = (rows, -1, attention.head_dim)
    queries = attention.q_norm(attention.q_proj(hidden).view(shape))
    keys = attention.k_norm(attention.k_proj(hidden).view(shape))
    values = attention.v_proj(hidden).view(shape)
    # looked up when called: vitpool's fused rotary replaces the modeling module's function
    rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb_vision
    queries, keys = rotary(queries, keys, *position_embeddings)
    groups = queries.shape[1] // keys.shape[1]
    if groups > 1:  # key head i serves query heads i*groups ... (Hugging Face's repeat_kv)
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    queries, keys, values = (t.transpose(0, 1).unsqueeze(0) for t in (queries, keys, values))
    output, _ = packed_attention(
        attention,
        queries,
        keys,
        values,
        None,
        scaling=attention.scaling,
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=rows,  # static: Python ints from the buffer's shape
        max_length_k=rows,
    )
    return attention.out_proj(output.reshape(rows, -1))


def conv_mixer(conv: torch.nn.Module, hidden: torch.Tensor, conv_index: torch.Tensor) -> torch.Tensor:
    """`Lfm3VlVisionShortConv` as a gather: hidden [rows, d], conv_index [rows, k²] (each row's
    neighbours, `rows` for none) -> [rows, d]."""
    input_gate, output_gate, conv_input = conv.in_proj(hidden).chunk(3, dim=-1)
    gated = input_gate * conv_input
    padded = torch.cat([gated, gated.new_zeros(1, gated.shape[1])])  # row `rows`: the zero padding
    weight = conv.spatial_conv.weight.view(gated.shape[1], -1)  # [d, k²], taps row-major
    mixed = (padded[conv_index] * weight.t()).sum(dim=1)  # [rows, k², d] -> [rows, d]
    if conv.spatial_conv.bias is not None:
        mixed = mixed + conv.spatial_conv.bias
    return conv.out_proj(output_gate * mixed)


class Lfm3VlAdapter(SpatialMergeAdapter):
    """Adapter for `Lfm3VlEncoder` (Lfm3VlVisionModel + Lfm3VlMultiModalProjector): patch rows and
    grids in, the projector's tokens out."""

    # What a tower-only save's vision config carries besides Hugging Face's fields, for the projector.
    PROJECTOR_FIELDS = (
        dataclasses.replace(TEXT_HIDDEN_SIZE, cast=int),
        ConfigField("projector_hidden_size", "projector_hidden_size", int),
        ConfigField("projector_hidden_act", "projector_hidden_act", str),
        ConfigField("projector_bias", "projector_bias", bool),
    )
    PROJECTOR_SUBJECT = "LFM3-VL's projector"
    PROJECTOR_ADVICE = (
        "besides the tower's fields: give the full model's config (Lfm3VlConfig) or a tower-only save "
        "written with tower_only_config"
    )
    FULL_MODEL_TYPES = ("lfm3_vl",)
    # A full checkpoint's keys (the record's prefixes) -> the encoder's (which map to themselves).
    CHECKPOINT_RENAMES = renames(
        (r"^model\.vision_tower\.", "vision_tower."),
        (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
    )

    def __init__(self, tower: Lfm3VlEncoder) -> None:
        check_tower_parts(FAMILY, tower, TOWER_PARTS)
        vision, projector = tower.vision_tower, tower.multi_modal_projector
        for number, layer in enumerate(vision.layers):
            mixer = ("self_attn", ATTENTION_PARTS) if layer.is_attention_layer else ("conv", CONV_PARTS)
            parts = (*LAYER_PARTS, *(f"{mixer[0]}.{name}" for name in mixer[1]))
            check_tower_parts(FAMILY, vision, [f"layers.{number}.{name}" for name in parts])
        config = vision.config
        self.kernel_size = int(config.conv_kernel_size)
        rules = SpatialMergeRules(
            row_width_of(config), int(config.spatial_merge_size), ((int(projector.linear_2.out_features),),)
        )
        super().__init__(tower, rules)
        self._per_grid = lru_cache(maxsize=1024)(self._grid_tensors)

    @classmethod
    def convert_checkpoint(
        cls, state: dict[str, torch.Tensor], config: Any = None
    ) -> dict[str, torch.Tensor]:
        """The prefixes' renames, then the release's names inside the tower's keys."""
        return {
            renamed_key(key, RELEASE_RENAMES): tensor
            for key, tensor in super().convert_checkpoint(state, config).items()
        }

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "position_ids": TensorSpec((num_rows, 2), torch.long),
            # real sequences (one per frame), one trailing padding sequence, and the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
            "conv_index": TensorSpec((num_rows, self.kernel_size**2), torch.long),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        grids = grids_of(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        conv_index = metadata["conv_index"]
        conv_index.fill_(num_rows)  # padding rows: every neighbour is the zero row
        row = 0
        for grid in grids:
            position_ids, neighbours = self._per_grid(grid)
            end = row + position_ids.shape[0]
            metadata["position_ids"][row:end] = position_ids
            conv_index[row:end] = torch.where(neighbours >= 0, neighbours + row, num_rows)
            row = end
        metadata["cu_seqlens"] = frame_cu_seqlens(grids, num_rows, budget.max_sequences)
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [rows, C*T*P*P], rows in merge-block order, frame after frame
        vision, projector = self.tower.vision_tower, self.tower.multi_modal_projector
        hidden = vision.embedding_norm(vision.patch_embed(pixels))  # [rows, d]
        position_embeddings = vision.rotary_pos_emb(hidden, metadata["position_ids"])
        cu_seqlens, conv_index = metadata["cu_seqlens"], metadata["conv_index"]
        for layer in vision.layers:
            normed = layer.operator_norm(hidden)
            if layer.is_attention_layer:
                mixed = attention_mixer(layer.self_attn, normed, position_embeddings, cu_seqlens)
            else:
                mixed = conv_mixer(layer.conv, normed, conv_index)
            hidden = hidden + mixed
            hidden = hidden + layer.feed_forward(layer.ffn_norm(hidden))
        # a merge block's rows are consecutive: [rows, d] -> [rows / merge², merge² * d]
        merged = projector.layer_norm(hidden).reshape(-1, projector.merged_hidden_size)
        return [projector.linear_2(projector.act(projector.linear_1(merged)))]

    def _grid_tensors(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
        """One item's rotary positions [t*h*w, 2] and each row's k x k neighbours [t*h*w, k²] in
        its own frame, as rows of the item (-1: outside the frame). Within a frame the rows run
        over merge blocks row-major, each block's m x m patches row-major."""
        t, h, w = grid
        m, k = self.merge_size, self.kernel_size
        position_ids = get_vision_position_ids(torch.tensor([grid], dtype=torch.long), m)
        row = torch.arange(h * w)
        block, inner = row // (m * m), row % (m * m)
        y = (block // (w // m)) * m + inner // m
        x = (block % (w // m)) * m + inner % m
        row_at = torch.empty(h, w, dtype=torch.long)
        row_at[y, x] = row
        taps = []
        for dy in range(
            k
        ):  # Conv2d's cross-correlation, padding k // 2: tap (dy, dx) reads (y + dy - p, x + dx - p)
            for dx in range(k):
                ny, nx = y + dy - k // 2, x + dx - k // 2
                inside = (ny >= 0) & (ny < h) & (nx >= 0) & (nx < w)
                taps.append(torch.where(inside, row_at[ny.clamp(0, h - 1), nx.clamp(0, w - 1)], -1))
        frame = torch.stack(taps, dim=1)  # [h*w, k²]
        offsets = (torch.arange(t) * h * w).view(t, 1, 1)
        neighbours = torch.where(frame >= 0, frame + offsets, -1).reshape(t * h * w, k * k)
        return position_ids.long(), neighbours


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = Lfm3VlAdapter.tower_only_config
convert_checkpoint = Lfm3VlAdapter.convert_checkpoint
