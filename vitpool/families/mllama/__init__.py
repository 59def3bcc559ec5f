"""Llama 3.2 Vision (mllama): MllamaVisionModel and its multi_modal_projector, whose output the LLM
reads as cross-attention states."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.mllama.adapter"

RECORD = FamilyRecord(
    name="mllama",
    towers={
        "mllama_vision_model": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "MllamaAdapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "MllamaAdapter",
                prefixes=(
                    "model.vision_model.",
                    "model.multi_modal_projector.",
                    "vision_model.",
                    "multi_modal_projector.",
                ),
            ),
        ),
    },
    model_types=("mllama",),
    vllm_layout=None,  # cross-attention states, not tokens in the prompt: vLLM's encoder cache holds neither
    transformers_parts=None,
    image_features="vitpool.families.mllama.features:MllamaFeatures",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "aspect_ratio_ids"),
        split="vitpool.families.mllama.processor:items",
        other_keys=("aspect_ratio_mask", "num_tiles", "cross_attention_mask"),
    ),
)
