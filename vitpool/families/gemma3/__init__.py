"""Gemma 3 (gemma3): the SigLIP vision tower and its multi_modal_projector (average pooling to
`mm_tokens_per_image` tokens, RMSNorm, projection into the LLM's width), run in one graph.

Gemma 3's vision config is SigLIP's own (`siglip_vision_model`), so that type is this family's; a
full checkpoint of another model with a SigLIP tower is refused by `tower_only_config`."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.gemma3.adapter"

RECORD = FamilyRecord(
    name="gemma3",
    towers={
        "siglip_vision_model": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Gemma3Adapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "Gemma3Adapter",
                # transformers >= 4.52 saves under model.; the releases (and transformers 5) without it
                prefixes=(
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                    "vision_tower.",
                    "multi_modal_projector.",
                ),
            ),
        ),
    },
    model_types=("gemma3",),
    # vLLM's Gemma3ForConditionalGeneration.embed_multimodal: per image, the projector's output for
    # its views (the whole image, then the pan-and-scan crops) flattened to rows
    vllm_layout="tokens",
    vllm_checked=True,  # tests/vllm/test_vllm_wave3.py
    transformers_parts=None,
    image_features="vitpool.families.gemma3.features:Gemma3Features",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "num_crops"),
        split="vitpool.families.gemma3.processor:items",
        # its full processor drops it: with the family named, a tile an item (processor.py)
        count_keys=("num_crops",),
    ),
)
