"""GLM-4.1V, GLM-4.5V and GLM-4.6V: the Hugging Face `Glm4vVisionModel` (and the identical
`Glm4vMoeVisionModel`) driven with precomputed metadata.

Items are what `Glm4vImageProcessor` / `Glm4vVideoProcessor` emit for one image or video:
`pixel_values` [t*h*w, C*T*P*P] with `image_grid_thw` (1, h, w), or `pixel_values_videos` with
`video_grid_thw` (t, h, w). The rules are Qwen's (`SpatialMergeRules`): one attention sequence per
temporal patch, a 2x2 merge (here a strided conv, `downsample`) makes four rows one output token.

The tower's forward takes `position_ids`, `cu_seqlens` and `max_seqlen` precomputed
(`transformers.vision_utils`); what is left of `grid_thw` is its use by the learned position
embeddings, which resample the position table to each sequence's (h, w) with `grid_sample`: they
index `grid_thw` by sequence (`image_shapes[seq_ids]`, seq_ids from `cu_seqlens`). So
`grid_thw` is given as a static per-sequence table, (1, h, w) for each frame of each item (as
`get_video_features` flattens a video), (1, 1, 1) for the trailing padding sequence and unused
entries. Given these, the forward has no host synchronisation and only static shapes.
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


class Glm4vAdapter(SpatialMergeAdapter):
    """Adapter for `Glm4vVisionModel` / `Glm4vMoeVisionModel` (GLM-4.1V, GLM-4.5V, GLM-4.6V)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        config = tower.config
        # the merger's output goes to the LLM as is: [tokens, out_hidden_size]
        rules = SpatialMergeRules(
            row_width_of(config), config.spatial_merge_size, ((config.out_hidden_size,),)
        )
        super().__init__(tower, rules)
        self._position_ids = lru_cache(maxsize=1024)(self._compute_position_ids)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        sequences = budget.max_sequences
        return {
            "position_ids": TensorSpec((num_rows, 2), torch.long),
            # real sequences, one trailing padding sequence, and the leading 0
            "cu_seqlens": TensorSpec((sequences + 2,), torch.int32),
            # (1, h, w) per attention sequence, padding sequence included: the position embeddings'
            # resampling target, indexed by sequence
            "sequence_grids": TensorSpec((sequences + 1, 3), torch.long),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        grids = grids_of(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        # Padding rows get rotary position (0, 0) and resample the table for a 1x1 grid; unused
        # cu_seqlens entries repeat the end, so the padding rows form one trailing sequence.
        metadata["sequence_grids"].fill_(1)
        row = 0
        sequence = 0
        for grid in grids:
            position_ids = self._position_ids(grid)
            end = row + position_ids.shape[0]
            metadata["position_ids"][row:end] = position_ids
            t, h, w = grid
            metadata["sequence_grids"][sequence : sequence + t, 1] = h
            metadata["sequence_grids"][sequence : sequence + t, 2] = w
            sequence += t
            row = end
        metadata["cu_seqlens"] = frame_cu_seqlens(grids, num_rows, budget.max_sequences)
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        output = self.tower(
            pixels,
            grid_thw=metadata["sequence_grids"],  # only the position embeddings read it, per sequence
            position_ids=metadata["position_ids"],
            cu_seqlens=metadata["cu_seqlens"],
            max_seqlen=pixels.shape[0],  # static: a Python int from the buffer's shape
        )
        return [output.pooler_output]

    def _compute_position_ids(self, grid: Grid) -> torch.Tensor:
        return get_vision_position_ids(torch.tensor([grid], dtype=torch.long), self.merge_size)
