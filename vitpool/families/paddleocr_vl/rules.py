"""Item rules of PaddleOCR-VL (its SigLIP-style NaViT tower and projector): checks and sizes of an
item without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules). Pixels are the
processor's patches [h*w, C, P, P] (4-D, one patch per row); an item's layout is its grid
(1, h, w) in patches. The model takes images only: its processor has no video path, and each
image is one attention sequence whose `merge x merge` patches the projector turns into one output
token, so an item gives h*w / merge² tokens from h*w rows. No capacity besides tokens and items:
the sequences of a batch are its items. The sizes and checks of patch rows are shared with
Kimi-K2.5 (`vitpool.rules.patch_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitpool.rules.patch_rows import PatchRows, patch_grid
from vitpool.specs import VIDEO, ItemSpec


@dataclass(frozen=True)
class PaddleOCRVLRules(PatchRows):
    """PaddleOCR-VL's items: Images of 4-D patches [h*w, C, P, P] with a grid (1, h, w)."""

    channels: int
    patch_size: int
    merge_size: int  # the projector's spatial merge (merge x merge patches per token)
    output_width: int  # the LLM's hidden size (the projector's output)
    capacities: tuple[str, ...] = ()

    @property
    def merge_kernel(self) -> tuple[int, int]:
        return (self.merge_size, self.merge_size)

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality == VIDEO:
            raise ValueError("PaddleOCR-VL takes images only; pass each frame as an Image")
        grid = patch_grid(
            self, modality, pixel_shape, layout, f"spatial merge size {self.merge_size}", takes_video=False
        )
        return ItemSpec(modality, tuple(pixel_shape), pixel_dtype, grid, pixel_shape[0] // self.merge_unit)
