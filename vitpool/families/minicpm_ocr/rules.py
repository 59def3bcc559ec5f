"""Item rules of MiniCPM-OCR: MiniCPM-V 4.6's (`vitpool.families.minicpmv4_6.rules`: the same image
processor, strip and `target_sizes`), with the token count of the model's downsample mode.

Importing neither torch nor transformers (a pool's callers unpickle these rules).

MiniCPM-OCR reads text-dense pages in the "4x" mode, its default: the in-tower window merger is
skipped and only the Merger's 2 x 2 merge remains, so a slice of h x w patches gives h*w / 4 tokens
and the processor aligns h and w to multiples of 2. In "16x" (the processor's and the model's
`downsample_mode="16x"`) both merges run, as in MiniCPM-V 4.6: h*w / 16 tokens, multiples of 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vitpool.families.minicpmv4_6.rules import MiniCPMV4_6Rules

FAMILY = "MiniCPM-OCR"
DEFAULT_MODE = "4x"  # MiniCPMOcrConfig's and its image processor's default
# patches per token along each side: the Merger's 2 x 2 merge, after the window merger's in "16x"
MERGE_SIDE = {"4x": 2, "16x": 4}


@dataclass(frozen=True)
class MiniCPMOcrRules(MiniCPMV4_6Rules):
    """MiniCPM-OCR's items: Images of patch rows [sum h*w, C, P, P] (or the processor's strip
    [1, C, P, N*P]) with the processor's `target_sizes` [[h, w], ...], one row per slice, in the
    downsample mode the encoder runs."""

    downsample_mode: str = DEFAULT_MODE
    family_name: ClassVar[str] = FAMILY

    def __post_init__(self) -> None:
        if self.downsample_mode not in MERGE_SIDE:
            raise ValueError(
                f"{FAMILY}: downsample_mode {self.downsample_mode!r} is not one of {sorted(MERGE_SIDE)}"
            )

    @property
    def merge_side(self) -> int:
        return MERGE_SIDE[self.downsample_mode]

    def _sides_rule(self) -> str:
        return f"in downsample_mode {self.downsample_mode!r} h and w must be multiples of {self.merge_side}"
