"""GLM-OCR (glm_ocr): a GLM-4.1V-style tower run by the GLM-4.1V adapter as it is.

`GlmOcrVisionModel` (transformers' `modular_glm_ocr.py`) inherits `Glm4vVisionModel` and changes
only what lies inside the blocks and the merger's widths: q/k RMS norms in attention, biases, an
MLP of `intermediate_size`. It drops the learned position table (`embeddings`) and the
`post_conv_layernorm`, so its forward reads `grid_thw` only for `position_ids` and `cu_seqlens`,
both of which `Glm4vAdapter` precomputes and passes; the per-sequence grid table that adapter also
passes is then unused, and harmless. The rest is GLM-4.1V's: a (t, h, w) grid per item, one
attention sequence per temporal patch (`get_video_features` runs a clip as one (1, h, w) row per
frame), the 2x2 strided-conv merge, the merger's output handed to the LLM as is. The processor is
GLM-4.6V's (`Glm46VProcessor`: `pixel_values` + `image_grid_thw`, videos as `pixel_values_videos`
+ `video_grid_thw`); vLLM serves it (`GlmOcrForConditionalGeneration`, built on its GLM-4.1V model),
caching the merged tokens per image.
"""

from vitpool.models.family import GRID_PROCESSOR_OUTPUT, Family, FamilyRecord, hf_tower, lazy

RECORD = FamilyRecord(
    name="glm_ocr",
    towers={
        "glm_ocr_vision": Family(
            hf_tower("transformers.models.glm_ocr.modeling_glm_ocr", "GlmOcrVisionModel"),
            lazy("vitpool.families.glm4v.adapter", "Glm4vAdapter"),
        ),
    },
    model_types=("glm_ocr",),
    # Not published for vLLM: vLLM 0.32's own GLM-OCR tower answered otherwise than this one (greedy
    # tokens apart) on a tiny checkpoint (`tests/vllm/tiny_models.py glm_ocr`, put among
    # test_vllm_families.py's families, 2026-11-26); the gateway refuses it until they agree
    vllm_layout=None,
    grid_processor=True,
    processor_output=GRID_PROCESSOR_OUTPUT,
)
