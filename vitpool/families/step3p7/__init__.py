"""Step-3.7 (step3p7): Step3p7VisionModel and its multi_modal_projector, two paths (a global view,
crops)."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.step3p7.adapter"

RECORD = FamilyRecord(
    name="step3p7",
    towers={
        "step3p5_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Step3p7Adapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "Step3p7Adapter",
                prefixes=(
                    "model.vision_model.",
                    "model.multi_modal_projector.",
                    "vision_model.",
                    "multi_modal_projector.",
                    "vit_large_projector.",
                ),
            ),
        ),
    },
    model_types=("step3p7",),
    vllm_layout="tokens",  # the crops, then the global view
    vllm_checked=False,  # its image processor needs torchvision, which the tests' side lacks
    transformers_parts=None,
    image_features="vitpool.families.step3p7.features:Step3p7Features",
    # Step-3.7's cut, as DeepSeek-OCR-2's: either's batch is cut without naming the family
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "num_local_patches"),
        split="vitpool.families.step3p7.processor:view_and_crops_items",
    ),
)
