"""Cosmos-3 Edge: the Hugging Face tower (`Cosmos3EdgeVisionModel`, a packed SigLIP2) and the
model's `projector` (`Cosmos3EdgePatchMerger`), run together in one graph.

`Cosmos3EdgeModel.get_image_features` (and `get_video_features`, the same call) takes the GLM-4V
processors' patch rows [t*h*w, P*P*C] (HWC within a patch, temporal patch 1) with a (t, h, w) grid
per item, the rows of each 2x2 merge block contiguous. The tower embeds each row with a Linear,
adds its position embedding (the learned G x G table resized to the frame's h x w, bilinear with
antialiasing, re-ordered block-major and repeated for every frame), runs SigLIP2 layers with one
attention sequence per frame and a final LayerNorm. The projector LayerNorms each row, joins each
block's four rows into one and runs a GELU MLP into the LLM's width: h*w/4 tokens per frame.

What runs in the graph: the patch Linear, the position embedding as `resize @ table` (resize
[rows, G²], the outer product of each row's weights over the table's rows and over its columns),
the layers through vitpool's packed attention (`cu_seqlens` and a static `max_seqlen`, the
buffer's rows), the LayerNorm and the projector as Hugging Face's own module. What runs on the
host, per batch: each row's resize weights [rows, 2, G] (float32, `F.interpolate`'s antialiased
bilinear weights along each axis, cached per grid) and `cu_seqlens` (one sequence per frame, the
padding rows a trailing one). Hugging Face computes the resize per grid with `grid_thw.tolist()`
and, on a CPU, splits attention by `cu_seqlens.tolist()`: host reads a graph cannot hold.

Padding rows get zero position weights and their own trailing sequence; the projector turns them
into padding tokens that are dropped (a budget's rows are whole merge blocks).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from vitpool.errors import ConfigError
from vitpool.families.lfm2_vl.adapter import axis_weights
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, ConfigField, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import Grid, SpatialMergeAdapter, frame_cu_seqlens, grids_of
from vitpool.packing import Budget
from vitpool.rules.grids import SpatialMergeRules
from vitpool.specs import ItemSpec

FAMILY = "Cosmos-3 Edge"
# What `Cosmos3EdgeAdapter.forward` uses of transformers' modules by name.
ENCODER_PARTS = (
    "visual.embeddings.patch_embedding",
    "visual.embeddings.position_embedding",
    "visual.embeddings.position_embedding_size",
    "visual.encoder.layers",
    "visual.post_layernorm",
    "projector.spatial_merge_size",
    "projector.linear_fc2",
)
Tensors = dict[str, torch.Tensor]
# transformers' conversion mapping for cosmos3_edge (`conversion_mapping.py`) renames Diffusers-style
# names back to its modules' on load, its patterns unanchored so they reach the tower's keys too;
# `save_pretrained` writes them reversed. The release's and such a save's vision keys -> the modules'.
_PART_RENAMES = (
    (re.compile(r"\.self_attn\.to_([qkv])\."), r".self_attn.\1_proj."),
    (re.compile(r"\.mlp\.up_proj\."), ".mlp.fc1."),
    (re.compile(r"\.mlp\.down_proj\."), ".mlp.fc2."),
)


class Cosmos3EdgeEncoder(torch.nn.Module):
    """The tower and its projector; state keys `visual.*` and `projector.*` (as transformers names
    them under `model.`)."""

    def __init__(self, visual: torch.nn.Module, projector: torch.nn.Module) -> None:
        super().__init__()
        self.visual = visual
        self.projector = projector
        self.config = visual.config


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Cosmos3EdgeEncoder:
    """Fresh tower and projector from a full `Cosmos3EdgeConfig` or a vision config with the
    adapter's PROJECTOR_FIELDS (`tower_only_config`)."""
    from transformers.models.cosmos3_edge.modeling_cosmos3_edge import (
        Cosmos3EdgePatchMerger,
        Cosmos3EdgeVisionModel,
    )

    visual, projector = tower_and_projector(
        Cosmos3EdgeVisionModel, Cosmos3EdgePatchMerger, Cosmos3EdgeAdapter.projector_config(config), dtype
    )
    return Cosmos3EdgeEncoder(visual, projector)


class Cosmos3EdgeAdapter(SpatialMergeAdapter):
    """Adapter for `Cosmos3EdgeEncoder` (vision model_type "cosmos3_edge_vision").

    Raises:
        ConfigError: a position table that is not square, a projector of another merge size than
            the tower's, or the installed transformers' modules lack a part the adapter runs.
    """

    # What a tower-only save's vision config carries besides the tower's fields, for the projector.
    PROJECTOR_FIELDS = (TEXT_HIDDEN_SIZE, ConfigField("projector_hidden_size", "projector_hidden_size"))
    PROJECTOR_SUBJECT = "a Cosmos-3 Edge vision config"
    PROJECTOR_ADVICE = (
        "to build its projector; give the full model's config (Cosmos3EdgeConfig) or a tower-only save "
        "written with tower_only_config"
    )
    FULL_MODEL_TYPES = ("cosmos3_edge",)
    CHECKPOINT_RENAMES = renames(
        (r"^(?:model\.)?visual\.", "visual."),
        (r"^(?:model\.)?projector\.", "projector."),
    )

    @classmethod
    def convert_checkpoint(cls, state: dict[str, torch.Tensor], config: Any = None) -> Tensors:
        """The loader's hook (`CheckpointLayout.convert`): the prefixes' renames, then the layers'
        parts under the names transformers loads them as (`_PART_RENAMES`); `config` is not needed."""
        converted = {}
        for key, tensor in super().convert_checkpoint(state, config).items():
            for pattern, target in _PART_RENAMES:
                key = pattern.sub(target, key)
            converted[key] = tensor
        return converted

    def __init__(self, tower: Cosmos3EdgeEncoder) -> None:
        check_tower_parts(FAMILY, tower, ENCODER_PARTS)
        config = tower.visual.config
        embeddings = tower.visual.embeddings
        self.grid_size = int(embeddings.position_embedding_size)
        if self.grid_size**2 != embeddings.position_embedding.num_embeddings:
            raise ConfigError(
                f"{FAMILY}: the position table has {embeddings.position_embedding.num_embeddings} rows; "
                "the tower resizes a square one (num_patches a square number)"
            )
        merge_size = int(config.spatial_merge_size)
        if int(tower.projector.spatial_merge_size) != merge_size:
            projector_merge = tower.projector.spatial_merge_size
            raise ConfigError(
                f"{FAMILY}: the projector merges {projector_merge}x{projector_merge} blocks; the tower's "
                f"rows come in {merge_size}x{merge_size} blocks"
            )
        rules = SpatialMergeRules(
            # one frame per row: the processors' temporal patch is 1 (P*P*C features)
            row_width=int(config.num_channels) * int(config.patch_size) ** 2,
            merge_size=merge_size,
            output_row_shapes=((tower.projector.linear_fc2.out_features,),),
        )
        super().__init__(tower, rules)
        self._position_weights = lru_cache(maxsize=1024)(self._compute_position_weights)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            # each row's resize weights over the table's rows and over its columns
            "position_weights": TensorSpec((num_rows, 2, self.grid_size), torch.float32),
            # real sequences (one per frame), one trailing padding sequence, and the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
        }

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> Tensors:
        grids = grids_of(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        row = 0
        for grid in grids:
            weights = self._position_weights(grid)
            metadata["position_weights"][row : row + weights.shape[0]] = weights
            row += weights.shape[0]
        metadata["cu_seqlens"] = frame_cu_seqlens(grids, num_rows, budget.max_sequences)
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [rows, P*P*C], one patch per row, merge blocks contiguous
        visual = self.tower.visual
        embeddings = visual.embeddings
        patches = embeddings.patch_embedding(pixels.to(embeddings.patch_embedding.weight.dtype))  # [rows, d]
        weights = metadata["position_weights"]
        table = embeddings.position_embedding.weight  # [G², d], row-major over the G x G grid
        resize = (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)  # [rows, G²]
        hidden = patches + (resize @ table.float()).to(table.dtype)
        num_rows = pixels.shape[0]
        for layer in visual.encoder.layers:
            # max_seqlen static: a Python int from the buffer's shape
            hidden = layer(hidden, cu_seqlens=metadata["cu_seqlens"], max_seqlen=num_rows)
        return [self.tower.projector(visual.post_layernorm(hidden))]  # [rows/4, LLM width]

    def _compute_position_weights(self, grid: Grid) -> torch.Tensor:
        """An item's position weights [t*h*w, 2, G], rows in the processor's order: frame by frame,
        merge blocks row-major, the block's patches row-major (what Hugging Face's
        `resize_positional_embeddings` re-orders its resized table to)."""
        t, h, w = grid
        m, g = self.merge_size, self.grid_size
        rows = axis_weights(h, g)[:, None, :].expand(h, w, g)
        columns = axis_weights(w, g)[None, :, :].expand(h, w, g)
        weights = torch.stack([rows, columns], dim=2)  # [h, w, 2, G]
        block_major = weights.reshape(h // m, m, w // m, m, 2, g).transpose(1, 2).reshape(h * w, 2, g)
        return block_major.repeat(t, 1, 1)


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = Cosmos3EdgeAdapter.tower_only_config
convert_checkpoint = Cosmos3EdgeAdapter.convert_checkpoint
