"""Qwen3-Omni (qwen3_omni_moe): the thinker's vision encoder, Qwen3-VL's tower (tokens and
deepstack features); no audio tower, no talker. A full checkpoint keeps the tower under the
thinker (`thinker.visual.`) and its config under `thinker_config.vision_config`."""

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
_ADAPTER = "vitpool.families.qwen3_omni_moe.adapter"


RECORD = FamilyRecord(
    name="qwen3_omni_moe",
    towers={
        "qwen3_omni_moe_vision_encoder": Family(
            hf_tower(_MODELING, "Qwen3OmniMoeVisionEncoder"),
            lazy(_ADAPTER, "Qwen3OmniMoeAdapter"),
            # the tower's config nested in the thinker's (`Qwen3OmniMoeAdapter.tower_only_config`); the
            # keys less their prefix
            checkpoint=CheckpointLayout(
                prefixes=TOWER_PREFIXES, tower_config=lazy(_ADAPTER, "Qwen3OmniMoeAdapter.tower_only_config")
            ),
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
