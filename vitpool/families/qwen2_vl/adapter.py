"""Qwen2-VL: the Hugging Face tower (`Qwen2VisionTransformerPretrainedModel`) driven with
precomputed metadata.

Like Qwen3-VL minus its learned position table and deepstack: a 3-D conv patch embedding of
14-pixel patches, 2-D rotary positions from the grid, full attention within each frame, and a
2x2 patch merger whose output is already in the LLM's width (`vision_config.hidden_size`).

The tower's forward takes the grid-derived tensors through keyword arguments (`position_ids`,
`cu_seqlens`, an integer `max_seqlen`); given them it has no host synchronisation. Pixels are
the processor's flattened patches [t*h*w, C*T*P*P] and an item's layout is its grid (t, h, w),
so the item rules are `SpatialMergeRules`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from transformers.vision_utils import get_vision_position_ids

from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import Grid, SpatialMergeAdapter, frame_cu_seqlens, grids_of, row_width_of
from vitpool.packing import Budget
from vitpool.rules.grids import SpatialMergeRules
from vitpool.specs import ItemSpec


class Qwen2VLAdapter(SpatialMergeAdapter):
    """Adapter for `Qwen2VisionTransformerPretrainedModel` (vision model_type "qwen2_vl_vision")."""

    def __init__(self, tower: torch.nn.Module) -> None:
        config = tower.config
        # one output: the merger's tokens, in the LLM's width
        rules = SpatialMergeRules(row_width_of(config), config.spatial_merge_size, ((config.hidden_size,),))
        super().__init__(tower, rules)
        self._position_ids = lru_cache(maxsize=1024)(self._compute_position_ids)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "position_ids": TensorSpec((num_rows, 2), torch.long),
            # real sequences, one trailing padding sequence, and the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        grids = grids_of(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        # Padding rows get rotary position (0, 0). Unused cu_seqlens entries repeat the end, so
        # the padding rows form one trailing sequence of their own.
        row = 0
        for grid in grids:
            position_ids = self._position_ids(grid)
            end = row + position_ids.shape[0]
            metadata["position_ids"][row:end] = position_ids
            row = end
        metadata["cu_seqlens"] = frame_cu_seqlens(grids, num_rows, budget.max_sequences)
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        output = self.tower(
            pixels,
            grid_thw=None,  # every grid-derived tensor is given below
            max_seqlen=pixels.shape[0],  # static: a Python int from the buffer's shape
            **metadata,
        )
        return [output.pooler_output]

    def _compute_position_ids(self, grid: Grid) -> torch.Tensor:
        return get_vision_position_ids(torch.tensor([grid], dtype=torch.long), self.merge_size)
