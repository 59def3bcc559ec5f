"""dots.3 Note (Dots3NoteVisionModel, its merger and mixture-of-experts blocks included) under the
adapter conformance suite, and the tiny models its own tests share. The reference is the Hugging
Face model's own `get_image_features` (SDPA, the experts' eager implementation: the per-expert loop
the static path replaces) on each item alone; its `get_video_features` is the same call."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from family_cases.common import randomize
from family_cases.qwen2_vl import spatial_merge_case_fields
from vitpool import GraphEncoder

# Why the family's tests skip here (None: they run): transformers 5.17 (the GPU machine's, the
# range's lower bound) has no dots.3 Note; 5.24 has it
TOO_OLD = (
    None
    if importlib.util.find_spec("transformers.models.dots3_note") is not None
    else "dots.3 Note needs a transformers with transformers.models.dots3_note (5.24 has it; 5.17 does not)"
)

PATCH = 2
MERGE = 2
ROW_WIDTH = 3 * PATCH * PATCH  # no temporal patch: one frame's patch a row
TEXT_WIDTH = 48
NUM_EXPERTS = 4
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": PATCH,
    "spatial_merge_size": MERGE,
    "adapter_in_dim": 32,
    "adapter_out_dim": TEXT_WIDTH,
    # the release's schedule in small: a dense block, then a block of routed experts (top 2)
    "pyramid_num_routed": [-1, NUM_EXPERTS],
}
# The smallest text model Dots3Note builds: MLA attention, the DSA indexer, MoE with a shared expert
TINY_TEXT = {
    "hidden_size": TEXT_WIDTH,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
}
TINY_AUDIO = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "adapter_input_size": 32,
    "adapter_out_dim": TEXT_WIDTH,
    "downsample_hidden_size": 16,
    "feature_size": 16,
}
IMAGE_TOKEN, VIDEO_TOKEN, AUDIO_TOKEN = 120, 121, 122  # the placeholders' ids, in the tiny vocabulary


def full_config(**vision_settings: Any) -> Any:
    from transformers import Dots3NoteConfig

    return Dots3NoteConfig(
        vision_config={**TINY_VISION, **vision_settings},
        text_config=dict(TINY_TEXT),
        audio_config=dict(TINY_AUDIO),
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        audio_token_id=AUDIO_TOKEN,
    )


def eager_experts(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every experts module on transformers' eager loop (each holds its own per-layer
    config, which `set_experts_implementation` does not reach)."""
    for part in module.modules():
        if hasattr(part, "gate_up_proj"):
            part.config._experts_implementation = "eager"
    return module


def hf_model(seed: int = 0, **vision_settings: Any) -> torch.nn.Module:
    """The full tiny Hugging Face model, its vision tower random at unit scale (the router and its
    correction bias too, so that routing depends on every token), SDPA, eager experts."""
    from transformers import Dots3NoteForConditionalGeneration

    model = Dots3NoteForConditionalGeneration(full_config(**vision_settings))
    tower = randomize(model.model.vision_tower, seed)
    with torch.no_grad():
        for name, buffer in tower.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)))
    model.config.vision_config._attn_implementation = "sdpa"
    return eager_experts(model).eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.dots3_note.adapter import Dots3NoteAdapter

    # a copy: the adapter switches the tower's attention and experts to vitpool's static path
    tower = copy.deepcopy(model.model.vision_tower)
    return GraphEncoder(Dots3NoteAdapter(tower), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What `get_image_features` (or `get_video_features`) gives the LLM for this item alone."""
    grid = torch.as_tensor(item.grid_thw).reshape(1, 3).long()
    pixels = torch.as_tensor(item.pixel_values).float()
    with torch.no_grad():
        return model.model.get_image_features(pixels, grid).pooler_output[0]


_SHARED: dict[str, torch.nn.Module] = {}


def shared_model() -> torch.nn.Module:
    if "model" not in _SHARED:
        _SHARED["model"] = hf_model()
    return _SHARED["model"]


def make_encoder(budgets: list[int]) -> GraphEncoder:
    return encoder_of(shared_model(), budgets)


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    return lambda item: [image_features(shared_model(), item)]


def save_tower(directory: Path) -> Path:
    """A tower-only save of the tiny tower (transformers writes the release's layout back)."""
    shared_model().model.vision_tower.save_pretrained(directory)
    return directory


BUDGETS = (16, 32, 64)
CASE_FIELDS = spatial_merge_case_fields(make_encoder, reference, ROW_WIDTH, BUDGETS)
