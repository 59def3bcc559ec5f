"""GLM-4.1V (glm4v), GLM-4.6V (glm46v, GLM-4.1V's tower) and GLM-4.5V (glm4v_moe)."""

from vitpool.models.family import GRID_PROCESSOR_OUTPUT, Family, FamilyRecord, hf_tower, lazy

_ADAPTER = lazy("vitpool.families.glm4v.adapter", "Glm4vAdapter")

RECORD = FamilyRecord(
    name="glm4v",
    towers={
        "glm4v_vision": Family(
            hf_tower("transformers.models.glm4v.modeling_glm4v", "Glm4vVisionModel"), _ADAPTER
        ),
        "glm4v_moe_vision": Family(
            hf_tower("transformers.models.glm4v_moe.modeling_glm4v_moe", "Glm4vMoeVisionModel"), _ADAPTER
        ),
    },
    model_types=("glm4v", "glm4v_moe"),
    vllm_layout="tokens",
    vllm_checked=True,
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
)
