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
from typing import Any

from vitpool.families.minicpmv4_6.rules import MiniCPMV4_6Rules, parse_target_sizes
from vitpool.packing import SEQUENCES
from vitpool.specs import IMAGE, VIDEO, ItemSpec

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

    def __post_init__(self) -> None:
        if self.downsample_mode not in MERGE_SIDE:
            raise ValueError(
                f"{FAMILY}: downsample_mode {self.downsample_mode!r} is not one of {sorted(MERGE_SIDE)}"
            )

    @property
    def merge_side(self) -> int:
        return MERGE_SIDE[self.downsample_mode]

    @property
    def patches_per_token(self) -> int:
        return self.merge_side * self.merge_side

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality == VIDEO:
            raise ValueError(f"{FAMILY} takes images only here; pass each frame's slices as an Image")
        sizes = parse_target_sizes(layout)
        side = self.merge_side
        for number, (h, w) in enumerate(sizes):
            if h % side or w % side:
                raise ValueError(
                    f"target_sizes: slice {number} is {h} x {w} patches; in downsample_mode "
                    f"{self.downsample_mode!r} h and w must be multiples of {side}"
                )
        self._check_pixels(tuple(pixel_shape))
        num_rows = sum(h * w for h, w in sizes)
        if pixel_shape[0] != num_rows:
            raise ValueError(
                f"pixel_values have {pixel_shape[0]} patch rows but target_sizes {[list(s) for s in sizes]} "
                f"need sum of h*w = {num_rows}"
            )
        return ItemSpec(
            IMAGE,
            tuple(pixel_shape),
            pixel_dtype,
            tuple(value for size in sizes for value in size),
            num_rows // self.patches_per_token,
            ((SEQUENCES, len(sizes)),),
        )
