"""Qwen3-Omni's vision encoder: Qwen3-VL's adapter, unchanged.

`Qwen3OmniMoeVisionEncoder` (transformers 5.24) is `Qwen3VLMoeVisionModel` with its mergers built
as Qwen2.5-VL's (`ln_q`, `mlp.0` / `mlp.2`) and the deepstack mergers named `merger_list`
(`deepstack_merger_list` is a property over it). Its forward is Qwen3-VL's line for line: the same
precomputed-metadata keywords (`interp_indices`, `interp_weights`, `position_ids`, `cu_seqlens`,
an integer `max_seqlen`), the same attributes the adapter reads (`num_grid_per_side`,
`interpolation_mode`, `interpolation_align_corners`), and the same output: `pooler_output` and one
`deepstack_features` map per `deepstack_visual_indexes` entry, all [tokens, out_hidden_size]. The
thinker's `get_image_features` / `get_video_features` call it as Qwen3-VL's model does (pixels
and grid rows, split per item), so an item's outputs are what the thinker hands its LLM.
"""

from __future__ import annotations

from typing import Any

from vitpool.families.qwen3_vl.adapter import Qwen3VLAdapter


class Qwen3OmniMoeAdapter(Qwen3VLAdapter):
    """Adapter for `Qwen3OmniMoeVisionEncoder`: the tokens, then the deepstack features."""

    @classmethod
    def tower_only_config(cls, full_config: Any) -> Any:
        """The tower's config: a full model's nests it in `thinker_config`, a saved thinker's does
        not."""
        return getattr(full_config, "thinker_config", full_config).vision_config
