"""Qwen2.5-Omni (qwen2_5_omni): the thinker's vision encoder, Qwen2.5-VL's tower (window
attention, RMSNorm, the 2x2 patch merger) with its attention's q, k and v as three Linears; no
audio tower, no talker. A full checkpoint keeps the tower under the thinker (`thinker.visual.`)
and its config under `thinker_config.vision_config` (`adapter.py`: why Qwen2.5-VL's adapter
runs it unchanged)."""

from vitpool.models.family import (
    GRID_PROCESSOR_OUTPUT,
    CheckpointLayout,
    Family,
    FamilyRecord,
    hf_tower,
    lazy,
)

_MODELING = "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni"
_ADAPTER = "vitpool.families.qwen2_5_omni.adapter"

# Where each save keeps the tower: a full model as released and as transformers saves it
# (`thinker.visual.`) or in transformers 5's module tree (`thinker.model.visual.`); a saved thinker
# likewise (`visual.`, `model.visual.`). No other key of either starts with one of these: the
# audio tower is `audio_tower.`, the LLM `model.layers.` / `model.language_model.`. The same
# layout as Qwen3-Omni's thinker, which transformers derives from this one.
TOWER_PREFIXES = ("thinker.visual.", "thinker.model.visual.", "visual.", "model.visual.")

RECORD = FamilyRecord(
    name="qwen2_5_omni",
    towers={
        "qwen2_5_omni_vision_encoder": Family(
            hf_tower(_MODELING, "Qwen2_5OmniVisionEncoder"),
            lazy(_ADAPTER, "Qwen2_5OmniAdapter"),
            # the tower's config nested in the thinker's (`Qwen2_5OmniAdapter.tower_only_config`);
            # the keys less their prefix
            checkpoint=CheckpointLayout(
                prefixes=TOWER_PREFIXES, tower_config=lazy(_ADAPTER, "Qwen2_5OmniAdapter.tower_only_config")
            ),
        ),
    },
    # the released checkpoints, and a thinker saved alone
    model_types=("qwen2_5_omni", "qwen2_5_omni_thinker"),
    # vLLM's thinker (`qwen2_5_omni_thinker.py`) runs vLLM's Qwen2.5-VL tower and caches one tensor of
    # merged tokens per image or video, as for Qwen2.5-VL (checked: tests/vllm/test_vllm_wave4.py)
    vllm_layout="tokens",
    vllm_checked=True,
    grid_processor=True,  # Qwen2VLImageProcessor
    processor_output=GRID_PROCESSOR_OUTPUT,  # Qwen2VLImageProcessor and Qwen2VLVideoProcessor
)
