"""Qwen2.5-VL (qwen2_5_vl): windowed attention blocks (`rules.py`: the windows an item needs)."""

from vitpool.models.family import GRID_PROCESSOR_OUTPUT, Family, FamilyRecord, hf_tower, lazy

RECORD = FamilyRecord(
    name="qwen2_5_vl",
    towers={
        "qwen2_5_vl_vision": Family(
            hf_tower(
                "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                "Qwen2_5_VisionTransformerPretrainedModel",
            ),
            lazy("vitpool.families.qwen2_5_vl.adapter", "Qwen2_5_VLAdapter"),
        ),
    },
    model_types=("qwen2_5_vl",),
    vllm_layout="tokens",
    vllm_checked=True,
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
)
