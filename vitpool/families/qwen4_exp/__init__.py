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
    # Not published for vLLM: no vLLM model file for it was read or run here, so the layout of its
    # encoder cache is unchecked (the gateway refuses the family until it is)
    vllm_layout=None,
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
    # Dynamo's native Qwen3-VL / Qwen3.5 adapter was not checked against this model
    dynamo=False,
)
