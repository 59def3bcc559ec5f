"""ERNIE-4.5-VL (ernie4_5_vl_moe): its vision tower and the resampler that hands the LLM its tokens,
one graph; Qwen-style patch rows and grids, images and videos (`rules.py`: a video's frame pairs
merge into one token, so a batch's rows are a capacity of their own)."""

from vitpool.models.family import (
    GRID_PROCESSOR_OUTPUT,
    Family,
    FamilyRecord,
    ModelParts,
    adapter_checkpoint,
    lazy,
)

_ADAPTER = "vitpool.families.ernie4_5_vl_moe.adapter"

# Where a full checkpoint keeps the tower and the resampler: `save_pretrained` writes Baidu's names
# (`model.vision_model.`, the resampler's MLPs as `nn.Sequential` indices); transformers' loaded
# model names them `model.vision_tower.` and `...spatial_linear.fc1`.
CHECKPOINT_PREFIXES = (
    "model.vision_model.",
    "vision_model.",
    "model.vision_tower.",
    "vision_tower.",
    "model.resampler_model.",
    "resampler_model.",
)

RECORD = FamilyRecord(
    name="ernie4_5_vl_moe",
    towers={
        "ernie4_5_vl_moe_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Ernie4_5_VLMoeAdapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "Ernie4_5_VLMoeAdapter",
                prefixes=CHECKPOINT_PREFIXES,
            ),
        ),
    },
    model_types=("ernie4_5_vl_moe",),
    # vLLM serves Baidu's own config (model_type "ernie4_5_moe_vl"), which vitpool does not load:
    # not published for vLLM
    vllm_layout=None,
    # the model reads its tower's `last_hidden_state` and hands it to `resampler_model`
    transformers_parts=ModelParts(
        tower="vision_tower",
        projector="resampler_model",
        encoder_module=f"{_ADAPTER}:Ernie4_5_VLMoeEncoder",
        output="last_hidden_state",
    ),
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
)
