"""dots.3 Note: the Hugging Face tower `Dots3NoteVisionModel`, its merger included, driven with
precomputed metadata.

The tower is Qwen2-VL's in shape: a Conv2d patch embedding of 14-pixel patches (no temporal patch:
a row is C*P*P, and a video's grid counts frames) with an RMSNorm, 2-D axial rotary positions from
the grid in 2x2 block-major order, attention within each frame (one sequence per temporal patch,
`merge_temporal=False`), and a 2x2 patch merger (LayerNorm, GELU MLP) straight into the LLM's width
(`adapter_out_dim`). Its blocks differ: RMSNorms, q/k RMSNorm per head, SwiGLU MLPs, and in the
later blocks a mixture of experts (a sigmoid router with a correction bias, top-k of up to 64
experts, no shared expert). So the metadata and the forward are Qwen2-VL's (`Qwen2VLAdapter`).

What runs in the graph: the whole tower, patch embedding to merger, over the static buffer, with
`position_ids` [rows, 2], `cu_seqlens` (one sequence per frame, then the padding's) and an integer
`max_seqlen`. Its experts run through transformers' "grouped_mm" implementation (a sort of the
token-expert pairs, a histogram and `grouped_mm` over static shapes); the eager one finds the
experts hit with `nonzero()` and loops over them on the host, which a graph cannot hold, so the
adapter sets "grouped_mm" on every experts module (each holds its own per-layer config, which
`set_experts_implementation` does not reach). Padding rows are routed too: their experts' work is
wasted, never read. On the host, once per grid (cached): the position ids and `cu_seqlens`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from functools import lru_cache

import torch

from vitpool.errors import CheckpointError
from vitpool.families.qwen2_vl.adapter import Qwen2VLAdapter
from vitpool.models.adapter_base import renames
from vitpool.models.protocol import KEEPS_DTYPE
from vitpool.models.spatial_merge import SpatialMergeAdapter
from vitpool.rules.grids import SpatialMergeRules

# The experts implementation free of host synchronisation (module docstring).
STATIC_EXPERTS = "grouped_mm"
# What `Dots3NoteVisionModel._keep_in_fp32_modules_strict` names: each router's weight and bias
FP32_ROUTER_PARTS = ("mlp.gate.weight", "mlp.e_score_correction_bias")
# A full checkpoint's prefixes: transformers' in-memory layout and the release's.
_PREFIX = re.compile(r"^(?:model\.vision_tower|vision_encoder)\.")
# The release's names -> transformers' (its conversion_mapping.py, "dots3_note_vision_encoder"),
# each applied in turn, as transformers chains them.
_RELEASE_RENAMES = renames(
    (r"^post_trunk_norm\.", "norm."),
    (r"^adapter\.", "merger."),
    (r"(blocks\.\d+)\.norm_1\.", r"\1.norm1."),
    (r"(blocks\.\d+)\.norm_2\.", r"\1.norm2."),
    (r"(blocks\.\d+\.mlp)\.fc1\.", r"\1.gate_proj."),
    (r"(blocks\.\d+\.mlp)\.fc2\.", r"\1.down_proj."),
    (r"(blocks\.\d+\.mlp)\.fc3\.", r"\1.up_proj."),
    (r"\.mlp\.gate_weight$", ".mlp.gate.weight"),
    (r"\.mlp\.router_bias$", ".mlp.e_score_correction_bias"),
)
# One expert's weight in the release: fc1 the gate, fc3 the up, fc2 the down projection.
_EXPERT = re.compile(r"^(blocks\.\d+\.mlp\.experts)\.(\d+)\.(fc[123])\.weight$")
_EXPERT_PARTS = ("fc1", "fc2", "fc3")


def use_static_experts(tower: torch.nn.Module) -> int:
    """Set `STATIC_EXPERTS` on every experts module of `tower`; returns how many there are."""
    experts = [
        module
        for module in tower.modules()
        if hasattr(module, "gate_up_proj")
        and hasattr(getattr(module, "config", None), "_experts_implementation")
    ]
    for module in experts:
        module.config._experts_implementation = STATIC_EXPERTS
    return len(experts)


def keep_routers_in_fp32(tower: torch.nn.Module) -> None:
    """The routers' weights in fp32 whatever the tower's dtype, as `from_pretrained` keeps them
    (`_keep_in_fp32_modules_strict`; `_from_config` casts them with the rest): a router rounded to
    bf16 picks other experts for tokens near a tie than the model loaded by Hugging Face does."""
    for name, parameter in tower.named_parameters():
        if any(name.endswith(suffix) for suffix in FP32_ROUTER_PARTS):
            parameter.data = parameter.data.float()
            setattr(parameter, KEEPS_DTYPE, True)  # through the encoder's cast (`place_tower`)
    for name, buffer in tower.named_buffers():
        if any(name.endswith(suffix) for suffix in FP32_ROUTER_PARTS):
            buffer.data = buffer.data.float()


def stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with the release's per-expert weights (`experts.<k>.fc1/fc2/fc3.weight`) stacked as
    transformers keeps them: `experts.gate_up_proj` [experts, 2 * inner, width] (gate then up) and
    `experts.down_proj` [experts, width, inner].

    Raises:
        CheckpointError: an expert missing, or one without all three weights, named.
    """
    kept: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    for key, tensor in state.items():
        match = _EXPERT.match(key)
        if match is None:
            kept[key] = tensor
        else:
            layers[match[1]][int(match[2])][match[3]] = tensor
    for prefix, experts in layers.items():
        for index in range(max(experts) + 1):
            lacking = [part for part in _EXPERT_PARTS if part not in experts.get(index, {})]
            if lacking:
                names = ", ".join(f"{prefix}.{index}.{part}.weight" for part in lacking)
                raise CheckpointError(f"dots.3 Note: the checkpoint lacks {names}")
        ordered = [experts[index] for index in range(len(experts))]
        kept[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([e["fc1"], e["fc3"]]) for e in ordered])
        kept[f"{prefix}.down_proj"] = torch.stack([e["fc2"] for e in ordered])
    return kept


class Dots3NoteAdapter(Qwen2VLAdapter):
    """Adapter for `Dots3NoteVisionModel` (vision model_type "dots3_note_vision_encoder"): patch rows
    of images and videos in, the merger's tokens out."""

    FULL_MODEL_TYPES = ("dots3_note",)

    def __init__(self, tower: torch.nn.Module) -> None:
        config = tower.config
        use_static_experts(tower)
        keep_routers_in_fp32(tower)
        row_width = int(config.num_channels * config.patch_size**2)
        output_width = int(config.adapter_out_dim)  # the merger's: the LLM's width
        rules = SpatialMergeRules(row_width, int(config.spatial_merge_size), ((output_width,),))
        # Qwen2-VL's own __init__ reads a temporal patch this tower does not have
        SpatialMergeAdapter.__init__(self, tower, rules)
        self._position_ids = lru_cache(maxsize=1024)(self._compute_position_ids)

    @classmethod
    def convert_checkpoint(
        cls, state: dict[str, torch.Tensor], config: object = None
    ) -> dict[str, torch.Tensor]:
        """The tower's state from transformers' keys (`model.vision_tower.`), the release's
        (`vision_encoder.`, what `save_pretrained` writes back, per-expert weights stacked) or a
        tower-only save's (either layout, no prefix). `config` is not needed."""
        renamed = {}
        for key, tensor in state.items():
            name = _PREFIX.sub("", key)
            for pattern, target in _RELEASE_RENAMES:
                name = pattern.sub(target, name)
            renamed[name] = tensor
        return stacked_experts(renamed)


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = Dots3NoteAdapter.tower_only_config
convert_checkpoint = Dots3NoteAdapter.convert_checkpoint
