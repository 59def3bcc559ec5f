"""VideoLLaMA 3 (VideoLlama3VisionModel + projector) under the adapter conformance suite, and the
tiny models its own tests share. The reference is Hugging Face's own tower (SDPA) on one item
alone with its merge size, followed by the model's projector, as
`VideoLlama3Model.get_image_features` runs them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from family_cases.common import randomize, save_tower_and_projector
from vitpool import GraphEncoder, Image, Video
from vitpool.specs import VIDEO, ItemSpec

PATCH = 2
ROW_WIDTH = 3 * PATCH * PATCH
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": PATCH,
}
TINY_TEXT = {
    "model_type": "qwen2",  # transformers 5.17 reads it; 5.24 defaults it
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
}
TANH_GELU_MLP = True  # SigLIP's blocks: gelu_pytorch_tanh
TOO_OLD = None  # transformers 5.17 has video_llama_3
# An image that nearly fills the 256-token budget (tests/gpu/test_families_gpu.py): images keep every
# patch (merge size 1), so 240 rows, where the 2x2-merging families take 960
FILL_GRID = (1, 15, 16)
# ... and so its 256-token budget has 256 rows, under the rows a dense graph needs (on the FA2 fallback)
NO_DENSE_GRAPH = True


def full_config() -> Any:
    from transformers import VideoLlama3Config

    return VideoLlama3Config(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT))


def tiny_encoder_module(seed: int = 0) -> torch.nn.Module:
    from vitpool.families.video_llama_3.adapter import build_encoder

    return randomize(build_encoder(full_config()), seed).eval().requires_grad_(False)


def save_tower(directory: Path) -> Path:
    return save_tower_and_projector("video_llama_3", full_config(), tiny_encoder_module(), directory)


def layout_of(grid: Any) -> tuple[int, int, int, int]:
    """(t, h, w, merge size) of an item's grid; three entries take the processors' defaults (1 for
    an image, 2 for a clip)."""
    values = [int(v) for v in torch.as_tensor(grid).reshape(-1).tolist()]
    if len(values) == 4:
        return values[0], values[1], values[2], values[3]
    t, h, w = values
    return t, h, w, 2 if t > 1 else 1


def tower_tokens(module: torch.nn.Module, pixels: torch.Tensor, grid_thw: Any) -> torch.Tensor:
    """HF's tower on one item's pixels with its merge size, then the projector (what
    get_image_features runs)."""
    t, h, w, merge = layout_of(grid_thw)
    device = pixels.device
    hidden = module.vision_model(
        pixels,
        grid_thw=torch.tensor([[t, h, w]], device=device),
        merge_sizes=torch.tensor([merge], device=device),
    ).last_hidden_state
    return module.projector(hidden)


def reference_tokens(module: torch.nn.Module, item: Any) -> torch.Tensor:
    """`tower_tokens` of one item, on the module's device and in its dtype."""
    parameter = next(module.parameters())
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values).to(parameter.device, parameter.dtype)
        return tower_tokens(module, pixels, item.grid_thw)


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    module = copy.deepcopy(encoder.adapter.tower)
    module.vision_model.config._attn_implementation = "sdpa"  # Hugging Face's own path
    return lambda item: [reference_tokens(module, item)]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    from vitpool.families.video_llama_3.adapter import VideoLlama3Adapter

    return GraphEncoder(
        VideoLlama3Adapter(tiny_encoder_module()), budgets=budgets, device="cpu", dtype=torch.float32
    )


def item_for(spec: ItemSpec, pixels: torch.Tensor) -> Any:
    return (Video if spec.modality == VIDEO else Image)(pixels, spec.layout)


BAD_ITEMS = (
    (Image(torch.randn(16, ROW_WIDTH + 1), (1, 4, 4)), "features per row"),
    (Image(torch.randn(16, 3, PATCH, PATCH), (1, 4, 4)), "must be 2-D"),
    (Image(torch.randn(16, ROW_WIDTH)), "grid_thw must be"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 4, 4)), "needs t*h*w = 16"),
    (Image(torch.randn(32, ROW_WIDTH), (2, 4, 4)), "t == 1"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 3, 4, 2)), "multiples of the merge size 2"),
    # a clip takes the video processor's merge size 2 by default
    (Video(torch.randn(24, ROW_WIDTH), (2, 3, 4)), "multiples of the merge size 2"),
    (Image(torch.randn(16, ROW_WIDTH), (1, 4, 4, 0)), "merge size (its fourth entry) must be positive"),
    (Image(torch.randn(0, ROW_WIDTH), (1, 0, 4)), "zero or negative"),
    (Image(torch.ones(16, ROW_WIDTH, dtype=torch.int64), (1, 4, 4)), "floating-point"),
)

CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (16, 32, 64),
}
