"""PaliGemma and PaliGemma 2 (paligemma): the SigLIP tower on one square view an image (224², 448²
or 896²) and its multi_modal_projector (one Linear into the LLM's width), run in one graph.

Its vision config is SigLIP's own (`siglip_vision_model`), which Gemma 3's family owns in the
registry (a tower type several records list is the first's by name), so a tower-only save of this
family's module says `paligemma_vision` instead. A full checkpoint (model_type `paligemma`, vision
`siglip_vision_model`; PaliGemma 2 differs only in its LLM) reaches this family through its own
`model_type` first (`vitpool.models.registry.tower_family`).
"""

from vitpool.families.paligemma.processor import PaliGemmaProcessorOutput
from vitpool.models.family import Family, FamilyRecord, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.paligemma.adapter"

_FAMILY = Family(
    lazy(_ADAPTER, "build_encoder"),
    lazy(_ADAPTER, "PaliGemmaAdapter"),
    read_config=lazy(_ADAPTER, "read_tower_config"),
    # the releases and transformers 5 save without model.; a model's state_dict has it
    checkpoint=adapter_checkpoint(
        _ADAPTER,
        "PaliGemmaAdapter",
        prefixes=(
            "model.vision_tower.",
            "model.multi_modal_projector.",
            "vision_tower.",
            "multi_modal_projector.",
        ),
    ),
)

RECORD = FamilyRecord(
    name="paligemma",
    # SigLIP's own type for full checkpoints (shared with Gemma 3 and LLaVA-OneVision: found through
    # model_types first), and vitpool's for tower-only saves
    towers={"paligemma_vision": _FAMILY, "siglip_vision_model": _FAMILY},
    model_types=("paligemma",),
    # vLLM 0.32's PaliGemmaForConditionalGeneration.embed_multimodal: one tensor an image, the
    # projector's rows, unscaled (its Gemma scales the text embeddings alone, in embed_input_ids)
    vllm_layout="tokens",
    vllm_checked=True,  # tests/vllm/test_vllm_wave4.py
    transformers_parts=None,
    image_features="vitpool.families.paligemma.features:PaliGemmaFeatures",
    processor_output=PaliGemmaProcessorOutput(
        image_keys=("pixel_values",),
        split="vitpool.families.paligemma.processor:items",
        cut_as="one view an image",  # a batch both fit is cut the same by LLaVA's and PaliGemma's
    ),
)
