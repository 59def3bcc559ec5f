"""HunYuan V4 VL (hy_v4_vl): HYV4VLVisionModel with its patch merger (newline tokens, no begin or
end), images and videos as Qwen-style patch rows and grids; transformers' or the release's keys."""

from vitpool.models.family import (
    GRID_PROCESSOR_OUTPUT,
    Family,
    FamilyRecord,
    adapter_checkpoint,
    hf_tower,
    lazy,
)

_ADAPTER = "vitpool.families.hy_v4_vl.adapter"

RECORD = FamilyRecord(
    name="hy_v4_vl",
    towers={
        "hy_v4_vl_vision": Family(
            hf_tower("transformers.models.hy_v4_vl.modeling_hy_v4_vl", "HYV4VLVisionModel"),
            lazy(_ADAPTER, "HYV4VLAdapter"),
            # transformers' state_dict, or the release's layout that save_pretrained writes back
            checkpoint=adapter_checkpoint(
                _ADAPTER, "HYV4VLAdapter", prefixes=("model.vision_tower.", "vit.")
            ),
        ),
    },
    model_types=("hy_v4_vl",),
    # vLLM 0.32 cannot serve it: its registry has HYV4ForCausalLM (vllm/models/hy_v4, text only) and
    # no HYV4VLForConditionalGeneration, and its transformers (5.19) has no hy_v4_vl model type for
    # its Transformers modeling backend. Not published for vLLM
    vllm_layout=None,
    transformers_parts=None,  # the tower's pooler_output has a batch axis get_image_features drops
    image_features="vitpool.families.hy_v4_vl.features:HYV4VLFeatures",
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
)
