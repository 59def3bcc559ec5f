"""VideoLLaMA 3 (video_llama_3): VideoLlama3VisionModel and its projector, images and videos with a
merge size per item, on two paths (`rules.py`); answered at `get_image_features` (`features.py`)."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.video_llama_3.adapter"

RECORD = FamilyRecord(
    name="video_llama_3",
    towers={
        "video_llama_3_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "VideoLlama3Adapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "VideoLlama3Adapter",
                prefixes=("model.vision_model.", "model.projector.", "vision_model.", "projector."),
            ),
        ),
    },
    model_types=("video_llama_3",),
    # vLLM 0.32 serves transformers' model through its Transformers modeling backend, whose encoder
    # cache holds `get_image_features`' tokens an image
    vllm_layout="tokens",
    vllm_checked=True,  # tests/vllm/test_vllm_wave4.py
    transformers_parts=None,
    image_features="vitpool.families.video_llama_3.features:VideoLlama3Features",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "image_grid_thw", "image_merge_sizes"),
        video_keys=("pixel_values_videos", "video_grid_thw", "video_merge_sizes"),
        split="vitpool.families.video_llama_3.processor:video_llama_3_items",
        other_keys=("video_compression_mask",),
    ),
)
