"""Gemma 4 (its vision tower + `embed_vision`) under the adapter conformance suite, and the tiny
models its own tests share. The reference is the Hugging Face model's own `get_image_features`
(SDPA) on each image laid out as the processor lays it out: its patch rows padded to a fixed
block with random rows at positions (-1, -1). The tiny tower standardizes its tokens and clips its
linears (the 26B/31B releases do the one, E2B/E4B the other), with random statistics and bounds
tight enough that the clamps bite."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from family_cases.common import randomize
from vitpool import GraphEncoder, Image, Video
from vitpool.specs import ItemSpec

PATCH = 2
POOL = 3  # pooling_kernel_size: 3 x 3 patches a token
ROW_WIDTH = 3 * PATCH * PATCH
MAX_SIDE = 64  # position_embedding_size: positions an axis
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "patch_size": PATCH,
    "pooling_kernel_size": POOL,
    "position_embedding_size": MAX_SIDE,
    "standardize": True,
    "use_clipped_linears": True,
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 24,
    "global_head_dim": 24,
    "vocab_size": 128,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 128,
    "layer_types": ["full_attention"],
}
TEXT_WIDTH = TINY_TEXT["hidden_size"]
IMAGE_TOKEN = 120  # the image placeholder's id, within the tiny vocabulary
# The processor pads every image to max_soft_tokens * k² rows: 630 for 70 tokens, its smallest setting
MIN_PADDED_TOKENS = 70


def full_config(**vision_settings: Any) -> Any:
    from transformers import Gemma4Config

    return Gemma4Config(
        vision_config={**TINY_VISION, **vision_settings},
        text_config=dict(TINY_TEXT),
        audio_config=None,
        image_token_id=IMAGE_TOKEN,
    )


def randomize_buffers(tower: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The standardization statistics and the linears' clipping bounds, random (HF's init leaves
    them neutral: zeros and ones, infinite bounds), so that they change the result."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in tower.named_buffers():
            if name in ("std_bias", "std_scale"):
                values = 0.1 * torch.randn(buffer.shape, generator=generator)
                buffer.copy_(values + (name == "std_scale"))
            elif name.endswith(("input_min", "output_min", "input_max", "output_max")):
                bound = 1.0 + torch.rand((), generator=generator)  # activations are about unit scale
                buffer.copy_(-bound if name.endswith("min") else bound)
    return tower


def hf_model(seed: int = 0, **vision_settings: Any) -> torch.nn.Module:
    """The full tiny Hugging Face model, its vision tower, buffers and embed_vision random, SDPA."""
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration(full_config(**vision_settings))
    randomize(model.model.vision_tower, seed)
    randomize_buffers(model.model.vision_tower, seed + 1)
    randomize(model.model.embed_vision, seed + 2)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def encoder_module(model: torch.nn.Module) -> torch.nn.Module:
    """vitpool's module over copies of the model's tower and embed_vision (the adapter changes the
    tower's attention)."""
    from vitpool.families.gemma4.adapter import Gemma4Encoder

    return Gemma4Encoder(copy.deepcopy(model.model.vision_tower), copy.deepcopy(model.model.embed_vision))


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.gemma4.adapter import Gemma4Adapter

    return GraphEncoder(
        Gemma4Adapter(encoder_module(model)), budgets=budgets, device="cpu", dtype=torch.float32
    )


def grid_positions(h: int, w: int) -> torch.Tensor:
    """(x, y) of an h x w grid's patches, row-major, as the processor writes them."""
    rows, columns = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([columns.flatten(), rows.flatten()], dim=-1)


def padded_batch(items: list[Any], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Items (real rows and a grid) as the processor lays out a batch: each image's rows, then
    padding rows up to one block size for all (random pixels here, which must not matter) at
    positions (-1, -1): `pixel_values` [B, rows, 3*P*P] and `image_position_ids` [B, rows, 2]."""
    grids = [tuple(int(v) for v in item.grid_thw) for item in items]
    tokens = max(MIN_PADDED_TOKENS, *(h * w // POOL**2 + 1 for _, h, w in grids))
    num_rows = tokens * POOL**2
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.rand(len(items), num_rows, ROW_WIDTH, generator=generator)
    positions = torch.full((len(items), num_rows, 2), -1, dtype=torch.long)
    for index, (item, (_, h, w)) in enumerate(zip(items, grids)):
        pixels[index, : h * w] = torch.as_tensor(item.pixel_values).float()
        positions[index, : h * w] = grid_positions(h, w)
    return pixels, positions


def image_features(model: torch.nn.Module, items: list[Any]) -> tuple[torch.Tensor, ...]:
    """What `get_image_features` gives the LLM for these images, run as one padded batch."""
    pixels, positions = padded_batch(items)
    with torch.no_grad():
        return model.model.get_image_features(pixels, positions).pooler_output


_SHARED: dict[str, torch.nn.Module] = {}


def shared_model() -> torch.nn.Module:
    if "model" not in _SHARED:
        _SHARED["model"] = hf_model()
    return _SHARED["model"]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    return encoder_of(shared_model(), budgets)


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    return lambda item: [image_features(shared_model(), [item])[0]]


def item_for(spec: ItemSpec, pixels: torch.Tensor) -> Image:
    return Image(pixels, spec.layout)


BAD_ITEMS = (
    (Image(torch.randn(36, ROW_WIDTH + 1), (1, 6, 6)), f"{ROW_WIDTH + 1} features per row"),
    (Image(torch.randn(36, 3, PATCH, PATCH), (1, 6, 6)), "must be 2-D"),
    (Image(torch.randn(36, ROW_WIDTH)), "three integers"),
    # a processor's padded block passed whole: the padding rows must go
    (Image(torch.randn(630, ROW_WIDTH), (1, 6, 6)), "the processor's padding rows dropped"),
    (Image(torch.randn(24, ROW_WIDTH), (1, 4, 6)), "multiples of the pooling kernel size 3"),
    (Image(torch.randn(72, ROW_WIDTH), (2, 6, 6)), "t == 1"),
    (Image(torch.randn(3 * 66, ROW_WIDTH), (1, 3, 66)), "past the tower's position table"),
    (Video(torch.randn(36, ROW_WIDTH), (1, 6, 6)), "images only"),
    (Image(torch.randn(0, ROW_WIDTH), (1, 0, 3)), "zero or negative"),
)

CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (16, 32, 64),
}
