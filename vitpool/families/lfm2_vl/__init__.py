"""LFM2-VL (lfm2_vl): the SigLIP2 NaFlex tower and LFM2-VL's pixel-unshuffle projector, transformers'
keys or the releases'; an image's tiles and thumbnail as one item of packed patch rows (`rules.py`).

LFM2-VL's vision config is SigLIP2's own (`siglip2_vision_model`), so that type is this family's; a
full checkpoint of another model with a SigLIP2 tower is refused by `Lfm2VlAdapter.tower_only_config`."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.lfm2_vl.adapter"

RECORD = FamilyRecord(
    name="lfm2_vl",
    towers={
        "siglip2_vision_model": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Lfm2VlAdapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "Lfm2VlAdapter",
                prefixes=(
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                    "vision_tower.",
                    "multi_modal_projector.",
                ),
            ),
        ),
    },
    model_types=("lfm2_vl",),
    # vLLM's Lfm2VLForConditionalGeneration.embed_multimodal gives one tensor per image, its tiles' and
    # thumbnail's projector outputs joined in entry order (its num_patches groups them); the markers
    # between them are text, outside is_embed (embed_text=image_token): what an item here gives
    vllm_layout="tokens",
    vllm_checked=True,  # tests/vllm/test_vllm_wave3.py
    transformers_parts=None,
    image_features="vitpool.families.lfm2_vl.features:Lfm2VlFeatures",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "spatial_shapes", "pixel_attention_mask"),
        split="vitpool.families.lfm2_vl.processor:items",
    ),
)
