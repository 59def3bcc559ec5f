"""ERNIE-4.5-VL: the Hugging Face tower (`Ernie4_5_VLMoeVisionTransformerPretrainedModel`) and
its resampler (`Ernie4_5_VLMoeVariableResolutionResamplerModel`), in one graph.

The tower is Qwen2-VL's shape of ViT: a linear patch embedding of single-frame patch rows
[rows, C*P*P], 2-D axial rotary positions from the grid, attention within each frame, a final
LayerNorm, and no merger. What the LLM receives is the resampler's output, so the graph runs it
too (`Ernie4_5_VLMoeEncoder` holds both, as `Ernie4_5_VLMoeModel.get_image_features` /
`get_video_features` run them): each 2x2 block of patch rows (contiguous in the processor's
order) is concatenated and passed through `spatial_linear`; then each output token concatenates
two of those merged tokens, the same one twice for an image, the same block of frames 2k and 2k+1
for a video, and `temporal_linear`, `mlp` and `after_norm` give the LLM's width.

Hugging Face computes those pairs on the host per call (`_temporal_slicing`); here they are
metadata: `temporal_pairs` [rows/4, 2], the two merged tokens of each output slot, so the
resampler is one gather and three small MLPs with static shapes. Output slots past the items'
tokens pair a token with itself and are dropped. The tower takes `position_ids`, `cu_seqlens`
(one sequence per frame, padding rows a trailing one) and an integer `max_seqlen` through its
keyword arguments; given them it has no host synchronisation.

A video's rows per token are twice an image's (its frame pairs merge), so the item rules bound a
batch's rows as well as its tokens (`vitpool.families.ernie4_5_vl_moe.rules`); buffers hold
4 rows per token, an image batch's exact need, and a video in them yields half as many tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from transformers.vision_utils import get_vision_position_ids

from vitpool.families.ernie4_5_vl_moe import CHECKPOINT_PREFIXES
from vitpool.families.ernie4_5_vl_moe.rules import TemporalMergeRules
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, ConfigField, renamed_key
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import Grid, SpatialMergeAdapter, frame_cu_seqlens, grids_of
from vitpool.packing import Budget
from vitpool.specs import ItemSpec

# Hugging Face's `_temporal_slicing` pairs frames 2k and 2k+1: it is written for 2 alone.
TEMPORAL_MERGE_SIZE = 2


class Ernie4_5_VLMoeEncoder(torch.nn.Module):
    """The tower and its resampler; state keys `vision_tower.*` and `resampler_model.*` (as
    transformers names them under `model.`)."""

    def __init__(self, vision_tower: torch.nn.Module, resampler_model: torch.nn.Module) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.resampler_model = resampler_model
        self.config = vision_tower.config


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Ernie4_5_VLMoeEncoder:
    """Fresh tower and resampler from a full Ernie4_5_VLMoeConfig or a vision config with the
    adapter's PROJECTOR_FIELDS."""
    from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeVariableResolutionResamplerModel,
        Ernie4_5_VLMoeVisionTransformerPretrainedModel,
    )

    tower, resampler = tower_and_projector(
        Ernie4_5_VLMoeVisionTransformerPretrainedModel,
        Ernie4_5_VLMoeVariableResolutionResamplerModel,
        Ernie4_5_VLMoeAdapter.projector_config(config),
        dtype,
    )
    return Ernie4_5_VLMoeEncoder(tower, resampler)


# What the adapter runs of transformers' modules by name (checked when an adapter is built).
ENCODER_PARTS = (
    "vision_tower.blocks",
    "resampler_model.spatial_linear",
    "resampler_model.temporal_linear",
    "resampler_model.mlp",
    "resampler_model.after_norm",
)


def resampled_tokens(
    resampler: torch.nn.Module, hidden: torch.Tensor, temporal_pairs: torch.Tensor
) -> torch.Tensor:
    """`Ernie4_5_VLMoeVariableResolutionResamplerModel.forward` with its frame pairs given.

    hidden: [rows, D], 2x2 merge blocks contiguous; temporal_pairs: [slots, 2], the merged tokens
    each output slot joins. Returns [slots, LLM width]. The compatibility seam with transformers'
    resampler: what a release changes in its parts breaks here.
    """
    merge_unit = resampler.spatial_merge_size**2
    merged = resampler.spatial_linear(hidden.reshape(-1, hidden.shape[-1] * merge_unit))  # [rows/4, 4D]
    paired = merged[temporal_pairs].flatten(1)  # [slots, 2*4D]: first frame's token, then second's
    return resampler.after_norm(resampler.mlp(resampler.temporal_linear(paired)))


class Ernie4_5_VLMoeAdapter(SpatialMergeAdapter):
    """Adapter for `Ernie4_5_VLMoeEncoder` (vision model_type "ernie4_5_vl_moe_vision").

    Raises:
        ValueError: a temporal merge size other than 2 (Hugging Face's resampler takes no other).
        ConfigError: the installed transformers' modules lack a part the adapter runs.
    """

    # What a tower-only save's vision config carries besides Hugging Face's fields, for the resampler.
    PROJECTOR_FIELDS = (TEXT_HIDDEN_SIZE, ConfigField("text_rms_norm_eps", "text_config.rms_norm_eps"))
    PROJECTOR_SUBJECT = "an ERNIE-4.5-VL vision config"
    PROJECTOR_ADVICE = (
        "to build its resampler; give the full model's config (Ernie4_5_VLMoeConfig) or a tower-only save "
        "that carries them (`tower_only_config`)"
    )

    @classmethod
    def convert_checkpoint(
        cls, checkpoint: dict[str, torch.Tensor], config: Any = None
    ) -> dict[str, torch.Tensor]:
        """The loader's hook (`CheckpointLayout.convert`): `encoder_state`; the config is not needed."""
        return encoder_state(checkpoint)

    def __init__(self, tower: Ernie4_5_VLMoeEncoder) -> None:
        check_tower_parts("ERNIE-4.5-VL", tower, ENCODER_PARTS)
        config = tower.vision_tower.config
        if config.temporal_merge_size != TEMPORAL_MERGE_SIZE:
            raise ValueError(
                f"temporal_merge_size {config.temporal_merge_size}: ERNIE-4.5-VL's resampler pairs frames, "
                f"{TEMPORAL_MERGE_SIZE} only"
            )
        rules = TemporalMergeRules(
            row_width=config.in_channels * int(config.patch_size) ** 2,
            merge_size=config.spatial_merge_size,
            output_row_shapes=((tower.resampler_model.mlp.out_features,),),
            temporal_merge_size=TEMPORAL_MERGE_SIZE,
        )
        super().__init__(tower, rules)
        self._grid_metadata = lru_cache(maxsize=1024)(self._compute_grid_metadata)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "position_ids": TensorSpec((num_rows, 2), torch.long),
            # real sequences, one trailing padding sequence, and the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
            # one output slot per merged token: an image batch fills them all
            "temporal_pairs": TensorSpec((num_rows // self.merge_unit, 2), torch.long),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        grids = grids_of(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        # Padding rows get rotary position (0, 0); padding slots pair their own index with itself.
        pairs = metadata["temporal_pairs"]
        pairs.copy_(torch.arange(pairs.shape[0])[:, None].expand_as(pairs))
        row = slot = 0
        for grid in grids:
            position_ids, item_pairs = self._grid_metadata(grid)
            metadata["position_ids"][row : row + position_ids.shape[0]] = position_ids
            pairs[slot : slot + item_pairs.shape[0]] = item_pairs + row // self.merge_unit
            row += position_ids.shape[0]
            slot += item_pairs.shape[0]
        metadata["cu_seqlens"] = frame_cu_seqlens(grids, num_rows, budget.max_sequences)
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        output = self.tower.vision_tower(
            pixels,
            grid_thw=None,  # every grid-derived tensor is given below
            position_ids=metadata["position_ids"],
            cu_seqlens=metadata["cu_seqlens"],
            max_seqlen=pixels.shape[0],  # static: a Python int from the buffer's shape
        )
        return [
            resampled_tokens(self.tower.resampler_model, output.last_hidden_state, metadata["temporal_pairs"])
        ]

    def _compute_grid_metadata(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
        """An item's rotary positions [rows, 2] and the merged tokens of its output tokens
        [tokens, 2], counted from its first merged token."""
        t, h, w = grid
        position_ids = get_vision_position_ids(torch.tensor([grid], dtype=torch.long), self.merge_size)
        frame = torch.arange(h * w // self.merge_unit)  # merged tokens of one frame
        if t == 1:  # an image: its token twice
            return position_ids, torch.stack([frame, frame], dim=1)
        if t % TEMPORAL_MERGE_SIZE:
            raise ValueError(f"grid_thw {grid}: a video's frames pair up, t must be even")
        firsts = torch.arange(0, t, TEMPORAL_MERGE_SIZE)[:, None] * frame.numel() + frame  # [t/2, h*w/4]
        return position_ids, torch.stack([firsts.flatten(), firsts.flatten() + frame.numel()], dim=1)


# A full checkpoint as `save_pretrained` writes it (Baidu's names) -> the encoder's keys, as
# transformers renames them on load (`conversion_mapping.py`, "ernie4_5_vl_moe").
_RENAMES = (
    (re.compile(r"^(?:model\.)?(?:vision_model|vision_tower)\."), "vision_tower."),
    (re.compile(r"^(?:model\.)?resampler_model\."), "resampler_model."),
)
_SEQUENTIAL_NAMES = re.compile(r"^(resampler_model\.(?:spatial|temporal)_linear)\.([023])\.")
_MLP_PARTS = {"0": "fc1", "2": "fc2", "3": "ln"}


def encoder_state(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`Ernie4_5_VLMoeEncoder`'s state from a full checkpoint's tower and resampler tensors (keys
    under CHECKPOINT_PREFIXES, in Baidu's or transformers' names; other keys are ignored)."""
    state: dict[str, torch.Tensor] = {}
    for key, tensor in checkpoint.items():
        if not key.startswith(CHECKPOINT_PREFIXES):
            continue
        key = renamed_key(key, _RENAMES)
        key = _SEQUENTIAL_NAMES.sub(lambda match: f"{match[1]}.{_MLP_PARTS[match[2]]}.", key)
        state[key] = tensor
    return state


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = Ernie4_5_VLMoeAdapter.tower_only_config
convert_checkpoint = Ernie4_5_VLMoeAdapter.convert_checkpoint
