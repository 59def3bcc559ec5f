"""Tiny random full Hugging Face models of every vitpool family, and requests for them written as
each family's processor writes them (placeholders, grids, mm_token_type_ids), by hand.

The towers and text models come from the families' tiny configs in tests/unit/family_cases; the
special token ids are moved into the tiny vocabularies.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # family_cases/ lives beside the unit tests

from family_cases import glm4v, kimi_k25, paddleocr_vl, qwen2_5_vl, qwen2_vl, qwen3_5

# special tokens inside every tiny vocabulary (128 tokens)
QWEN_TOKENS = {"vision_start_token_id": 120, "vision_end_token_id": 121, "image_token_id": 122, "video_token_id": 123}
KIMI_TOKENS = {"vision_start_token_id": 120, "vision_end_token_id": 121, "image_token_id": 122, "video_token_id": 123}
GLM_TOKENS = {"image_start_token_id": 120, "image_end_token_id": 121, "image_token_id": 122, "video_token_id": 123,
              "video_start_token_id": 124, "video_end_token_id": 125}
TEXT = 0
IMAGE = 1
VIDEO = 2


@dataclass(frozen=True)
class TinyVLM:
    build: Callable[[], torch.nn.Module]
    row_shape: tuple[int, ...]
    video_per_frame: bool  # the prompt holds one placeholder group per temporal patch (Qwen3.5, GLM)
    glm: bool = False  # GLM's placeholders: image tokens between image or video start/end tokens
    tokens_per_item: Callable[[int, int, int], int] = lambda t, h, w: t * h * w // 4
    # what the family's full Hugging Face model can take in one request
    requests: tuple[str, ...] = ("images", "video", "both")
    mrope: bool = True  # the text model reads token types (mm_token_type_ids) for M-RoPE


def _seeded(make: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        model = make().eval()
        glm4v.randomize(model.model.visual, seed=1)  # unit-scale tower weights: the embeddings matter
        return model

    return build


def _kimi_k25() -> torch.nn.Module:
    from transformers import Kimi_K25ForConditionalGeneration

    torch.manual_seed(0)
    config = kimi_k25.full_config()
    for name, value in KIMI_TOKENS.items():
        setattr(config, name, value)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    kimi_k25.randomize(model.model.vision_tower, 1)
    kimi_k25.randomize(model.model.mm_projector, 2)
    return model


def _text(config: dict, partial_rotary_factor: float = 1.0) -> dict:
    """The unit tests' text config with an M-RoPE split that covers its rotary dimensions (the
    unit tests never run the text model)."""
    half = int(config["hidden_size"] // config["num_attention_heads"] * partial_rotary_factor) // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3]
    rope = dict(config.get("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}), mrope_section=sections)
    if partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = partial_rotary_factor
    return dict(config, rope_parameters=rope)


def _qwen2_vl() -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(vision_config=qwen2_vl.TINY_VISION_CONFIG, text_config=_text(qwen2_vl.TINY_TEXT_CONFIG), **QWEN_TOKENS)
    return Qwen2VLForConditionalGeneration(config)


def _qwen2_5_vl() -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(vision_config=qwen2_5_vl.TINY_VISION_CONFIG, text_config=_text(qwen2_5_vl.TINY_TEXT_CONFIG),
                              **QWEN_TOKENS)
    return Qwen2_5_VLForConditionalGeneration(config)


def _qwen3_5() -> torch.nn.Module:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = Qwen3_5Config(vision_config=qwen3_5.TINY_VISION, text_config=qwen3_5.TINY_TEXT, **QWEN_TOKENS)
    return Qwen3_5ForConditionalGeneration(config)


def _qwen3_5_moe() -> torch.nn.Module:
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    config = Qwen3_5MoeConfig(vision_config=qwen3_5.TINY_VISION, text_config=qwen3_5.TINY_MOE_TEXT, **QWEN_TOKENS)
    return Qwen3_5MoeForConditionalGeneration(config)


def _glm4v() -> torch.nn.Module:
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    return Glm4vForConditionalGeneration(Glm4vConfig(vision_config=glm4v.TINY_VISION, text_config=_text(glm4v.TINY_TEXT),
                                                     **GLM_TOKENS))


def _glm46v() -> torch.nn.Module:
    from transformers import Glm46VConfig, Glm46VForConditionalGeneration

    config = Glm46VConfig(vision_config=dict(glm4v.TINY_VISION, model_type="glm4v_vision"),
                          text_config=dict(_text(glm4v.TINY_TEXT), model_type="glm4v_text"), **GLM_TOKENS)
    return Glm46VForConditionalGeneration(config)


def _glm4v_moe() -> torch.nn.Module:
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    text = dict(_text(glm4v.TINY_TEXT, partial_rotary_factor=0.5), n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=16,
                first_k_dense_replace=1, n_group=1, topk_group=1)
    return Glm4vMoeForConditionalGeneration(Glm4vMoeConfig(vision_config=glm4v.TINY_VISION, text_config=text,
                                                           **GLM_TOKENS))


def _paddleocr_vl() -> torch.nn.Module:
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration

    torch.manual_seed(0)
    config = PaddleOCRVLConfig(vision_config=dict(paddleocr_vl.TINY_VISION), text_config=_text(paddleocr_vl.TINY_TEXT),
                               **QWEN_TOKENS)
    model = PaddleOCRVLForConditionalGeneration(config).eval()
    paddleocr_vl.randomize(model.model.visual, 1)
    paddleocr_vl.randomize(model.model.projector, 2)
    return model


# GLM marks image and video placeholders with one token id, so HF's own model takes either images
# or videos in one request, never both. Kimi-K2.5's get_video_features (transformers 5.23) splits
# its output by t*h*w/4 after pooling a clip's frames, which fails for t > 1: images only.
GLM_REQUESTS = ("images", "video")
TINY_VLMS: dict[str, TinyVLM] = {
    "qwen2_vl": TinyVLM(_seeded(_qwen2_vl), (qwen2_vl.ROW_WIDTH,), video_per_frame=False),
    "qwen2_5_vl": TinyVLM(_seeded(_qwen2_5_vl), (qwen2_5_vl.ROW_WIDTH,), video_per_frame=False),
    "qwen3_5": TinyVLM(_seeded(_qwen3_5), (qwen3_5.ROW_WIDTH,), video_per_frame=True),
    "qwen3_5_moe": TinyVLM(_seeded(_qwen3_5_moe), (qwen3_5.ROW_WIDTH,), video_per_frame=True),
    "glm4v": TinyVLM(_seeded(_glm4v), (glm4v.ROW_WIDTH,), video_per_frame=True, glm=True, requests=GLM_REQUESTS),
    "glm46v": TinyVLM(_seeded(_glm46v), (glm4v.ROW_WIDTH,), video_per_frame=True, glm=True, requests=GLM_REQUESTS),
    "glm4v_moe": TinyVLM(_seeded(_glm4v_moe), (glm4v.ROW_WIDTH,), video_per_frame=True, glm=True,
                         requests=GLM_REQUESTS),
    "kimi_k25": TinyVLM(_kimi_k25, kimi_k25.ROW_SHAPE, video_per_frame=False, tokens_per_item=lambda t, h, w: h * w // 4,
                        requests=("images",), mrope=False),
    "paddleocr_vl": TinyVLM(_paddleocr_vl, paddleocr_vl.ROW_SHAPE, video_per_frame=False, requests=("images",)),
}


def request(vlm: TinyVLM, config: Any, images=(), videos=()) -> dict[str, torch.Tensor]:
    """input_ids with the placeholders the family's processor writes (one per merged token), the
    token types that M-RoPE reads, and random pixel rows."""
    generator = torch.Generator().manual_seed(7)
    ids: list[int] = [1, 2, 3]
    types: list[int] = [TEXT] * 3

    def group(start: int, token: int, count: int, end: int, kind: int) -> None:
        ids.extend([start] + [token] * count + [end])
        types.extend([TEXT] + [kind] * count + [TEXT])

    if vlm.glm:
        image_group = (config.image_start_token_id, config.image_token_id, config.image_end_token_id)
        # GLM's prompt marks a video's tokens as image tokens, framed by video start / end tokens
        video_group = (config.video_start_token_id, config.image_token_id, config.video_end_token_id)
    else:
        image_group = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
        video_group = (config.vision_start_token_id, config.video_token_id, config.vision_end_token_id)
    inputs: dict[str, torch.Tensor] = {}
    if images:
        for t, h, w in images:
            start, token, end = image_group
            group(start, token, vlm.tokens_per_item(t, h, w), end, IMAGE)
        inputs["pixel_values"] = torch.cat([torch.randn(t * h * w, *vlm.row_shape, generator=generator)
                                            for t, h, w in images])
        inputs["image_grid_thw"] = torch.tensor(images)
    if videos:
        for t, h, w in videos:
            start, token, end = video_group
            for _ in range(t if vlm.video_per_frame else 1):
                group(start, token, vlm.tokens_per_item(1 if vlm.video_per_frame else t, h, w), end, VIDEO)
                if vlm.video_per_frame:
                    ids.append(9)  # a timestamp's text between frames
                    types.append(TEXT)
        inputs["pixel_values_videos"] = torch.cat([torch.randn(t * h * w, *vlm.row_shape, generator=generator)
                                                   for t, h, w in videos])
        inputs["video_grid_thw"] = torch.tensor(videos)
    ids += [4, 5]
    types += [TEXT, TEXT]
    inputs["input_ids"] = torch.tensor([ids])
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if vlm.mrope:
        inputs["mm_token_type_ids"] = torch.tensor([types], dtype=torch.int32)
    return inputs
