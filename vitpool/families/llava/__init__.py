"""LLaVA 1.5 (llava): the CLIP tower on one fixed-size view an image (336²), the feature selection of
`get_image_features` (a hidden state before the last layer, the class token dropped) and the
`multi_modal_projector` (a two-layer GELU MLP into the LLM's width), run in one graph (`adapter.py`).
On the host: the copy of each batch's views into the graph's static input and the slicing of each
image's rows out of its output; no metadata is computed, the views are the batch dimension.

Its vision config is CLIP's own (`clip_vision_model`), which this family claims in the registry (the
LLaVA-NeXT family lists it for its full checkpoints only, which find it by their model_type), so a
tower-only save keeps that type with the projector's fields added (`adapter.tower_only_config`). A
full checkpoint of another model with a CLIP tower that no family claims by its model_type
(VipLLaVA) reaches this family through that type and is refused by `tower_only_config`; a `llava`
checkpoint with another tower (Pixtral, SigLIP) goes to that tower's family, which refuses it.
"""

from vitpool.families.llava.processor import LlavaProcessorOutput
from vitpool.models.family import Family, FamilyRecord, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.llava.adapter"

RECORD = FamilyRecord(
    name="llava",
    towers={
        "clip_vision_model": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "LlavaAdapter"),
            # transformers 5 saves under model.; the releases (transformers 4) and tower-only saves without
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "LlavaAdapter",
                prefixes=(
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                    "vision_tower.",
                    "multi_modal_projector.",
                ),
            ),
        ),
    },
    model_types=("llava",),
    # vLLM's LlavaForConditionalGeneration.embed_multimodal: one tensor an image, the projector's rows
    # for its view (the class token dropped under "default")
    vllm_layout="tokens",
    vllm_checked=True,  # tests/vllm/test_vllm_wave4.py
    transformers_parts=None,
    image_features="vitpool.families.llava.features:LlavaFeatures",
    processor_output=LlavaProcessorOutput(
        image_keys=("pixel_values",),
        split="vitpool.families.llava.processor:items",
        cut_as="one view an image",  # a batch both fit is cut the same by LLaVA's and PaliGemma's
    ),
)
