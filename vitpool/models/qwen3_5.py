"""Qwen3.5 (dense and MoE, same tower): Qwen3-VL's tower without deepstack.

`Qwen3_5VisionModel` / `Qwen3_5MoeVisionModel` are Qwen3-VL's tower with the deepstack mergers
removed: the same patch embedding (flattened patches [rows, C*T*P*P]), the same learned position
table resampled bilinearly to each grid, the same 2D rotary positions, one attention sequence per
temporal patch, the same 2x2 merger into `out_hidden_size` (the LLM's width), and the same
precomputed-metadata keywords (`transformers.vision_utils`). So this adapter is Qwen3-VL's, with
one output per item: the merger's tokens, which is what `get_image_features` /
`get_video_features` hand the LLM. Items and rules are Qwen3-VL's (`SpatialMergeRules`).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from vitpool.models.attention import install_packed_attention
from vitpool.models.item_rules import SpatialMergeRules
from vitpool.models.qwen3_vl import Qwen3VLAdapter


class Qwen3_5Adapter(Qwen3VLAdapter):  # noqa: N801  (the Hugging Face family name)
    """Adapter for `Qwen3_5VisionModel` / `Qwen3_5MoeVisionModel`: one output, the tokens."""

    def __init__(self, tower: torch.nn.Module) -> None:
        # Qwen3VLAdapter.__init__ reads `deepstack_visual_indexes`, which Qwen3.5's config lacks;
        # everything else (metadata, sampling, max_rows) is inherited unchanged.
        config = tower.config
        self.tower = tower
        self.merge_size: int = config.spatial_merge_size
        self.merge_unit = self.merge_size**2  # patch rows per output token
        self.row_width = config.in_channels * config.temporal_patch_size * config.patch_size**2  # C*T*P*P
        self.item_rules = SpatialMergeRules(self.row_width, self.merge_size, ((config.out_hidden_size,),))
        self.row_shape = self.item_rules.row_shape
        self.output_row_shapes = self.item_rules.output_row_shapes
        self._num_grid_per_side: int = tower.num_grid_per_side
        self._interpolation_mode: str = tower.interpolation_mode
        self._align_corners: bool = tower.interpolation_align_corners
        self._per_grid_metadata = lru_cache(maxsize=1024)(self._compute_grid_metadata)
        install_packed_attention(tower)

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        output = self.tower(
            pixels,
            grid_thw=None,  # every grid-derived tensor is given in `metadata`
            max_seqlen=pixels.shape[0],  # static: a Python int from the buffer's shape
            **metadata,
        )
        return [output.pooler_output]
