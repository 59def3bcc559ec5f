"""Mistral 3 (mistral3): the Pixtral tower and Mistral 3's patch-merging projector, transformers'
keys; images of any aspect ratio cut into patch rows (`rules.py`)."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.mistral3.adapter"

RECORD = FamilyRecord(
    name="mistral3",
    towers={
        "pixtral": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Mistral3Adapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "Mistral3Adapter",
                prefixes=(
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                    "vision_tower.",
                    "multi_modal_projector.",
                ),
            ),
        ),
    },
    model_types=("mistral3",),
    # vLLM's Mistral3ForConditionalGeneration.embed_multimodal gives one tensor per image, the
    # projector's output for its [IMG] placeholders (the [IMG_BREAK] and [IMG_END] tokens between
    # them are text, outside is_embed): what get_image_features gives
    vllm_layout="tokens",
    vllm_checked=True,  # tests/vllm/test_vllm_wave3.py
    transformers_parts=None,
    image_features="vitpool.families.mistral3.features:Mistral3Features",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "image_sizes"), split="vitpool.families.mistral3.processor:items"
    ),
)
