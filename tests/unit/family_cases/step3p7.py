"""Step-3.7 (Step3p7VisionModel + multi_modal_projector, two paths) under the adapter conformance
suite, and the tiny model its own tests share.

The suite checks parts: an item built for a crops spec carries a fixed global view beside its
crops, and the reference gives that item's crops' outputs alone (Hugging Face's vision model and
projector on the crops, as `get_image_features` runs them); for a global spec the item is the
global view alone and the reference is `get_image_features`. Whole items, crops and global view
joined, are checked against `get_image_features` in test_path_families.py.
"""

from __future__ import annotations

import copy

import torch

from family_cases.common import randomize, view_and_crops_case_fields, view_and_crops_features
from vitpool import GraphEncoder

GLOBAL_SIZE = 56  # 8 x 8 patches of 7 pixels, 2 x 2 = 4 tokens after the 4x downsampling
LOCAL_SIZE = 28  # 4 x 4 patches, 1 token
TOKENS_PER_GLOBAL = 4
TOKENS_PER_CROP = 1
TINY_VISION = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": GLOBAL_SIZE,
    "patch_size": 7,
    "mlp_ratio": 2.0,
    "max_position_embeddings": 64,
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "head_dim": 24,
    "vocab_size": 128,
    "moe_num_experts": 2,
    "moe_top_k": 1,
}
GLOBAL_ROW_SHAPE = (3, GLOBAL_SIZE, GLOBAL_SIZE)
LOCAL_ROW_SHAPE = (3, LOCAL_SIZE, LOCAL_SIZE)


def hf_model(seed: int = 0) -> torch.nn.Module:
    """The full model with unit-scale random vision and projector weights."""
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    config = Step3p7Config(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT))
    config._attn_implementation = "sdpa"
    model = Step3p7ForConditionalGeneration(config)
    randomize(model.model.vision_model, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.step3p7.adapter import Step3p7Adapter, Step3p7Encoder

    module = Step3p7Encoder(
        copy.deepcopy(model.model.vision_model), copy.deepcopy(model.model.multi_modal_projector), LOCAL_SIZE
    )
    return GraphEncoder(Step3p7Adapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


# What the model hands its LLM for one image (crops' tokens, then the view's)
image_features = view_and_crops_features

CASE_FIELDS = view_and_crops_case_fields(
    hf_model,
    encoder_of,
    lambda model: model.model.vision_model,
    GLOBAL_ROW_SHAPE,
    LOCAL_ROW_SHAPE,
    (4, 8, 16),
)
