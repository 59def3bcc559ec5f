"""Tiny random full Hugging Face models of every vitpool family, and requests for them written as
each family's processor writes them (placeholders, grids, mm_token_type_ids), by hand.

The towers and text models come from the families' tiny configs in tests/unit/family_cases; the
special token ids are moved into the tiny vocabularies.

`TINY_VLMS`: the families whose tower vitpool stands in for (a grid per item). `TINY_FEATURE_VLMS`:
the families whose `get_image_features` it answers (InternVL, Llama 4, Step-3.7, DeepSeek-OCR-2,
MiniCPM-V 4.6), each with one request of two images in the processor's form.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # family_cases/ lives beside the unit tests

from family_cases import (
    deepseek_ocr2,
    glm4v,
    internvl,
    kimi_k25,
    llama4,
    minicpmv4_6,
    paddleocr_vl,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_5,
    step3p7,
)
from family_cases.common import randomize

# special tokens inside every tiny vocabulary (128 tokens)
QWEN_TOKENS = {
    "vision_start_token_id": 120,
    "vision_end_token_id": 121,
    "image_token_id": 122,
    "video_token_id": 123,
}
KIMI_TOKENS = {
    "vision_start_token_id": 120,
    "vision_end_token_id": 121,
    "image_token_id": 122,
    "video_token_id": 123,
}
GLM_TOKENS = {
    "image_start_token_id": 120,
    "image_end_token_id": 121,
    "image_token_id": 122,
    "video_token_id": 123,
    "video_start_token_id": 124,
    "video_end_token_id": 125,
}
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
    rope = dict(
        config.get("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}), mrope_section=sections
    )
    if partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = partial_rotary_factor
    return dict(config, rope_parameters=rope)


def _qwen2_vl() -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        vision_config=qwen2_vl.TINY_VISION_CONFIG, text_config=_text(qwen2_vl.TINY_TEXT_CONFIG), **QWEN_TOKENS
    )
    return Qwen2VLForConditionalGeneration(config)


def _qwen2_5_vl() -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        vision_config=qwen2_5_vl.TINY_VISION_CONFIG,
        text_config=_text(qwen2_5_vl.TINY_TEXT_CONFIG),
        **QWEN_TOKENS,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _qwen3_5() -> torch.nn.Module:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    config = Qwen3_5Config(vision_config=qwen3_5.TINY_VISION, text_config=qwen3_5.TINY_TEXT, **QWEN_TOKENS)
    return Qwen3_5ForConditionalGeneration(config)


def _qwen3_5_moe() -> torch.nn.Module:
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    config = Qwen3_5MoeConfig(
        vision_config=qwen3_5.TINY_VISION, text_config=qwen3_5.TINY_MOE_TEXT, **QWEN_TOKENS
    )
    return Qwen3_5MoeForConditionalGeneration(config)


def _glm4v() -> torch.nn.Module:
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    return Glm4vForConditionalGeneration(
        Glm4vConfig(vision_config=glm4v.TINY_VISION, text_config=_text(glm4v.TINY_TEXT), **GLM_TOKENS)
    )


def _glm46v() -> torch.nn.Module:
    from transformers import Glm46VConfig, Glm46VForConditionalGeneration

    config = Glm46VConfig(
        vision_config=dict(glm4v.TINY_VISION, model_type="glm4v_vision"),
        text_config=dict(_text(glm4v.TINY_TEXT), model_type="glm4v_text"),
        **GLM_TOKENS,
    )
    return Glm46VForConditionalGeneration(config)


def _glm4v_moe() -> torch.nn.Module:
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    text = dict(
        _text(glm4v.TINY_TEXT, partial_rotary_factor=0.5),
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_shared_experts=1,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    return Glm4vMoeForConditionalGeneration(
        Glm4vMoeConfig(vision_config=glm4v.TINY_VISION, text_config=text, **GLM_TOKENS)
    )


def _paddleocr_vl() -> torch.nn.Module:
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration

    torch.manual_seed(0)
    config = PaddleOCRVLConfig(
        vision_config=dict(paddleocr_vl.TINY_VISION), text_config=_text(paddleocr_vl.TINY_TEXT), **QWEN_TOKENS
    )
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
    "glm4v": TinyVLM(
        _seeded(_glm4v), (glm4v.ROW_WIDTH,), video_per_frame=True, glm=True, requests=GLM_REQUESTS
    ),
    "glm46v": TinyVLM(
        _seeded(_glm46v), (glm4v.ROW_WIDTH,), video_per_frame=True, glm=True, requests=GLM_REQUESTS
    ),
    "glm4v_moe": TinyVLM(
        _seeded(_glm4v_moe), (glm4v.ROW_WIDTH,), video_per_frame=True, glm=True, requests=GLM_REQUESTS
    ),
    "kimi_k25": TinyVLM(
        _kimi_k25,
        kimi_k25.ROW_SHAPE,
        video_per_frame=False,
        tokens_per_item=lambda t, h, w: h * w // 4,
        requests=("images",),
        mrope=False,
    ),
    "paddleocr_vl": TinyVLM(
        _paddleocr_vl, paddleocr_vl.ROW_SHAPE, video_per_frame=False, requests=("images",)
    ),
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
        inputs["pixel_values"] = torch.cat(
            [torch.randn(t * h * w, *vlm.row_shape, generator=generator) for t, h, w in images]
        )
        inputs["image_grid_thw"] = torch.tensor(images)
    if videos:
        for t, h, w in videos:
            start, token, end = video_group
            for _ in range(t if vlm.video_per_frame else 1):
                group(start, token, vlm.tokens_per_item(1 if vlm.video_per_frame else t, h, w), end, VIDEO)
                if vlm.video_per_frame:
                    ids.append(9)  # a timestamp's text between frames
                    types.append(TEXT)
        inputs["pixel_values_videos"] = torch.cat(
            [torch.randn(t * h * w, *vlm.row_shape, generator=generator) for t, h, w in videos]
        )
        inputs["video_grid_thw"] = torch.tensor(videos)
    ids += [4, 5]
    types += [TEXT, TEXT]
    inputs["input_ids"] = torch.tensor([ids])
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if vlm.mrope:
        inputs["mm_token_type_ids"] = torch.tensor([types], dtype=torch.int32)
    return inputs


# ---- families answered at get_image_features: tiles, views and crops, slices ----


@dataclass(frozen=True)
class TinyFeatureVLM:
    build: Callable[[], torch.nn.Module]
    request: Callable[[Any], dict[str, torch.Tensor]]  # the model's config -> a request of two images
    budgets: tuple[int, ...]  # GraphEncoder budgets in tokens (for a family of two paths, each path's)


def _prompt(config: Any, tokens_per_image: list[int]) -> dict[str, torch.Tensor]:
    """input_ids: text, each image's placeholders between a start and an end token (plain text
    tokens to the model), text; and the attention mask."""
    image = config.image_token_id
    ids = [1, 2, 3]
    for count in tokens_per_image:
        ids += [image - 2] + [image] * count + [image - 1]
    ids += [4, 5]
    input_ids = torch.tensor([ids])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _with_image_token(model: torch.nn.Module, image_token_id: int) -> torch.nn.Module:
    model.config.image_token_id = image_token_id  # the model reads it at every call
    return model


def _tiles_request(tokens_per_tile: int, row_shape: tuple[int, ...], tiles_per_image: tuple[int, ...]):
    """InternVL's and Llama 4's request: the tiles of every image in one tensor, no boundaries."""

    def request(config: Any) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(7)
        pixels = torch.randn(sum(tiles_per_image), *row_shape, generator=generator)
        tokens = [tokens_per_tile * tiles for tiles in tiles_per_image]
        return {**_prompt(config, tokens), "pixel_values": pixels}

    return request


def _views_and_crops_request(case: Any, crops_per_image: tuple[int, ...]):
    """Step-3.7's and DeepSeek-OCR-2's request: a global view per image, every image's crops in
    one tensor, and each image's crop count."""

    def request(config: Any) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(7)
        views = torch.randn(len(crops_per_image), *case.GLOBAL_ROW_SHAPE, generator=generator)
        crops = torch.randn(sum(crops_per_image), *case.LOCAL_ROW_SHAPE, generator=generator)
        tokens = [case.TOKENS_PER_GLOBAL + case.TOKENS_PER_CROP * count for count in crops_per_image]
        return {
            **_prompt(config, tokens),
            "pixel_values": views,
            "pixel_values_local": crops,
            "num_local_patches": torch.tensor(crops_per_image),
        }

    return request


def _step3p7() -> torch.nn.Module:
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    # the unit tests never run the text model: it needs its key-value heads and (transformers 5.24
    # builds a sliding-window mask whether or not a layer uses one) a window
    text = dict(step3p7.TINY_TEXT, num_key_value_heads=2, sliding_window=64)
    config = Step3p7Config(
        vision_config=dict(step3p7.TINY_VISION, local_image_size=step3p7.LOCAL_SIZE),
        text_config=text,
        image_token_id=122,
    )
    torch.manual_seed(0)
    model = Step3p7ForConditionalGeneration(config)
    randomize(model.model.vision_model, 0)
    randomize(model.model.multi_modal_projector, 1)
    return model.eval()


def _internvl() -> torch.nn.Module:
    model = _with_image_token(internvl.hf_model(), 122)
    # HF's init of this one-layer Qwen2 repeats the last prompt token whatever the image: unit-scale
    # text weights make the greedy tokens depend on the embeddings
    randomize(model.model.language_model, 3)
    return model


def _deepseek_ocr2() -> torch.nn.Module:
    model = _with_image_token(deepseek_ocr2.hf_model(), 30)  # a vocabulary of 32
    model.config.vision_config.local_image_size = deepseek_ocr2.LOCAL_SIZE
    return model


def _minicpmv4_6() -> torch.nn.Module:
    from transformers import MiniCPMV4_6ForConditionalGeneration

    torch.manual_seed(0)
    config = minicpmv4_6.full_config(image_token_id=60)  # a vocabulary of 64
    model = MiniCPMV4_6ForConditionalGeneration(config)
    randomize(model.model.vision_tower, 0)
    randomize(model.model.merger, 1)
    return model.eval()


MINICPM_SLICES = ((4, 4), (4, 8), (8, 4))  # image 1: an overview and a slice; image 2: one slice


def _minicpmv4_6_request(config: Any) -> dict[str, torch.Tensor]:
    """The processor's strip [1, C, P, N*P] of every slice's patches and target_sizes [slices, 2]."""
    generator = torch.Generator().manual_seed(7)
    num_patches = sum(h * w for h, w in MINICPM_SLICES)
    rows = torch.randn(num_patches, *minicpmv4_6.ROW_SHAPE, generator=generator)
    tokens = [h * w // 16 for h, w in MINICPM_SLICES]
    return {
        **_prompt(config, [tokens[0] + tokens[1], tokens[2]]),
        "pixel_values": minicpmv4_6.strip_of(rows),
        "target_sizes": torch.tensor(MINICPM_SLICES, dtype=torch.int32),
    }


TINY_FEATURE_VLMS: dict[str, TinyFeatureVLM] = {
    # 1 and 3 tiles of 4 tokens
    "internvl": TinyFeatureVLM(
        _internvl, _tiles_request(internvl.TOKENS_PER_TILE, internvl.ROW_SHAPE, (1, 3)), (4, 8)
    ),
    # 2 and 1 tiles of 16 tokens
    "llama4": TinyFeatureVLM(
        lambda: _with_image_token(llama4.hf_model(), 122),
        _tiles_request(llama4.TOKENS_PER_TILE, llama4.ROW_SHAPE, (2, 1)),
        (16, 32),
    ),
    # a view and 2 crops, a view alone
    "step3p7": TinyFeatureVLM(_step3p7, _views_and_crops_request(step3p7, (2, 0)), (4, 8)),
    "deepseek_ocr2": TinyFeatureVLM(
        _deepseek_ocr2,
        _views_and_crops_request(deepseek_ocr2, (2, 0)),
        (deepseek_ocr2.TOKENS_PER_GLOBAL, 2 * deepseek_ocr2.TOKENS_PER_GLOBAL),
    ),
    # 3 slices of 1, 2 and 2 tokens
    "minicpmv4_6": TinyFeatureVLM(_minicpmv4_6, _minicpmv4_6_request, (8, 16)),
}
