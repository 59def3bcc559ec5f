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

import random
from collections.abc import Sequence
from functools import lru_cache

import torch
from transformers.vision_utils import get_vision_position_ids

from vitpool.models.attention import install_packed_attention
from vitpool.models.item_rules import SpatialMergeRules
from vitpool.models.protocol import TensorSpec
from vitpool.models.spatial_merge import Grid, frame_cu_seqlens, grids_of, sample_grid_specs
from vitpool.packing import Budget
from vitpool.specs import ItemSpec


class Qwen2VLAdapter:
    """Adapter for `Qwen2VisionTransformerPretrainedModel` (vision model_type "qwen2_vl_vision")."""

    def __init__(self, tower: torch.nn.Module) -> None:
        config = tower.config
        self.tower = tower
        self.merge_size: int = config.spatial_merge_size
        self.merge_unit = self.merge_size**2  # patch rows per output token
        self.row_width = config.in_channels * config.temporal_patch_size * config.patch_size**2  # C*T*P*P
        # one output: the merger's tokens, in the LLM's width
        self.item_rules = SpatialMergeRules(self.row_width, self.merge_size, ((config.hidden_size,),))
        self.row_shape = self.item_rules.row_shape
        self.output_row_shapes = self.item_rules.output_row_shapes
        self._position_ids = lru_cache(maxsize=1024)(self._compute_position_ids)
        install_packed_attention(tower)

    def max_rows(self, num_tokens: int) -> int:
        return num_tokens * self.merge_unit

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "position_ids": TensorSpec((num_rows, 2), torch.long),
            # real sequences, one trailing padding sequence, and the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
        }

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> dict[str, torch.Tensor]:
        grids = grids_of(specs, num_rows, budget)
        metadata = {
            name: torch.zeros(spec.shape, dtype=spec.dtype)
            for name, spec in self.metadata_specs(num_rows, budget).items()
        }
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

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        return sample_grid_specs(self.item_rules, num_rows, budget, rng)

    def _compute_position_ids(self, grid: Grid) -> torch.Tensor:
        return get_vision_position_ids(torch.tensor([grid], dtype=torch.long), self.merge_size)

