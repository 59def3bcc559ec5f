"""HunYuan V4 VL (HYV4VLVisionModel, its patch merger included) under the adapter conformance suite,
and the tiny models its own tests share. The reference is the Hugging Face model's own
`get_image_features` (SDPA) on each item alone (its `get_video_features` is the same call): the
merger's tokens with a newline after every row of blocks, frame after frame, as the LLM receives
them."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from family_cases.common import randomize
from vitpool import GraphEncoder, Image, Video
from vitpool.specs import ItemSpec

# Why the family's tests skip here (None: they run): transformers 5.17 and 5.18 (the GPU machine's,
# the range's lower bound) have no HunYuan V4 VL; 5.24 has it
TOO_OLD = (
    None
    if importlib.util.find_spec("transformers.models.hy_v4_vl") is not None
    else "HunYuan V4 VL needs a transformers with transformers.models.hy_v4_vl (5.24 has it; 5.18 does not)"
)

PATCH = 2
MERGE = 2
ROW_WIDTH = 3 * PATCH * PATCH
EDGE = 8  # the position table's side: max_image_size / patch_size
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": PATCH,
    "spatial_merge_size": MERGE,
    "max_image_size": EDGE * PATCH,
    "out_hidden_size": 48,
}
# The smallest text model HYV4VL builds: MLA attention, the DSA indexer, MoE and hyper-connections
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "vocab_size": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 24,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "hc_mult": 2,
    # three multimodal RoPE axes summing to qk_rope_head_dim / 2, as get_rope_index needs
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]},
}
TEXT_WIDTH = TINY_TEXT["hidden_size"]
IMAGE_TOKEN, VIDEO_TOKEN = 120, 121  # the placeholders' ids, within the tiny vocabulary


def full_config(**vision_settings: Any) -> Any:
    from transformers import HYV4VLConfig

    return HYV4VLConfig(
        vision_config={**TINY_VISION, **vision_settings},
        text_config=dict(TINY_TEXT),
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
    )


def hf_model(seed: int = 0, **vision_settings: Any) -> torch.nn.Module:
    """The full tiny Hugging Face model, its vision tower random at unit scale (the position table
    and the newline too), SDPA."""
    from transformers import HYV4VLForConditionalGeneration

    model = HYV4VLForConditionalGeneration(full_config(**vision_settings))
    randomize(model.model.vision_tower, seed)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.hy_v4_vl.adapter import HYV4VLAdapter

    # a copy: the adapter switches the tower's attention to vitpool's packed hook
    tower = copy.deepcopy(model.model.vision_tower)
    return GraphEncoder(HYV4VLAdapter(tower), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What `get_image_features` (or `get_video_features`) gives the LLM for this item alone."""
    grid = torch.as_tensor(item.grid_thw).reshape(1, 3).long()
    pixels = torch.as_tensor(item.pixel_values).float()
    with torch.no_grad():
        return model.model.get_image_features(pixels, grid).pooler_output[0]


def item_tokens(t: int, h: int, w: int) -> int:
    """The processor's count (`_num_frame_tokens`): per frame, blocks and a newline a row of blocks."""
    return t * (h // MERGE) * (w // MERGE + 1)


_SHARED: dict[str, torch.nn.Module] = {}


def shared_model() -> torch.nn.Module:
    if "model" not in _SHARED:
        _SHARED["model"] = hf_model()
    return _SHARED["model"]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    return encoder_of(shared_model(), budgets)


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    return lambda item: [image_features(shared_model(), item)]


def item_for(spec: ItemSpec, pixels: torch.Tensor) -> Image | Video:
    return (Video if spec.modality == "video" else Image)(pixels, spec.layout)


BAD_ITEMS = (
    (Image(torch.randn(16, ROW_WIDTH + 1), (1, 4, 4)), f"{ROW_WIDTH + 1} features per row"),
    (Image(torch.randn(16, 3, PATCH, PATCH), (1, 4, 4)), "must be 2-D"),
    (Image(torch.randn(16, ROW_WIDTH)), "three integers"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 4, 4)), "needs t*h*w = 16"),
    (Image(torch.randn(32, ROW_WIDTH), (2, 4, 4)), "t == 1"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 3, 4)), "multiples of the spatial merge size"),
    (Video(torch.randn(24, ROW_WIDTH), (2, 4, 4)), "needs t*h*w = 32"),
    (Image(torch.randn(0, ROW_WIDTH), (1, 0, 4)), "zero or negative"),
)

CASE_FIELDS = {
    "make_encoder": make_encoder,
    "reference": reference,
    "item_for": item_for,
    "bad_items": BAD_ITEMS,
    "budgets": (16, 32, 64),
}
