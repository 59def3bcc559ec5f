"""Cosmos-3 Edge (cosmos3_edge): its SigLIP2-style tower (`Cosmos3EdgeVisionModel`) and the
`projector` after it, one graph; Qwen-style patch rows and grids from GLM-4V's processors, images
and videos (one attention sequence per frame)."""

from vitpool.models.family import (
    GRID_PROCESSOR_OUTPUT,
    Family,
    FamilyRecord,
    ModelParts,
    adapter_checkpoint,
    lazy,
)

_ADAPTER = "vitpool.families.cosmos3_edge.adapter"

# Where a full checkpoint keeps the tower and the projector: transformers' names, which its
# conversion mapping for cosmos3_edge leaves as they are (it renames only the LLM's keys); the
# prefix-less forms for a state dict saved from `model.model`.
CHECKPOINT_PREFIXES = ("model.visual.", "visual.", "model.projector.", "projector.")

RECORD = FamilyRecord(
    name="cosmos3_edge",
    towers={
        "cosmos3_edge_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Cosmos3EdgeAdapter"),
            checkpoint=adapter_checkpoint(_ADAPTER, "Cosmos3EdgeAdapter", prefixes=CHECKPOINT_PREFIXES),
        ),
    },
    model_types=("cosmos3_edge",),
    # not published for vLLM: vLLM 0.32's own Cosmos3EdgeForConditionalGeneration reads another format
    # than transformers' (a `projector_config`, a NemotronH text model; transformers' has
    # `projector_hidden_size` and its own attention text model), and vLLM picks it over its Transformers
    # modeling backend (tests/vllm/test_vllm_wave4.py has no case for it)
    vllm_layout=None,
    # the model reads its tower's `last_hidden_state` and hands it to `projector`
    transformers_parts=ModelParts(
        tower="visual",
        projector="projector",
        encoder_module=f"{_ADAPTER}:Cosmos3EdgeEncoder",
        output="last_hidden_state",
    ),
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
)
