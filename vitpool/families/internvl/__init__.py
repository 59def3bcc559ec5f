"""InternVL 3 / 3.5 (internvl: InternVLVisionModel and its multi_modal_projector, transformers'
keys), and InternVL 2 / 2.5 / 3 as OpenGVLab released them (config "internvl_chat", remote code:
InternViT, every size "intern_vit_6b", under vision_model. with a fused qkv, the projector as mlp1)."""

from vitpool.models.family import CheckpointLayout, Family, FamilyRecord, ProcessorOutput, lazy

_ADAPTER = "vitpool.families.internvl.adapter"
_CHECKPOINT = "vitpool.families.internvl.checkpoint"

RECORD = FamilyRecord(
    name="internvl",
    towers={
        "internvl_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "InternVLAdapter"),
            checkpoint=CheckpointLayout(
                prefixes=(
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                    "vision_tower.",
                    "multi_modal_projector.",
                ),
                tower_config=lazy(_ADAPTER, "tower_only_config"),
                convert=lazy(_CHECKPOINT, "convert_checkpoint"),
            ),
        ),
        "intern_vit_6b": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "InternVLAdapter"),
            read_config=lazy(_CHECKPOINT, "refuse_tower_release"),
            checkpoint=CheckpointLayout(
                prefixes=("vision_model.", "mlp1."),
                convert=lazy(_CHECKPOINT, "convert_checkpoint"),
                read_full_config=lazy(_CHECKPOINT, "release_config"),
            ),
        ),
    },
    model_types=("internvl",),
    vllm_layout="tokens",  # the tiles, the thumbnail last
    vllm_checked=True,
    transformers_parts=None,
    image_features="vitpool.families.internvl.features:InternVLFeatures",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "num_patches"), split="vitpool.families.internvl.processor:items"
    ),
)
