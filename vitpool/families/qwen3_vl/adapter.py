"""Qwen3-VL (and Qwen3-VL-MoE, same tower): the Hugging Face tower driven with precomputed metadata.

The tower's forward accepts every grid-dependent tensor through keyword arguments
(`transformers.vision_utils`); given them it has no host synchronisation and no graph break.
Pixels are flattened patches [rows, C*T*P*P]; an item's layout is its grid (t, h, w); one
attention sequence per temporal patch; a 2x2 merge makes four rows one output token.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from transformers.vision_utils import (
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import Grid, SpatialMergeAdapter, frame_cu_seqlens, grids_of, row_width_of
from vitpool.packing import Budget
from vitpool.rules.grids import SpatialMergeRules
from vitpool.specs import ItemSpec


class Qwen3VLAdapter(SpatialMergeAdapter):
    """Adapter for `Qwen3VLVisionModel` / `Qwen3VLMoeVisionModel`, and (with no deepstack indexes)
    Qwen3.5's tower."""

    def __init__(self, tower: torch.nn.Module) -> None:
        config = tower.config
        # tokens, then one deepstack feature map per index, all [tokens, out_hidden_size]
        num_outputs = 1 + len(getattr(config, "deepstack_visual_indexes", None) or ())
        rules = SpatialMergeRules(
            row_width_of(config), config.spatial_merge_size, ((config.out_hidden_size,),) * num_outputs
        )
        super().__init__(tower, rules)
        self._num_grid_per_side: int = tower.num_grid_per_side
        self._interpolation_mode: str = tower.interpolation_mode
        self._align_corners: bool = tower.interpolation_align_corners
        self._per_grid_metadata = lru_cache(maxsize=1024)(self._compute_grid_metadata)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "interp_indices": TensorSpec((num_rows, 4), torch.long),
            "interp_weights": TensorSpec((num_rows, 4), torch.float32),
            "position_ids": TensorSpec((num_rows, 2), torch.long),
            # real sequences, one trailing padding sequence, and the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        grids = grids_of(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        # Padding rows read position-table row 0 with weight 0 and rotary position (0, 0).
        # Unused cu_seqlens entries repeat the end, so the padding rows form one sequence.
        row = 0
        for grid in grids:
            indices, weights, position_ids = self._per_grid_metadata(grid)
            end = row + indices.shape[0]
            metadata["interp_indices"][row:end] = indices
            metadata["interp_weights"][row:end] = weights
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
        return [output.pooler_output, *output.deepstack_features]

    def _compute_grid_metadata(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grid_thw = torch.tensor([grid], dtype=torch.long)
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=self._num_grid_per_side,
            mode=self._interpolation_mode,
            align_corners=self._align_corners,
            spatial_merge_size=self.merge_size,
        )
        position_ids = get_vision_position_ids(grid_thw, self.merge_size)
        return indices, weights.to(torch.float32), position_ids
