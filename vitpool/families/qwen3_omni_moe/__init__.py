"""Qwen3-Omni (qwen3_omni_moe): the thinker's vision encoder, Qwen3-VL's tower (tokens and
deepstack features); no audio tower, no talker. A full checkpoint keeps the tower under the
thinker (`thinker.visual.`) and its config under `thinker_config.vision_config`."""

from typing import Any

from vitpool.models.family import (
    GRID_PROCESSOR_OUTPUT,
    CheckpointLayout,
    Family,
    FamilyRecord,
    hf_tower,
    lazy,
)

_MODELING = "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe"

# Where each save keeps the tower: a full model as released and as transformers saves it
# (`thinker.visual.`) or in transformers 5's module tree (`thinker.model.visual.`); a saved thinker
# likewise (`visual.`, `model.visual.`). No other key of either starts with one of these.
TOWER_PREFIXES = ("thinker.visual.", "thinker.model.visual.", "visual.", "model.visual.")


def thinker_vision_config(config: Any) -> Any:
    """The tower's config: a full model's nests it in `thinker_config`, a saved thinker's does not."""
    return getattr(config, "thinker_config", config).vision_config


RECORD = FamilyRecord(
    name="qwen3_omni_moe",
    towers={
        "qwen3_omni_moe_vision_encoder": Family(
            hf_tower(_MODELING, "Qwen3OmniMoeVisionEncoder"),
            lazy("vitpool.families.qwen3_omni_moe.adapter", "Qwen3OmniMoeAdapter"),
            checkpoint=CheckpointLayout(prefixes=TOWER_PREFIXES, tower_config=thinker_vision_config),
        ),
    },
    # the released checkpoints, and a thinker saved alone
    model_types=("qwen3_omni_moe", "qwen3_omni_moe_thinker"),
    # vLLM's thinker packs tokens and deepstack side by side as Qwen3-VL's does, but vitpool's vLLM
    # connector reads the deepstack count from a top-level `vision_config`, which Omni nests: unset
    vllm_layout=None,
    grid_processor=True,  # Qwen2VLImageProcessor
    processor_output=GRID_PROCESSOR_OUTPUT,  # Qwen2VLImageProcessor and Qwen2VLVideoProcessor
)
