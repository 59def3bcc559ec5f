"""Building a tower together with the projector its model puts after it (the families whose
vitpool module runs the projector in the graph), and checking that a tower-only config carries what
that projector reads."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class TowerWithProjector(torch.nn.Module):
    """A vision tower and the projector its model puts after it, under the names its state keys
    use (`vision_tower.*`, `multi_modal_projector.*`); `config` is the tower's."""

    def __init__(self, vision_tower: torch.nn.Module, multi_modal_projector: torch.nn.Module) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = multi_modal_projector
        self.config = vision_tower.config


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


def require_fields(config: Any, fields: Iterable[str], subject: str, instead: str) -> None:
    """Raise ValueError, "<subject> needs [the missing ones] <instead>", where `config` lacks any of
    `fields` (a tower-only vision config must carry what its family's projector reads)."""
    missing = [name for name in fields if getattr(config, name, None) is None]
    if missing:
        raise ValueError(f"{subject} needs {missing} {instead}")
