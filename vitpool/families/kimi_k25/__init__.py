"""Kimi-K2.5 / K2.6 (kimi_k25): Kimi_K25VisionModel and its mm_projector, Moonshot's or
transformers' keys; patch rows and video clips (`rules.py`)."""

from vitpool.models.family import (
    GRID_PROCESSOR_OUTPUT,
    Family,
    FamilyRecord,
    ModelParts,
    adapter_checkpoint,
    lazy,
)

_ADAPTER = "vitpool.families.kimi_k25.adapter"

RECORD = FamilyRecord(
    name="kimi_k25",
    towers={
        "kimi_k25_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "KimiK25Adapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "KimiK25Adapter",
                prefixes=("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector."),
            ),
        ),
    },
    model_types=("kimi_k25",),
    vllm_layout="tokens",
    vllm_checked=False,  # its image processor needs torchvision, which the tests' side lacks
    transformers_parts=ModelParts(
        tower="vision_tower", projector="mm_projector", encoder_module=f"{_ADAPTER}:KimiK25Encoder"
    ),
    processor_output=GRID_PROCESSOR_OUTPUT,  # one video item per chunk of frames: a video_grid_thw row
)
