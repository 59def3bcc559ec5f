"""InternVL's checkpoints: transformers' layout (the tower under `vision_tower.`, the projector
under `multi_modal_projector.`, both under `model.` in a full checkpoint) and OpenGVLab's own
releases (InternVL2 / 2.5 / 3, remote code `InternVLChatModel`: config.json of model_type
"internvl_chat" with the tower's config, model_type "intern_vit_6b" for every size, and the LLM's
`llm_config`; the tower under `vision_model.` with a fused `qkv`, the projector as `mlp1`), read
as transformers' converter (convert_internvl_weights_to_hf.py) does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from vitpool.errors import CheckpointError

# Keys of a release checkpoint that belong to the tower or the projector.
RELEASE_PREFIXES = ("vision_model.", "mlp1.")
# Release key -> the module's key, applied in order (the renames of transformers' converter,
# anchored where each name sits). `mlp1` is nn.Sequential(LayerNorm, Linear, GELU, Linear).
_RELEASE_RENAMES = tuple(
    (re.compile(pattern), target)
    for pattern, target in (
        (r"^vision_model\.", "vision_tower."),
        (r"\.embeddings\.class_embedding$", ".embeddings.cls_token"),
        (r"\.embeddings\.position_embedding$", ".embeddings.position_embeddings"),
        (r"\.embeddings\.patch_embedding\.", ".embeddings.patch_embeddings.projection."),
        (r"\.encoder\.layers\.(\d+)\.", r".encoder.layer.\1."),
        (r"\.ls([12])$", r".lambda_\1"),
        (r"\.attn\.proj\.", ".attention.projection_layer."),
        (r"\.attn\.", ".attention."),  # qkv (split below), q_norm, k_norm
        (r"\.norm1\.", ".layernorm_before."),
        (r"\.norm2\.", ".layernorm_after."),
        (r"^mlp1\.0\.", "multi_modal_projector.layer_norm."),
        (r"^mlp1\.1\.", "multi_modal_projector.linear_1."),
        (r"^mlp1\.3\.", "multi_modal_projector.linear_2."),
    )
)
_FUSED_QKV = re.compile(r"^(vision_tower\.encoder\.layer\.\d+\.attention\.)qkv\.(weight|bias)$")
# InternVisionConfig's defaults (the release's remote code) for a field its config.json leaves out.
RELEASE_VISION_DEFAULTS = {
    "num_channels": 3,
    "patch_size": 14,
    "image_size": 224,
    "qkv_bias": False,
    "hidden_size": 3200,
    "num_attention_heads": 25,
    "intermediate_size": 12800,
    "qk_normalization": True,
    "num_hidden_layers": 48,
    "hidden_act": "gelu",
    "norm_type": "rms_norm",
    "layer_norm_eps": 1e-6,
}
# transformers' q_norm / k_norm take RMSNorm's default epsilon, the release's take layer_norm_eps.
QK_NORM_EPS = 1e-6


def encoder_state(checkpoint: dict[str, torch.Tensor], config: Any = None) -> dict[str, torch.Tensor]:
    """The loader's hook (`InternVLAdapter.convert_checkpoint`): the module's state from a
    checkpoint in any of three layouts.

    Args:
        checkpoint: tensors keyed as saved: transformers' full checkpoint (`model.vision_tower.*`,
            `model.multi_modal_projector.*`), a tower-only save (the module's own keys), or the
            release's (`vision_model.*` with each layer's fused `attn.qkv`, `mlp1.*`).
        config: the tower config (unused: the fused qkv splits into three equal row blocks).

    Returns:
        `InternVLEncoder`'s state: `vision_tower.*` and `multi_modal_projector.*`.
    """
    state: dict[str, torch.Tensor] = {}
    for key, tensor in checkpoint.items():
        if not key.startswith(RELEASE_PREFIXES):
            state[key.removeprefix("model.")] = tensor
            continue
        name = key
        for pattern, target in _RELEASE_RENAMES:
            name = pattern.sub(target, name)
        if match := _FUSED_QKV.match(name):
            prefix, kind = match.groups()
            # qkv: [3 * hidden, hidden] rows q, then k, then v (heads in order within each)
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0), strict=True):
                state[f"{prefix}{part}.{kind}"] = rows
        else:
            state[name] = tensor
    return state


# Its long-standing name.
convert_checkpoint = encoder_state


def release_config(raw: dict[str, Any]) -> Any:
    """The config `build_encoder` takes, from a release's config.json (InternVLChatConfig).

    The tower's config becomes transformers' `InternVLVisionConfig` as its converter makes it
    (`qkv_bias` -> `attention_bias`, `qk_normalization` -> `use_qk_norm`; a field left out takes
    the remote code's default), with PROJECTOR_FIELDS: `text_hidden_size` from
    `llm_config.hidden_size`, `downsample_ratio`, `select_layer` as `vision_feature_layer`.

    Raises:
        ValueError: no `llm_config.hidden_size`, or a setting whose forward transformers' model
            does not run: `ps_version` "v1" (the remote code's default), `force_image_size` other
            than the tower's `image_size`, q/k norm with `layer_norm_eps` other than 1e-6.
    """
    from transformers import InternVLVisionConfig

    vision = {**RELEASE_VISION_DEFAULTS, **(raw.get("vision_config") or {})}
    text_hidden_size = (raw.get("llm_config") or {}).get("hidden_size")
    if not isinstance(text_hidden_size, int):
        raise ValueError(  # noqa: TRY004 - loading turns this function's ValueErrors into CheckpointError
            "an InternVL release config needs llm_config.hidden_size (the projector's width)"
        )
    ps_version = raw.get("ps_version", "v1")
    if ps_version != "v2":
        raise ValueError(
            f"InternVL ps_version {ps_version!r} (InternVL 1.5 and earlier; the remote code's default "
            "where config.json names none): vitpool, like transformers, runs only the pixel shuffle of "
            "'v2', which InternVL2 / 2.5 / 3 use"
        )
    forced = raw.get("force_image_size")
    if forced is not None and forced != vision["image_size"]:
        raise ValueError(
            f"InternVL force_image_size {forced} differs from vision_config.image_size "
            f"{vision['image_size']}: vitpool runs tiles of the tower's own size"
        )
    if vision["qk_normalization"] and vision["layer_norm_eps"] != QK_NORM_EPS:
        raise ValueError(
            f"InternViT with qk_normalization and layer_norm_eps {vision['layer_norm_eps']}: transformers' "
            f"q/k norms use {QK_NORM_EPS}, so its forward would differ from the release's"
        )
    config = InternVLVisionConfig(
        hidden_size=vision["hidden_size"],
        num_hidden_layers=vision["num_hidden_layers"],
        num_attention_heads=vision["num_attention_heads"],
        intermediate_size=vision["intermediate_size"],
        attention_bias=vision["qkv_bias"],
        use_qk_norm=vision["qk_normalization"],
        hidden_act=vision["hidden_act"],
        norm_type=vision["norm_type"],
        layer_norm_eps=vision["layer_norm_eps"],
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        num_channels=vision["num_channels"],
        use_absolute_position_embeddings=True,
        use_mean_pooling=True,  # no norm after the last layer, as in the release
    )
    config.text_hidden_size = text_hidden_size
    config.downsample_ratio = raw.get("downsample_ratio", 0.5)
    config.projector_hidden_act = "gelu"  # mlp1's nn.GELU()
    config.vision_feature_layer = raw.get("select_layer", -1)
    config.vision_feature_select_strategy = "default"  # extract_feature drops the class token
    return config


def refuse_tower_release(directory: Path) -> Any:
    """`Family.read_config` of a directory whose config.json is InternViT's alone (model_type
    "intern_vit_6b" at the top: InternViT-300M-448px, InternViT-6B-448px-V2_5).

    Raises:
        CheckpointError: always; such a release has no projector.
    """
    raise CheckpointError(
        f"{directory} holds an InternViT tower alone (model_type 'intern_vit_6b'), without the projector "
        "vitpool runs after it; load the InternVL chat model's directory (config model_type "
        "'internvl_chat', weights vision_model.* and mlp1.*) instead"
    )
