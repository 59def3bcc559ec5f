"""DeepSeek-OCR-2 (DeepseekOcr2VisionModel + multi_modal_projector + view_separator, two paths)
under the adapter conformance suite, and the tiny model its own tests share.

The tiny model keeps the release's tile sizes (1024² global views, 768² crops, 16-pixel patches):
the tower sizes its position table from them and picks its query table (256 or 144 queries) by
the SAM token count, so smaller tiles would change the family's shape. It is small in width and
depth instead. Hugging Face's SAM initialises to about 1e-10, which makes every image token alike
(any attention mask then gives the same answer), so the vision weights are randomized.

The suite checks parts: an item built for a crops spec carries a fixed global view beside its
crops, and the reference gives that item's crops' outputs alone (Hugging Face's vision tower and
projector on the crops, as `get_image_features` runs them); for a global spec the item is the
global view alone and the reference is `get_image_features` (its 256 tokens and the separator).
Whole items, crops and global view joined, are checked against `get_image_features` in
test_family_deepseek_ocr2.py.
"""

from __future__ import annotations

import copy

import torch

from family_cases.common import randomize, view_and_crops_case_fields, view_and_crops_features
from vitpool import GraphEncoder

GLOBAL_SIZE = 1024  # 64 x 64 patches of 16 pixels, 16 x 16 = 256 SAM tokens: the 256 queries
LOCAL_SIZE = 768  # 48 x 48 patches, 12 x 12 = 144 SAM tokens: the 144 queries
TOKENS_PER_GLOBAL = 257  # 256 queries and the view separator
TOKENS_PER_CROP = 144
TEXT_WIDTH = 48
TINY_SAM = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "global_attn_indexes": [1],  # layer 0 windowed (14 x 14), layer 1 global
    "output_channels": 16,
    "downsample_channels": [16, 64],  # the last is the encoder's width
    "mlp_ratio": 2.0,
}
TINY_ENCODER = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention, as the release's 14 / 2
    "intermediate_size": 128,
    "vocab_size": 1,
    "max_position_embeddings": 512,
}
TINY_TEXT = {
    "hidden_size": TEXT_WIDTH,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "vocab_size": 32,
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
    "mlp_layer_types": ["dense"],
}
GLOBAL_ROW_SHAPE = (3, GLOBAL_SIZE, GLOBAL_SIZE)
LOCAL_ROW_SHAPE = (3, LOCAL_SIZE, LOCAL_SIZE)


def hf_model(seed: int = 0) -> torch.nn.Module:
    """The full model with unit-scale random vision, projector and separator weights."""
    from transformers import DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration

    config = DeepseekOcr2Config(
        vision_config={"sam_config": dict(TINY_SAM), "encoder_config": dict(TINY_ENCODER)},
        text_config=dict(TINY_TEXT),
    )
    config._attn_implementation = "sdpa"
    model = DeepseekOcr2ForConditionalGeneration(config)
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        sam = model.model.vision_tower.sam_encoder
        # randomize scales a 4-D table by its size (to ~0); positions must matter
        sam.pos_embed.copy_(torch.randn(sam.pos_embed.shape, generator=generator))
        model.model.view_separator.copy_(torch.randn(TEXT_WIDTH, generator=generator))
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.deepseek_ocr2.adapter import DeepseekOcr2Adapter
    from vitpool.families.deepseek_ocr2.tower import DeepseekOcr2Encoder

    module = DeepseekOcr2Encoder(
        copy.deepcopy(model.model.vision_tower),
        copy.deepcopy(model.model.multi_modal_projector),
        model.model.view_separator,
        LOCAL_SIZE,
    )
    return GraphEncoder(DeepseekOcr2Adapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


# What the model hands its LLM for one image (crops' tokens, then the view's, then the separator)
image_features = view_and_crops_features

# local budgets of 1 and 3 crops, global budgets of 1 and 2 views
CASE_FIELDS = view_and_crops_case_fields(
    hf_model,
    encoder_of,
    lambda model: model.model.vision_tower,
    GLOBAL_ROW_SHAPE,
    LOCAL_ROW_SHAPE,
    (TOKENS_PER_GLOBAL, 2 * TOKENS_PER_GLOBAL),
)
