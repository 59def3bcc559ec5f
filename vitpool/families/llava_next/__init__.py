"""LLaVA-NeXT (llava_next): the CLIP tower on an image's anyres tiles (a base tile and the crops of
its grid), the feature selection of `get_image_features` (a hidden state before the last layer, the
class token dropped), the `multi_modal_projector` and the packing its model does after them (the
unpadding, the `image_newline` tokens), in one graph (`adapter.py`). On the host: each item's
gather (which row of the projected tiles, or the newline, each output token is), from its size and
grid alone (`rules.py`), the copy of each batch's tiles into the graph's static input and the
slicing of each image's tokens out of its output.

Its vision config is CLIP's own (`clip_vision_model`), which LLaVA 1.5's family owns in the
registry, so a tower-only save of this family's module says `llava_next_vision` instead, and CLIP's
type is listed among `full_checkpoint_towers`: a full checkpoint (model_type `llava_next`, vision
`clip_vision_model`) reaches this family through its own `model_type`
(`vitpool.models.registry.tower_family`), and a bare CLIP save stays LLaVA 1.5's.
"""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.llava_next.adapter"
_PROCESSOR = "vitpool.families.llava_next.processor"

_FAMILY = Family(
    lazy(_ADAPTER, "build_encoder"),
    lazy(_ADAPTER, "LlavaNextAdapter"),
    read_config=lazy(_ADAPTER, "read_tower_config"),
    # transformers 5 saves under model.; the releases (transformers 4) and tower-only saves without
    checkpoint=adapter_checkpoint(
        _ADAPTER,
        "LlavaNextAdapter",
        prefixes=(
            "model.vision_tower.",
            "model.multi_modal_projector.",
            "model.image_newline",
            "vision_tower.",
            "multi_modal_projector.",
            "image_newline",
        ),
    ),
)

RECORD = FamilyRecord(
    name="llava_next",
    # vitpool's type for tower-only saves, and CLIP's own for full checkpoints only (LLaVA 1.5's)
    towers={"llava_next_vision": _FAMILY, "clip_vision_model": _FAMILY},
    model_types=("llava_next",),
    full_checkpoint_towers=("clip_vision_model",),
    # vLLM's LlavaNextForConditionalGeneration.embed_multimodal: one tensor an image, the base tile's
    # features, then the unpadded crops' with a newline after each row (what vitpool's tokens are)
    vllm_layout="tokens",
    vllm_checked=True,  # tests/vllm/test_vllm_wave4.py
    transformers_parts=None,
    image_features="vitpool.families.llava_next.features:LlavaNextFeatures",
    processor_output=ProcessorOutput(
        image_keys=("pixel_values", "image_sizes"),
        split=f"{_PROCESSOR}:items",
        # Mistral 3's keys too: one cut for both, which tells them by the pixels' shape (processor.py)
        cut_as="vitpool.families.mistral3.processor:items",
    ),
)
