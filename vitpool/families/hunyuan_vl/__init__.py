"""HunYuan-VL / HunyuanOCR (hunyuan_vl): HunYuanVLVisionTransformer with its patch merger (begin,
end and newline tokens), transformers' or the release's keys; Qwen-style patch rows and grids."""

from vitpool.models.family import GRID_IMAGES_OUTPUT, Family, FamilyRecord, adapter_checkpoint, hf_tower, lazy

_ADAPTER = "vitpool.families.hunyuan_vl.adapter"

RECORD = FamilyRecord(
    name="hunyuan_vl",
    towers={
        "hunyuan_vl_vision": Family(
            hf_tower("transformers.models.hunyuan_vl.modeling_hunyuan_vl", "HunYuanVLVisionTransformer"),
            lazy(_ADAPTER, "HunYuanVLAdapter"),
            # transformers' state_dict; the release's layout, which save_pretrained writes back
            checkpoint=adapter_checkpoint(
                _ADAPTER, "HunYuanVLAdapter", prefixes=("model.vision_tower.", "model.vit.", "vit.")
            ),
        ),
    },
    model_types=("hunyuan_vl",),
    # vLLM's HunYuanVLForConditionalGeneration.embed_multimodal gives one tensor per image, its
    # merger's whole output ("tokens"), but its tower resamples the position table by
    # scale_factor (h + 0.1) / edge where transformers (vitpool's reference) resizes to (h, w): the
    # embeddings differ, so vitpool does not publish this family for vLLM
    vllm_layout=None,
    transformers_parts=None,  # the tower's pooler_output has a batch axis get_image_features drops
    image_features="vitpool.families.hunyuan_vl.features:HunYuanVLFeatures",
    grid_processor=True,
    processor_output=GRID_IMAGES_OUTPUT,
)
