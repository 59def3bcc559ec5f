"""InternVL (InternViT + multi_modal_projector) under the adapter conformance suite, and the tiny
models its own tests share: the 300M style (LayerNorm, qkv bias) and the 6B style (RMSNorm, q/k
RMSNorm, no qkv bias), each also written as OpenGVLab's release saves it (config.json of
"internvl_chat", `vision_model.*` with fused qkv, `mlp1.*`). The reference is Hugging Face's full
model's `get_image_features` on one item's tiles alone (tower, class token dropped, pixel shuffle,
projector)."""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

from family_cases.common import randomize, tiled_case_fields
from vitpool import GraphEncoder

TILE = 8  # pixels per tile side; patches of 2 pixels: 16 patches, 4 tokens a tile after the shuffle
TOKENS_PER_TILE = 4
TINY_VISION = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "image_size": TILE,
    "patch_size": 2,
}
TINY_TEXT = {
    "model_type": "qwen2",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
# InternViT-6B's tower settings (InternVL2-26B / 40B / 76B, InternVL2.5 and 3 at 26B and up)
TINY_VISION_6B = {**TINY_VISION, "norm_type": "rms_norm", "use_qk_norm": True, "attention_bias": False}
ROW_SHAPE = (3, TILE, TILE)


def full_config(vision: dict[str, Any] = TINY_VISION) -> Any:
    from transformers import InternVLConfig

    config = InternVLConfig(vision_config=dict(vision), text_config=dict(TINY_TEXT))
    config._attn_implementation = "sdpa"
    return config


def hf_model(seed: int = 0, vision: dict[str, Any] = TINY_VISION) -> torch.nn.Module:
    """The full model with unit-scale random vision and projector weights."""
    from transformers import InternVLForConditionalGeneration

    model = InternVLForConditionalGeneration(full_config(vision))
    randomize(model.model.vision_tower, seed)
    randomize(model.model.multi_modal_projector, seed + 1)
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: list[int]) -> GraphEncoder:
    from vitpool.families.internvl.adapter import InternVLAdapter, InternVLEncoder

    module = InternVLEncoder(
        copy.deepcopy(model.model.vision_tower),
        copy.deepcopy(model.model.multi_modal_projector),
        model.config,
    )
    return GraphEncoder(InternVLAdapter(module), budgets=budgets, device="cpu", dtype=torch.float32)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image: [tiles * tokens per tile, text width]."""
    with torch.no_grad():
        tokens = model.model.get_image_features(pixel_values=torch.as_tensor(item.pixel_values)).pooler_output
    return tokens.reshape(-1, tokens.shape[-1])


# The module's key -> the release's, in order: written from the release's names, apart from
# vitpool's own mapping (which the tests check against it). q/k/v are fused after renaming.
_TO_RELEASE = (
    (r"^vision_tower\.", r"vision_model."),
    (r"\.encoder\.layer\.", r".encoder.layers."),
    (r"\.embeddings\.cls_token$", r".embeddings.class_embedding"),
    (r"\.embeddings\.position_embeddings$", r".embeddings.position_embedding"),
    (r"\.embeddings\.patch_embeddings\.projection\.", r".embeddings.patch_embedding."),
    (r"\.attention\.projection_layer\.", r".attn.proj."),
    (r"\.attention\.", r".attn."),
    (r"\.lambda_(\d)$", r".ls\1"),
    (r"\.layernorm_before\.", r".norm1."),
    (r"\.layernorm_after\.", r".norm2."),
    (r"^multi_modal_projector\.layer_norm\.", r"mlp1.0."),
    (r"^multi_modal_projector\.linear_1\.", r"mlp1.1."),
    (r"^multi_modal_projector\.linear_2\.", r"mlp1.3."),
)
_SPLIT_QKV = re.compile(r"^(.*\.attn\.)([qkv])_proj\.(weight|bias)$")


def release_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tower and projector keyed as OpenGVLab's release saves them (InternVLChatModel:
    `vision_model.*` with each layer's q, k, v fused into `attn.qkv`, the projector as `mlp1.*`),
    plus one language-model tensor that the loader must leave alone."""
    module_state = {
        f"{part}.{key}": tensor
        for part in ("vision_tower", "multi_modal_projector")
        for key, tensor in getattr(model.model, part).state_dict().items()
    }
    state: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in module_state.items():
        name = key
        for pattern, target in _TO_RELEASE:
            name = re.sub(pattern, target, name)
        if match := _SPLIT_QKV.match(name):
            prefix, part, kind = match.groups()
            parts.setdefault((prefix, kind), {})[part] = tensor
        else:
            state[name] = tensor.contiguous()
    for (prefix, kind), qkv in parts.items():
        state[f"{prefix}qkv.{kind}"] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])  # [3 * hidden, ...]
    state["language_model.model.embed_tokens.weight"] = torch.zeros(
        TINY_TEXT["vocab_size"], TINY_TEXT["hidden_size"]
    )
    return state


def release_config_json(model: torch.nn.Module) -> dict[str, Any]:
    """config.json of the model as OpenGVLab's release writes it (InternVLChatConfig, with the
    fields its remote code reads and some it does not)."""
    vision = model.config.vision_config
    return {
        "architectures": ["InternVLChatModel"],
        "auto_map": {"AutoModel": "modeling_internvl_chat.InternVLChatModel"},
        "model_type": "internvl_chat",
        "downsample_ratio": model.config.downsample_ratio,
        "dynamic_image_size": True,
        "force_image_size": TILE,
        "max_dynamic_patch": 12,
        "min_dynamic_patch": 1,
        "ps_version": "v2",
        "select_layer": -1,
        "template": "internvl2_5",
        "use_backbone_lora": 0,
        "use_llm_lora": 0,
        "use_thumbnail": True,
        "vision_config": {
            "architectures": ["InternVisionModel"],
            "model_type": "intern_vit_6b",
            "attention_dropout": 0.0,
            "drop_path_rate": 0.1,
            "dropout": 0.0,
            "hidden_act": "gelu",
            "hidden_size": vision.hidden_size,
            "image_size": TILE,
            "initializer_factor": 1.0,
            "initializer_range": 0.02,
            "intermediate_size": vision.intermediate_size,
            "layer_norm_eps": 1e-6,
            "norm_type": vision.norm_type,
            "num_attention_heads": vision.num_attention_heads,
            "num_channels": 3,
            "num_hidden_layers": vision.num_hidden_layers,
            "patch_size": vision.patch_size[0],
            "qk_normalization": vision.use_qk_norm,
            "qkv_bias": vision.attention_bias,
            "use_flash_attn": True,
        },
        "llm_config": {"architectures": ["Qwen2ForCausalLM"], **TINY_TEXT},
    }


TILE_SHAPE = ROW_SHAPE
CASE_FIELDS = tiled_case_fields(hf_model, encoder_of, image_features, ROW_SHAPE, (4, 8, 16))
