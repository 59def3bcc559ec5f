"""InternVL 3 / 3.5 (internvl: InternVLVisionModel and its multi_modal_projector, transformers'
keys), and InternVL 2 / 2.5 / 3 as OpenGVLab released them (config "internvl_chat", remote code:
InternViT, every size "intern_vit_6b", under vision_model. with a fused qkv, the projector as mlp1)."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.internvl.adapter"
_CHECKPOINT = "vitpool.families.internvl.checkpoint"

RECORD = FamilyRecord(
    name="internvl",
    towers={
        "internvl_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "InternVLAdapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "InternVLAdapter",
                prefixes=(
                    "model.vision_tower.",
                    "model.multi_modal_projector.",
                    "vision_tower.",
                    "multi_modal_projector.",
                ),
            ),
        ),
        "intern_vit_6b": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "InternVLAdapter"),
            read_config=lazy(_CHECKPOINT, "refuse_tower_release"),
            checkpoint=adapter_checkpoint(
                _ADAPTER,
                "InternVLAdapter",
                prefixes=("vision_model.", "mlp1."),
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
        image_keys=("pixel_values", "num_patches"),
        split="vitpool.families.internvl.processor:items",
        # its full processor drops it: with the family named, a tile an item (processor.py)
        count_keys=("num_patches",),
    ),
)
