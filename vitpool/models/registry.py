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


@dataclass(frozen=True)
class Family:
    """How to build one model family's tower and adapter.

    Attributes:
        build_tower: (vision config, dtype) -> the tower with fresh weights; called inside
            `torch.device(device)`, so its tensors are made on the target device.
        adapter: tower (weights loaded, in eval mode) -> its `VisionAdapter`.
        read_config: a tower-only checkpoint directory -> its vision config (default: AutoConfig).
    """

    build_tower: Callable[[Any, torch.dtype], torch.nn.Module]
    adapter: Callable[[torch.nn.Module], VisionAdapter]
    read_config: Callable[[Path], Any] = read_hf_config


def _qwen3_vl_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return Qwen3VLVisionModel._from_config(config, dtype=dtype)


def _qwen3_vl_moe_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    return Qwen3VLMoeVisionModel._from_config(config, dtype=dtype)


def _qwen3_vl_adapter(tower: torch.nn.Module) -> VisionAdapter:
    from vitpool.models.qwen3_vl import Qwen3VLAdapter

    return Qwen3VLAdapter(tower)


def _qwen3_5_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    return Qwen3_5VisionModel._from_config(config, dtype=dtype)


def _qwen3_5_moe_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    return Qwen3_5MoeVisionModel._from_config(config, dtype=dtype)


def _qwen3_5_adapter(tower: torch.nn.Module) -> VisionAdapter:
    from vitpool.models.qwen3_5 import Qwen3_5Adapter

    return Qwen3_5Adapter(tower)


def _qwen2_vl_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    return Qwen2VisionTransformerPretrainedModel._from_config(config, dtype=dtype)


def _qwen2_vl_adapter(tower: torch.nn.Module) -> VisionAdapter:
    from vitpool.models.qwen2_vl import Qwen2VLAdapter

    return Qwen2VLAdapter(tower)


def _glm4v_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    return Glm4vVisionModel._from_config(config, dtype=dtype)


def _glm4v_moe_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeVisionModel

    return Glm4vMoeVisionModel._from_config(config, dtype=dtype)


def _glm4v_adapter(tower: torch.nn.Module) -> VisionAdapter:
    from vitpool.models.glm4v import Glm4vAdapter

    return Glm4vAdapter(tower)


def _qwen2_5_vl_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype)


def _qwen2_5_vl_adapter(tower: torch.nn.Module) -> VisionAdapter:
    from vitpool.models.qwen2_5_vl import Qwen2_5_VLAdapter

    return Qwen2_5_VLAdapter(tower)


def _kimi_k25_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    from vitpool.models.kimi_k25 import build_encoder

    return build_encoder(config, dtype)  # Kimi_K25VisionModel + mm_projector


def _kimi_k25_adapter(tower: torch.nn.Module) -> VisionAdapter:
    from vitpool.models.kimi_k25 import KimiK25Adapter

    return KimiK25Adapter(tower)


# Keyed by the vision config's model_type; a new family adds one line here and one adapter file.
FAMILIES: dict[str, Family] = {
    "kimi_k25_vision": Family(_kimi_k25_tower, _kimi_k25_adapter),  # Kimi-K2.5 / K2.6 (kimi_k25)
    "qwen2_5_vl_vision": Family(_qwen2_5_vl_tower, _qwen2_5_vl_adapter),  # Qwen2.5-VL (qwen2_5_vl)
    "glm4v_vision": Family(_glm4v_tower, _glm4v_adapter),  # GLM-4.1V (glm4v), GLM-4.6V (glm46v)
    "glm4v_moe_vision": Family(_glm4v_moe_tower, _glm4v_adapter),  # GLM-4.5V (glm4v_moe)
    "qwen2_vl_vision": Family(_qwen2_vl_tower, _qwen2_vl_adapter),
    "qwen3_5_vision": Family(_qwen3_5_tower, _qwen3_5_adapter),
    "qwen3_5_moe_vision": Family(_qwen3_5_moe_tower, _qwen3_5_adapter),
    "qwen3_vl_vision": Family(_qwen3_vl_tower, _qwen3_vl_adapter),
    "qwen3_vl_moe_vision": Family(_qwen3_vl_moe_tower, _qwen3_vl_adapter),
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
