"""LFM3-VL (lfm3_vl): `Lfm3VlVisionModel` (gated depthwise-convolution and grouped-query attention
layers) and its `Lfm3VlMultiModalProjector`, run together in one graph; images and videos as
Qwen-style patch rows and (t, h, w) grids; transformers' keys or the release's."""

from vitpool.models.family import (
    GRID_PROCESSOR_OUTPUT,
    Family,
    FamilyRecord,
    ModelParts,
    adapter_checkpoint,
    lazy,
)

_ADAPTER = "vitpool.families.lfm3_vl.adapter"

RECORD = FamilyRecord(
    name="lfm3_vl",
    towers={
        "lfm3_vl_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Lfm3VlAdapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "Lfm3VlAdapter",
                prefixes=(
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                    "vision_tower.",
                    "multi_modal_projector.",
                ),
            ),
        ),
    },
    model_types=("lfm3_vl",),
    # not published for vLLM: vLLM 0.32 has no model for it, and its transformers (5.19) has no lfm3_vl
    # for its Transformers modeling backend to serve (tests/vllm/test_vllm_wave4.py has no case for it)
    vllm_layout=None,
    # the model calls `vision_tower(pixels, grid_thw=...)`, reads `last_hidden_state`, projects it and
    # splits by the grids: the stand-in answers with projected tokens, the projector passes them on
    transformers_parts=ModelParts(
        tower="vision_tower",
        projector="multi_modal_projector",
        encoder_module=f"{_ADAPTER}:Lfm3VlEncoder",
        output="last_hidden_state",
    ),
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
)
