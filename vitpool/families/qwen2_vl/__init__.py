"""Qwen2-VL (qwen2_vl)."""

from vitpool.models.family import GRID_PROCESSOR_OUTPUT, Family, FamilyRecord, hf_tower, lazy

RECORD = FamilyRecord(
    name="qwen2_vl",
    towers={
        "qwen2_vl_vision": Family(
            hf_tower(
                "transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"
            ),
            lazy("vitpool.families.qwen2_vl.adapter", "Qwen2VLAdapter"),
        ),
    },
    model_types=("qwen2_vl",),
    vllm_layout="tokens",
    vllm_checked=True,
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
)
