"""Aya Vision (aya_vision): the SigLIP tower on an image's tiles (its crops and a thumbnail) and the
`multi_modal_projector` (pixel shuffle, LayerNorm, SwiGLU MLP), run in one graph (`adapter.py`).

Its vision config is SigLIP's own (`siglip_vision_model`), which Gemma 3's family owns for bare
saves: this record lists it for its own full checkpoints only (`full_checkpoint_towers`), found
through their `model_type` (`vitpool.models.registry.tower_family`); a tower-only save of this
family's module says `aya_vision_vision`.

Its image processor is `GotOcr2ImageProcessor(crop_to_patches=True)`, InternVL's: the same output
(`pixel_values` of every image's tiles, `num_patches` per image), cut by InternVL's cutter, so that a
batch of those keys is one answer for `vitpool.items_from` without `family=`.
"""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.aya_vision.adapter"

_FAMILY = Family(
    lazy(_ADAPTER, "build_encoder"),
    lazy(_ADAPTER, "AyaVisionAdapter"),
    read_config=lazy(_ADAPTER, "read_tower_config"),
    # transformers 5 saves under model.; transformers 4.x before that level, and tower-only saves, without
    checkpoint=adapter_checkpoint(
        _ADAPTER,
        "AyaVisionAdapter",
        prefixes=(
            "model.vision_tower.",
            "model.multi_modal_projector.",
            "vision_tower.",
            "multi_modal_projector.",
        ),
    ),
)

RECORD = FamilyRecord(
    name="aya_vision",
    towers={"aya_vision_vision": _FAMILY, "siglip_vision_model": _FAMILY},
    model_types=("aya_vision",),
    full_checkpoint_towers=("siglip_vision_model",),
    # vLLM 0.32 has no model of its own for it (dropped after 0.24) and serves transformers'
    # AyaVisionForConditionalGeneration through its Transformers modeling backend, whose
    # embed_multimodal keeps one tensor an image: get_image_features' rows for its tiles (checked
    # with pictures of one tile: a thumbnail is resized, where PIL's and torchvision's pixels differ)
    vllm_layout="tokens",
    vllm_checked=True,  # tests/vllm/test_vllm_wave4.py
    transformers_parts=None,
    image_features="vitpool.families.aya_vision.features:AyaVisionFeatures",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "num_patches"),
        split="vitpool.families.internvl.processor:items",
        # AyaVisionProcessor drops it: with the family named, a tile an item (InternVL's cutter)
        count_keys=("num_patches",),
    ),
)
