"""Qwen3-VL (qwen3_vl, qwen3_vl_moe): Hugging Face's tower, the tokens and the deepstack features."""

from vitpool.models.family import GRID_PROCESSOR_OUTPUT, Family, FamilyRecord, hf_tower, lazy

_ADAPTER = lazy("vitpool.families.qwen3_vl.adapter", "Qwen3VLAdapter")

RECORD = FamilyRecord(
    name="qwen3_vl",
    towers={
        "qwen3_vl_vision": Family(
            hf_tower("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"), _ADAPTER
        ),
        "qwen3_vl_moe_vision": Family(
            hf_tower("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeVisionModel"),
            _ADAPTER,
        ),
    },
    model_types=("qwen3_vl", "qwen3_vl_moe"),
    vllm_layout="tokens_and_deepstack",
    vllm_checked=True,
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
    dynamo=True,
)
