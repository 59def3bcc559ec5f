"""Phi-4-multimodal (phi4_multimodal): the image path only (no audio), `Phi4MultimodalImageEmbedding`
(the SigLIP tower, the HD crop assembly with its separators and the projection) in one graph.

The transformers drop-in cannot install its stand-in yet (`features.py` says why and how to install
it by hand); the record names it because the drop-in answers this family one step above the tower."""

from vitpool.models.family import Family, FamilyRecord, ProcessorOutput, adapter_checkpoint, lazy

_ADAPTER = "vitpool.families.phi4_multimodal.adapter"

RECORD = FamilyRecord(
    name="phi4_multimodal",
    towers={
        "phi4_multimodal_vision": Family(
            lazy(_ADAPTER, "build_encoder"),
            lazy(_ADAPTER, "Phi4MultimodalAdapter"),
            checkpoint=adapter_checkpoint(
                _ADAPTER, "Phi4MultimodalAdapter", prefixes=("model.embed_tokens_extend.image_embed.",)
            ),
        ),
    },
    model_types=("phi4_multimodal",),
    # what vLLM's Phi-4 models keep per image: Phi4MMImageEmbedding's output (its crops' and global
    # crop's tokens with the separators, projected), flattened to rows. vLLM 0.12 dropped
    # transformers' Phi4MultimodalForCausalLM (its registry's _PREVIOUSLY_SUPPORTED_MODELS); it serves
    # only the remote-code Phi4MMForCausalLM (model_type phi4mm), which this record does not load
    vllm_layout="tokens",
    vllm_checked=False,
    transformers_parts=None,
    image_features="vitpool.families.phi4_multimodal.features:Phi4MultimodalFeatures",
    processor_output=ProcessorOutput(
        image_keys=("image_pixel_values", "image_sizes", "image_attention_mask"),
        split="vitpool.families.phi4_multimodal.processor:items",
    ),
)
