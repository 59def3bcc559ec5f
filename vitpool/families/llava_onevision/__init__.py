"""LLaVA-OneVision (llava_onevision): the SigLIP tower on an image's anyres tiles (a base tile and the
crops of its grid) or a video's frames, the `multi_modal_projector`, and the packing its model does
after them (the unpadding, the pooling, the `image_newline` tokens), in one graph (`adapter.py`).

Its vision config is SigLIP's own (`siglip_vision_model`), which Gemma 3's family owns in the
registry (a tower type listed by two records would go to the later one by name: this one), so a
tower-only save of this family's module says `llava_onevision_vision` instead. A full checkpoint
(model_type `llava_onevision`, vision `siglip_vision_model`) reaches this family through its own
`model_type` first (`vitpool.models.registry.tower_family`), so only a bare SigLIP save is Gemma 3's.
"""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.llava_onevision.adapter"

_FAMILY = Family(
    lazy(_ADAPTER, "build_encoder"),
    lazy(_ADAPTER, "LlavaOnevisionAdapter"),
    read_config=lazy(_ADAPTER, "read_tower_config"),
    # the releases and transformers 5 save without model.; a model's state_dict has it
    checkpoint=adapter_checkpoint(
        _ADAPTER,
        "LlavaOnevisionAdapter",
        prefixes=(
            "model.vision_tower.",
            "model.multi_modal_projector.",
            "model.image_newline",
            "vision_tower.",
            "multi_modal_projector.",
            "image_newline",
        ),
    ),
)

RECORD = FamilyRecord(
    name="llava_onevision",
    # SigLIP's own type for full checkpoints (shared with Gemma 3: found through model_types first), and
    # vitpool's for tower-only saves
    towers={"llava_onevision_vision": _FAMILY, "siglip_vision_model": _FAMILY},
    model_types=("llava_onevision",),
    # vLLM's LlavaOnevisionForConditionalGeneration.embed_multimodal (vllm 0.32,
    # model_executor/models/llava_onevision.py) gives one tensor per image, the base tile's features,
    # then the unpadded (and pooled) crops' with a newline after each row (_merge_image_patch_embeddings,
    # "spatial_unpad"), and per video its pooled frames and one newline: every placeholder is an
    # embedding, what the encoder gives as tokens
    vllm_layout="tokens",
    vllm_checked=True,  # tests/vllm/test_vllm_wave3.py
    transformers_parts=None,
    image_features="vitpool.families.llava_onevision.features:LlavaOnevisionFeatures",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "image_sizes", "batch_num_images"),
        video_keys=("pixel_values_videos",),
        split="vitpool.families.llava_onevision.processor:items",
    ),
)
