"""Model families by the vision config's `model_type`: how to read the config, build the tower
and wrap it in its adapter.

A family in vitpool is one line in `FAMILIES`. A family that lives elsewhere (out of tree, or a
test's) registers itself with `register_family` when its module is imported; name that module
in the environment variable `VITPOOL_FAMILY_MODULES` (comma-separated module names, importable
where the encoder runs) and every lookup imports it first. Ray actors inherit the driver's
environment, so a family named there reaches the pool's actor processes too.

Importing this module imports neither torch nor transformers: each family's callables import
their modeling code when called.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitpool.errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from vitpool.models.protocol import VisionAdapter

FAMILY_MODULES_VARIABLE = "VITPOOL_FAMILY_MODULES"


def read_hf_config(directory: Path) -> Any:
    """The config of a tower-only Hugging Face save, through transformers' AutoConfig."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def vision_config_of(full_config: Any) -> Any:
    """The vision sub-config of a full multimodal model's config."""
    return full_config.vision_config


@dataclass(frozen=True)
class CheckpointLayout:
    """Where a family's weights sit in a full multimodal checkpoint and how they become the state
    of the module `build_tower` makes.

    Attributes:
        prefixes: the full checkpoint's keys that belong to the module start with one of these
            (only shards holding such keys are opened).
        tower_config: the full model's config -> the config `build_tower` takes (default: its
            `vision_config`). A family whose module holds more than the tower (a projector that
            needs the LLM's width) adds what it needs here.
        convert: (the tensors under `prefixes`, keyed as saved; the tower config) -> the module's
            state. Also given a tower-only save's tensors, so it maps the module's own keys to
            themselves. Default: strip the prefix.
        read_full_config: the full model's config.json, parsed -> the config `build_tower` takes,
            for a release whose config only its own remote code reads (transformers' AutoConfig
            does not know its model_type); the loader then skips AutoConfig and `tower_config`.
            A ValueError it raises becomes a CheckpointError naming the directory.
    """

    prefixes: tuple[str, ...] = ("model.visual.", "visual.")
    tower_config: Callable[[Any], Any] = vision_config_of
    convert: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]] | None = None
    read_full_config: Callable[[dict[str, Any]], Any] | None = None


@dataclass(frozen=True)
class Family:
    """How to build one model family's tower and adapter.

    Attributes:
        build_tower: (vision config, dtype) -> the tower with fresh weights; called inside
            `torch.device(device)`, so its tensors are made on the target device.
        adapter: tower (weights loaded, in eval mode) -> its `VisionAdapter`.
        read_config: a tower-only checkpoint directory -> its vision config (default: AutoConfig).
        checkpoint: where its weights sit in a full checkpoint (default: the Qwen and GLM layout,
            the tower under `model.visual.` or `visual.`).
    """

    build_tower: Callable[[Any, torch.dtype], torch.nn.Module]
    adapter: Callable[[torch.nn.Module], VisionAdapter]
    read_config: Callable[[Path], Any] = read_hf_config
    checkpoint: CheckpointLayout = CheckpointLayout()


def _hf_tower(module: str, class_name: str) -> Callable[[Any, torch.dtype], torch.nn.Module]:
    """A builder of the Hugging Face tower `module.class_name`, imported when first called."""

    def build(config: Any, dtype: torch.dtype) -> torch.nn.Module:
        return getattr(importlib.import_module(module), class_name)._from_config(config, dtype=dtype)

    return build


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """`module.name` (an adapter class or a builder), imported when first called. What a
    transformers release removed (a helper the module imports, an attribute of the tower the
    adapter reads) fails this family alone, with the installed and the tested versions named."""

    def call(*args: Any) -> Any:
        try:
            return getattr(importlib.import_module(module), name)(*args)
        except (ImportError, AttributeError) as error:
            from vitpool.models.compat import incompatible

            raise incompatible(f"{module}.{name}", f"{type(error).__name__}: {error}") from error

    return call


_QWEN3_VL = _lazy("vitpool.models.qwen3_vl", "Qwen3VLAdapter")
_QWEN3_5 = _lazy("vitpool.models.qwen3_5", "Qwen3_5Adapter")
_GLM4V = _lazy("vitpool.models.glm4v", "Glm4vAdapter")


# Keyed by the vision config's model_type; a new family adds one line here and one adapter file.
FAMILIES: dict[str, Family] = {
    # Kimi-K2.5 / K2.6 (kimi_k25): Kimi_K25VisionModel + mm_projector, Moonshot's or transformers' keys
    "kimi_k25_vision": Family(
        _lazy("vitpool.models.kimi_k25", "build_encoder"),
        _lazy("vitpool.models.kimi_k25", "KimiK25Adapter"),
        checkpoint=CheckpointLayout(
            prefixes=("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector."),
            tower_config=_lazy("vitpool.models.kimi_k25", "tower_only_config"),
            convert=_lazy("vitpool.models.kimi_k25", "convert_checkpoint"),
        ),
    ),
    # InternVL 3 / 3.5 (internvl): InternVLVisionModel + multi_modal_projector, transformers' keys
    "internvl_vision": Family(
        _lazy("vitpool.models.internvl", "build_encoder"),
        _lazy("vitpool.models.internvl", "InternVLAdapter"),
        checkpoint=CheckpointLayout(
            prefixes=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector."),
            tower_config=_lazy("vitpool.models.internvl", "tower_only_config"),
            convert=_lazy("vitpool.models.internvl", "convert_checkpoint"),
        ),
    ),
    # InternVL 2 / 2.5 / 3 as OpenGVLab released them (config "internvl_chat", remote code): InternViT
    # (every size is "intern_vit_6b") under vision_model. with a fused qkv, the projector as mlp1
    "intern_vit_6b": Family(
        _lazy("vitpool.models.internvl", "build_encoder"),
        _lazy("vitpool.models.internvl", "InternVLAdapter"),
        read_config=_lazy("vitpool.models.internvl", "refuse_tower_release"),
        checkpoint=CheckpointLayout(
            prefixes=("vision_model.", "mlp1."),
            convert=_lazy("vitpool.models.internvl", "convert_checkpoint"),
            read_full_config=_lazy("vitpool.models.internvl", "release_config"),
        ),
    ),
    # Llama 4 Scout / Maverick (llama4): Llama4VisionModel + multi_modal_projector
    "llama4_vision_model": Family(
        _lazy("vitpool.models.llama4", "build_encoder"),
        _lazy("vitpool.models.llama4", "Llama4Adapter"),
        checkpoint=CheckpointLayout(
            prefixes=("vision_model.", "multi_modal_projector."),
            tower_config=_lazy("vitpool.models.llama4", "tower_only_config"),
            convert=_lazy("vitpool.models.llama4", "convert_checkpoint"),
        ),
    ),
    # DeepSeek-OCR-2 (deepseek_ocr2): SAM + Qwen2 encoder + multi_modal_projector + view_separator, two paths
    "deepseek_ocr2_vision": Family(
        _lazy("vitpool.models.deepseek_ocr2", "build_encoder"),
        _lazy("vitpool.models.deepseek_ocr2", "DeepseekOcr2Adapter"),
        checkpoint=CheckpointLayout(
            prefixes=(
                "model.vision_tower.", "model.multi_modal_projector.", "model.view_separator",
                "model.sam_model.", "model.qwen2_model.", "model.projector.", "model.view_seperator",
            ),
            tower_config=_lazy("vitpool.models.deepseek_ocr2", "tower_only_config"),
            convert=_lazy("vitpool.models.deepseek_ocr2", "convert_checkpoint"),
        ),
    ),
    # MiniCPM-V 4.6 (minicpmv4_6): MiniCPMV4_6VisionModel + MiniCPMV4_6Merger, transformers' keys
    "minicpmv4_6_vision": Family(
        _lazy("vitpool.models.minicpmv4_6", "build_encoder"),
        _lazy("vitpool.models.minicpmv4_6", "MiniCPMV4_6Adapter"),
        checkpoint=CheckpointLayout(
            prefixes=("model.vision_tower.", "model.merger.", "vision_tower.", "merger."),
            tower_config=_lazy("vitpool.models.minicpmv4_6", "tower_only_config"),
            convert=_lazy("vitpool.models.minicpmv4_6", "convert_checkpoint"),
        ),
    ),
    # Step-3.7 (step3p7): Step3p7VisionModel + multi_modal_projector, two paths (global view, crops)
    "step3p5_vision": Family(
        _lazy("vitpool.models.step3p7", "build_encoder"),
        _lazy("vitpool.models.step3p7", "Step3p7Adapter"),
        checkpoint=CheckpointLayout(
            prefixes=(
                "model.vision_model.", "model.multi_modal_projector.", "vision_model.", "multi_modal_projector.",
                "vit_large_projector.",
            ),
            tower_config=_lazy("vitpool.models.step3p7", "tower_only_config"),
            convert=_lazy("vitpool.models.step3p7", "convert_checkpoint"),
        ),
    ),
    # PaddleOCR-VL (paddleocr_vl): PaddleOCRVisionModel + projector, transformers' or the release's keys
    "paddleocr_vl_vision": Family(
        _lazy("vitpool.models.paddleocr_vl", "build_encoder"),
        _lazy("vitpool.models.paddleocr_vl", "PaddleOCRVLAdapter"),
        checkpoint=CheckpointLayout(
            prefixes=("model.visual.", "visual.", "model.projector.", "mlp_AR.", "projector."),
            tower_config=_lazy("vitpool.models.paddleocr_vl", "tower_only_config"),
            convert=_lazy("vitpool.models.paddleocr_vl", "convert_checkpoint"),
        ),
    ),
    "qwen2_5_vl_vision": Family(  # Qwen2.5-VL (qwen2_5_vl)
        _hf_tower(
            "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"
        ),
        _lazy("vitpool.models.qwen2_5_vl", "Qwen2_5_VLAdapter"),
    ),
    "glm4v_vision": Family(  # GLM-4.1V (glm4v), GLM-4.6V (glm46v)
        _hf_tower("transformers.models.glm4v.modeling_glm4v", "Glm4vVisionModel"), _GLM4V
    ),
    "glm4v_moe_vision": Family(  # GLM-4.5V (glm4v_moe)
        _hf_tower("transformers.models.glm4v_moe.modeling_glm4v_moe", "Glm4vMoeVisionModel"), _GLM4V
    ),
    "qwen2_vl_vision": Family(
        _hf_tower("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
        _lazy("vitpool.models.qwen2_vl", "Qwen2VLAdapter"),
    ),
    "qwen3_5_vision": Family(
        _hf_tower("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5VisionModel"), _QWEN3_5
    ),
    "qwen3_5_moe_vision": Family(
        _hf_tower("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeVisionModel"), _QWEN3_5
    ),
    "qwen3_vl_vision": Family(
        _hf_tower("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"), _QWEN3_VL
    ),
    "qwen3_vl_moe_vision": Family(
        _hf_tower("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeVisionModel"),
        _QWEN3_VL,
    ),
}


def register_family(model_type: str, family: Family) -> None:
    """Make `model_type` loadable; a family module calls this when imported (registering the
    same type again replaces the earlier entry)."""
    FAMILIES[model_type] = family


def find_family(model_type: str) -> Family | None:
    """The family of `model_type`, after importing the modules named in VITPOOL_FAMILY_MODULES;
    None if no family has that type.

    Raises:
        CheckpointError: a module named there cannot be imported.
    """
    import_family_modules()
    return FAMILIES.get(model_type)


def supported_model_types() -> list[str]:
    import_family_modules()
    return sorted(FAMILIES)


def import_family_modules() -> None:
    """Import the modules named in VITPOOL_FAMILY_MODULES (each registers its families); Python
    caches imported modules, so calling this again costs a dictionary lookup per name."""
    for name in os.environ.get(FAMILY_MODULES_VARIABLE, "").split(","):
        name = name.strip()
        if not name:
            continue
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise CheckpointError(
                f"{FAMILY_MODULES_VARIABLE} names module {name!r}, which cannot be imported ({error}); "
                "fix the name or put the module on PYTHONPATH where the encoder runs"
            ) from None
