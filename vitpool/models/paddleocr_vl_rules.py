"""Item rules of PaddleOCR-VL (its SigLIP-style NaViT tower and projector): checks and sizes of an
item without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules). Pixels are the
processor's patches [h*w, C, P, P] (4-D, one patch per row); an item's layout is its grid
(1, h, w) in patches. The model takes images only: its processor has no video path, and each
image is one attention sequence whose `merge x merge` patches the projector turns into one output
token, so an item gives h*w / merge² tokens from h*w rows. No capacity besides tokens and items:
the sequences of a batch are its items.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.models.item_rules import check_patch_rows, checked_grid
from vitpool.packing import Budget, plain_budgets
from vitpool.specs import VIDEO, ItemSpec, check_capacity_limits


@dataclass(frozen=True)
class PaddleOCRVLRules:
    """PaddleOCR-VL's items: Images of 4-D patches [h*w, C, P, P] with a grid (1, h, w)."""

    channels: int
    patch_size: int
    merge_size: int  # the projector's spatial merge (merge x merge patches per token)
    output_width: int  # the LLM's hidden size (the projector's output)
    capacities: tuple[str, ...] = ()

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.channels, self.patch_size, self.patch_size)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    @property
    def merge_unit(self) -> int:
        return self.merge_size * self.merge_size

    def item_spec(self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, metadata: Any) -> ItemSpec:
        if modality == VIDEO:
            raise ValueError("PaddleOCR-VL takes images only; pass each frame as an Image")
        _, h, w = grid = checked_grid(
            modality, metadata, (self.merge_size, self.merge_size), f"spatial merge size {self.merge_size}",
            takes_video=False,
        )
        num_rows = h * w
        check_patch_rows(pixel_shape, self.row_shape, grid, num_rows, "h*w")
        return ItemSpec(modality, tuple(pixel_shape), pixel_dtype, grid, num_rows // self.merge_unit)

    def budgets(
        self, token_budgets: Sequence[int], max_items_per_batch: int | None, capacity_limits: Mapping[str, int]
    ) -> list[Budget]:
        check_capacity_limits(capacity_limits, self.capacities)
        return plain_budgets(token_budgets, max_items_per_batch)
