"""Llama 4 Scout / Maverick (llama4): Llama4VisionModel and its multi_modal_projector."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.llama4.adapter"

RECORD = FamilyRecord(
    name="llama4",
    towers={
        "llama4_vision_model": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Llama4Adapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "Llama4Adapter",
                prefixes=("vision_model.", "multi_modal_projector."),
            ),
        ),
    },
    model_types=("llama4",),
    vllm_layout="tokens",  # the tiles, the global tile last
    vllm_checked=False,  # its image processor needs torchvision, which the tests' side lacks
    transformers_parts=None,
    image_features="vitpool.families.llama4.features:Llama4Features",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "aspect_ratios"),
        split="vitpool.families.llama4.processor:items",
        # its full processor drops it: with the family named, a tile an item (processor.py)
        count_keys=("aspect_ratios",),
    ),
)
