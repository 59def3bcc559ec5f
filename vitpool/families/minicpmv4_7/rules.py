"""Item rules of MiniCPM-V 4.7: MiniCPM-V 4.6's (`vitpool.families.minicpmv4_6.rules`), whose
items, layouts and token counts 4.7 shares (the same image processor and vision path), naming 4.7
where they refuse a video.

Importing neither torch nor transformers (a pool's callers unpickle these rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitpool.families.minicpmv4_6.rules import MiniCPMV4_6Rules
from vitpool.specs import VIDEO, ItemSpec


@dataclass(frozen=True)
class MiniCPMV4_7Rules(MiniCPMV4_6Rules):
    """MiniCPM-V 4.7's items: Images of patch rows [sum h*w, C, P, P] (or the processor's strip
    [1, C, P, N*P]) with the processor's `target_sizes` [[h, w], ...], one row per slice."""

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality == VIDEO:
            raise ValueError("MiniCPM-V 4.7 takes images only here; pass each frame's slices as an Image")
        return super().item_spec(modality, pixel_shape, pixel_dtype, layout)
