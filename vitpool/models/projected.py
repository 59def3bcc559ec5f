"""Building a tower together with the projector its model puts after it (Kimi-K2.5, PaddleOCR-VL,
InternVL, Llama 4: the families whose vitpool module runs the projector in the graph)."""

from __future__ import annotations

from typing import Any

import torch


def tower_and_projector(
    tower_class: Any, projector_class: Any, full_config: Any, dtype: torch.dtype | None
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Fresh `tower_class` from `full_config.vision_config` and `projector_class(full_config)`,
    both in `dtype` (None: the classes' defaults). `full_config` is the full model's config, or
    a stand-in with what the projector reads."""
    vision_config = full_config.vision_config
    if dtype is None:
        return tower_class(vision_config), projector_class(full_config)
    return tower_class._from_config(vision_config, dtype=dtype), projector_class(full_config).to(dtype)
