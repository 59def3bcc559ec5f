"""Qwen2.5-Omni's vision encoder: Qwen2.5-VL's adapter, unchanged.

`Qwen2_5OmniVisionEncoder` (transformers 5.24) is `Qwen2_5_VisionTransformerPretrainedModel`
with one difference inside its blocks: attention projects q, k and v with three Linears (`attn.q`,
`attn.k`, `attn.v`) where Qwen2.5-VL fuses them (`attn.qkv`). The adapter reads nothing inside the
blocks. The rest is Qwen2.5-VL's line for line: the 3-D conv patch embedding, axial 2-D rotary
positions, window attention in every block but `fullatt_block_indexes`, the RMSNorm + MLP merger
of 2x2 patches into `out_hidden_size`, the same config fields the adapter reads (`patch_size`,
`window_size`, `spatial_merge_size`, `out_hidden_size`, `in_channels`, `temporal_patch_size`),
and a forward that takes the same precomputed keywords (`position_ids`, `cu_seqlens`,
`window_index`, `cu_window_seqlens`, integer `max_seqlen` / `max_window_seqlen`) through
`transformers.vision_utils` and returns the merged tokens, in item order, as `pooler_output`. The
thinker's `get_image_features` / `get_video_features` call it on the pixels and grid rows and
split the tokens per item, so an item's tokens are what the thinker hands its LLM.
"""

from __future__ import annotations

from typing import Any

from vitpool.families.qwen2_5_vl.adapter import Qwen2_5_VLAdapter


class Qwen2_5OmniAdapter(Qwen2_5_VLAdapter):
    """Adapter for `Qwen2_5OmniVisionEncoder`: the merged tokens."""

    @classmethod
    def tower_only_config(cls, full_config: Any) -> Any:
        """The tower's config: a full model's nests it in `thinker_config`, a saved thinker's does
        not."""
        return getattr(full_config, "thinker_config", full_config).vision_config
