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

import torch

from vitpool.families.qwen3_vl.adapter import Qwen3VLAdapter


class Qwen3_5Adapter(Qwen3VLAdapter):  # the Hugging Face family name
    """Adapter for `Qwen3_5VisionModel` / `Qwen3_5MoeVisionModel`: one output, the tokens."""

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        output = self.tower(
            pixels,
            grid_thw=None,  # every grid-derived tensor is given in `metadata`
            max_seqlen=pixels.shape[0],  # static: a Python int from the buffer's shape
            **metadata,
        )
        return [output.pooler_output]
