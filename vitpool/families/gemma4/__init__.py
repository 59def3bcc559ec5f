"""Gemma 4 (gemma4): its vision tower (`gemma4_vision`: patch embedder, encoder, pooler) and the
model's `embed_vision`, run in one graph; each image's real patch rows packed, the processor's
padding rows dropped (`adapter.py` says why that is exact).

The tower's own type, `gemma4_vision`, is no other family's (Gemma 3's is SigLIP's
`siglip_vision_model`). DiffusionGemma uses the same tower type inside another model; its
checkpoints are refused by `Gemma4Adapter.tower_only_config`."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.gemma4.adapter"

RECORD = FamilyRecord(
    name="gemma4",
    towers={
        "gemma4_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Gemma4Adapter"),
            # transformers' save and the releases: under model.; tower-only saves: the module's own keys
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "Gemma4Adapter",
                prefixes=("model.vision_tower.", "model.embed_vision.", "vision_tower.", "embed_vision."),
            ),
        ),
    },
    model_types=("gemma4",),
    # vLLM's Gemma4ForConditionalGeneration.embed_multimodal gives one tensor per image, embed_vision's
    # output for its soft tokens (boi and eoi are text, outside is_embed): what get_image_features gives
    vllm_layout="tokens",
    vllm_checked=True,  # tests/vllm/test_vllm_wave3.py
    transformers_parts=None,
    image_features="vitpool.families.gemma4.features:Gemma4Features",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "image_position_ids"), split="vitpool.families.gemma4.processor:items"
    ),
)
