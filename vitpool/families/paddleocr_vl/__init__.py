"""PaddleOCR-VL (paddleocr_vl): PaddleOCRVisionModel and its projector, transformers' or the
release's keys; patch rows (`rules.py`)."""

from vitpool.models.family import (
    GRID_IMAGES_OUTPUT,
    Family,
    FamilyRecord,
    ModelParts,
    adapter_checkpoint,
    lazy,
)

_ADAPTER = "vitpool.families.paddleocr_vl.adapter"

RECORD = FamilyRecord(
    name="paddleocr_vl",
    towers={
        "paddleocr_vl_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "PaddleOCRVLAdapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "PaddleOCRVLAdapter",
                prefixes=("model.visual.", "visual.", "model.projector.", "mlp_AR.", "projector."),
            ),
        ),
    },
    model_types=("paddleocr_vl",),
    vllm_layout="tokens",
    vllm_checked=True,
    transformers_parts=ModelParts(
        projector="projector",
        encoder_module=f"{_ADAPTER}:PaddleOCREncoder",
        output="last_hidden_state",
        batch_dim=True,
    ),
    grid_processor=True,
    processor_output=GRID_IMAGES_OUTPUT,
)
