"""DeepSeek-OCR-2 (deepseek_ocr2): SAM, a Qwen2 encoder, its multi_modal_projector and
view_separator, two paths."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.deepseek_ocr2.adapter"

RECORD = FamilyRecord(
    name="deepseek_ocr2",
    towers={
        "deepseek_ocr2_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "DeepseekOcr2Adapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "DeepseekOcr2Adapter",
                prefixes=(
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                    "model.view_separator",
                    "model.sam_model.",
                    "model.qwen2_model.",
                    "model.projector.",
                    "model.view_seperator",
                ),
            ),
        ),
    },
    model_types=("deepseek_ocr2",),
    # vLLM 0.32 does not serve its transformers-format checkpoints (it serves the remote-code
    # release, whose config vitpool does not read)
    vllm_layout=None,
    transformers_parts=None,
    image_features="vitpool.families.deepseek_ocr2.features:DeepseekOcr2Features",
    # Step-3.7's cut, as DeepSeek-OCR-2's: either's batch is cut without naming the family
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "num_local_patches"),
        split="vitpool.families.step3p7.processor:view_and_crops_items",
    ),
)
