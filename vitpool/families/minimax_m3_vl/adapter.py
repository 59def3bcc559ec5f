"""MiniMax-M3-VL (`MiniMaxM3VLVisionModel`) and its `MiniMaxM3VLMultiModalProjector`.

The tower takes Qwen-style flattened patches [rows, C*T*P*P] with a (t, h, w) grid per item: a
Conv3d patch embedding, a LayerNorm before the blocks (no position table), a partial 3D rotary
embedding over (t, h, w) positions in the processor's 2x2 block-major order, and attention over a
whole item at once (a video chunk's frames attend to each other). It has no merger: the projector
(outside the tower class in Hugging Face) runs a GELU MLP on every row, joins each four
consecutive rows (one 2x2 block) into one and runs a second GELU MLP into the LLM's width.
`MiniMaxM3VLEncoder` holds both, so the adapter hands out exactly what
`MiniMaxM3VLModel.get_image_features` gives the LLM (its `pooler_output`, split per item).

For static capture every grid-dependent tensor is precomputed on the host and passed as the
keywords Hugging Face's helpers pop: `position_ids` [rows, 3] (`get_vision_position_ids` with
`include_temporal=True`), `cu_seqlens` of one sequence per item (`item_cu_seqlens`, as
`merge_temporal=True` gives them), and `max_seqlen`, the buffer's row count as a Python int, with
`grid_thw=None`. The projector runs as it is: per-row layers, then a reshape by the buffer's
static row count; every item fills whole blocks of four rows from row 0, so padding rows form
blocks of their own. Padding rows take rotary position (0, 0, 0) and one trailing attention
sequence, so they never reach a real row.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from transformers.vision_utils import get_vision_position_ids

from vitpool.errors import ConfigError
from vitpool.families.minimax_m3_vl.rules import MiniMaxM3VLRules
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, ConfigField, renames
from vitpool.models.compat import installed_transformers
from vitpool.models.projected import TowerWithProjector, tower_and_projector
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import Grid, SpatialMergeAdapter, item_cu_seqlens, item_grids
from vitpool.packing import Budget
from vitpool.specs import ItemSpec


class MiniMaxM3VLEncoder(TowerWithProjector):
    """The tower and its projector; state keys `vision_tower.*` and `multi_modal_projector.*` (a
    full checkpoint has them under `model.`, or in the release layout, `CHECKPOINT_RENAMES`)."""


def attends_per_item() -> bool:
    """Whether the installed transformers' tower attends one sequence per item (its attention takes
    `cu_seqlens`), as the model vitpool matches does; 5.17's and 5.18's attend all of a call's rows
    as one sequence, so their model's tokens for an item depend on the call's other items."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLVisionAttention

    return "cu_seqlens" in inspect.signature(MiniMaxM3VLVisionAttention.forward).parameters


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> MiniMaxM3VLEncoder:
    """Fresh tower and projector from a full MiniMaxM3VLConfig or a vision config with the
    adapter's PROJECTOR_FIELDS (`MiniMaxM3VLAdapter.tower_only_config`).

    Raises:
        ConfigError: the installed transformers' tower attends a call's items as one sequence.
    """
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLMultiModalProjector,
        MiniMaxM3VLVisionModel,
    )

    if not attends_per_item():
        raise ConfigError(
            f"MiniMax-M3-VL needs a transformers whose vision attention takes one sequence per item "
            f"(5.24 does); transformers {installed_transformers()} attends all of a call's rows as one "
            "sequence: pip install 'transformers==5.24.0'"
        )

    # The projector reads vision_config.{hidden_size, spatial_merge_size}, text_config.hidden_size,
    # projector_hidden_size and merged_hidden_size.
    full = MiniMaxM3VLAdapter.projector_config(config)
    tower, projector = tower_and_projector(
        MiniMaxM3VLVisionModel, MiniMaxM3VLMultiModalProjector, full, dtype
    )
    return MiniMaxM3VLEncoder(tower, projector)


class MiniMaxM3VLAdapter(SpatialMergeAdapter):
    """Adapter for `MiniMaxM3VLEncoder` (MiniMaxM3VLVisionModel + MiniMaxM3VLMultiModalProjector)."""

    # What a tower-only save's vision config carries besides Hugging Face's fields, for the projector.
    PROJECTOR_FIELDS = (
        ConfigField(TEXT_HIDDEN_SIZE.name, TEXT_HIDDEN_SIZE.source, int),
        ConfigField("projector_hidden_size", "projector_hidden_size", int),
        ConfigField("merged_hidden_size", "merged_hidden_size", int),
    )
    PROJECTOR_SUBJECT = "MiniMax-M3-VL's multi_modal_projector"
    PROJECTOR_ADVICE = (
        "to build it: give the full model's config (MiniMaxM3VLConfig) or a vision config "
        "(minimax_m3_vl_vision) with them, as tower_only_config writes it"
    )
    # transformers' in-memory layout (`model.`), and the release layout that `save_pretrained` writes
    # back (conversion_mapping.py, "minimax_m3_vl") -> the encoder's keys (which map to themselves).
    CHECKPOINT_RENAMES = renames(
        (r"^model\.(vision_tower|multi_modal_projector)\.", r"\1."),
        (r"^vision_tower\.vision_model\.embeddings\.patch_embedding\.", "vision_tower.embeddings.proj."),
        (r"^vision_tower\.vision_model\.encoder\.layers\.", "vision_tower.layers."),
        (r"^vision_tower\.vision_model\.pre_layrnorm\.", "vision_tower.pre_layrnorm."),
        (r"^patch_merge_mlp\.linear_(\d+)\.", r"multi_modal_projector.merge_linear_\1."),
    )

    def __init__(self, tower: MiniMaxM3VLEncoder) -> None:
        config = tower.vision_tower.config
        merge_size = int(config.spatial_merge_size)
        row_width = int(config.num_channels * config.temporal_patch_size * config.patch_size**2)
        output_width = int(tower.multi_modal_projector.merge_linear_2.out_features)
        # install_packed_attention walks the projector too: its erf-GELU MLPs are not fused, nothing else
        # there matches; the attention setting lands on the tower's config (the encoder's `config`).
        super().__init__(tower, MiniMaxM3VLRules(row_width, merge_size, ((output_width,),)))
        self._position_ids = lru_cache(maxsize=1024)(self._compute_position_ids)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "position_ids": TensorSpec((num_rows, 3), torch.long),  # (t, h, w) per row
            # one sequence per item, the padding's, and the leading 0
            "cu_seqlens": TensorSpec((budget.max_items + 2,), torch.int32),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        grids = item_grids(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        row = 0
        for grid in grids:
            position_ids = self._position_ids(grid)
            end = row + position_ids.shape[0]
            metadata["position_ids"][row:end] = position_ids
            row = end
        metadata["cu_seqlens"] = item_cu_seqlens(grids, num_rows, budget.max_items)
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        output = self.tower.vision_tower(
            pixels,
            grid_thw=None,  # every grid-derived tensor is given below
            position_ids=metadata["position_ids"],
            cu_seqlens=metadata["cu_seqlens"],
            max_seqlen=pixels.shape[0],  # static: a Python int from the buffer's shape
        )
        hidden = output.last_hidden_state.squeeze(0)  # [rows, d], as get_image_features takes it
        return [self.tower.multi_modal_projector(hidden)]

    def _compute_position_ids(self, grid: Grid) -> torch.Tensor:
        grid_thw = torch.tensor([grid], dtype=torch.long)
        return get_vision_position_ids(grid_thw, self.merge_size, include_temporal=True)


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = MiniMaxM3VLAdapter.tower_only_config
convert_checkpoint = MiniMaxM3VLAdapter.convert_checkpoint
