"""Molmo 2 (molmo2): its ViT on an image's crops (a global view and overlapping crops) or a video's
frames, and its adapter (attention pooling of patch features in windows, then the projector), in
one graph (`adapter.py`); the pooling windows are computed on the host from each item's layout
(`rules.py`). Its processors' output is cut by `processor.py`, its `get_image_features` answered by
`features.py`. transformers has the model from 5.24 (not 5.17): only the functions that build the
tower import its modeling code."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.molmo2.adapter"

RECORD = FamilyRecord(
    name="molmo2",
    towers={
        "molmo2_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Molmo2Adapter"),
            # transformers' keys (a model's state_dict: under model.) and allenai's release keys
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "Molmo2Adapter",
                prefixes=(
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                    "vision_tower.",
                    "multi_modal_projector.",
                    "model.vision_backbone.image_vit.",
                    "model.vision_backbone.image_pooling_2d.",
                    "model.vision_backbone.image_projector.",
                    "vision_backbone.image_vit.",
                    "vision_backbone.image_pooling_2d.",
                    "vision_backbone.image_projector.",
                ),
            ),
        ),
    },
    model_types=("molmo2",),
    # not published for vLLM: vLLM 0.32's own Molmo2ForConditionalGeneration reads allenai's release
    # format only (`config.vit_config`, weights under model.vision_backbone.), not transformers'
    # (`vision_config`, model.vision_tower.), and its transformers (5.19) has no molmo2 for its
    # Transformers modeling backend to serve (tests/vllm/test_vllm_wave4.py has no case for it)
    vllm_layout=None,
    transformers_parts=None,
    image_features="vitpool.families.molmo2.features:Molmo2Features",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "image_token_pooling", "image_grids"),
        video_keys=("pixel_values_videos", "video_token_pooling", "video_grids"),
        split="vitpool.families.molmo2.processor:items",
        other_keys=("image_num_crops",),
    ),
)
