"""Item rules of Kimi-K2.5 (MoonViT): checks and sizes of an item without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules). Pixels are the
processor's patches [t*h*w, 3, P, P] (4-D, one patch per row); an item's layout is its grid
(t, h, w) in patches. The tower attends over a whole clip at once (one attention sequence per
item) and pools `kh x kw` patches of every frame into one output token, averaging over the frames:
an item gives h*w / (kh*kw) tokens whatever its t, and takes t*h*w rows.

So a video's rows are not four per token: the rows beyond kh*kw per token, (t-1)*h*w, are the
capacity "extra_rows". A budget of n tokens holds `row_factor` * kh*kw * n rows, so its limit on
extra rows is (row_factor - 1) * kh*kw * n; with row_factor 1 (images only) a clip fits no
budget and runs eager, alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.models.item_rules import check_patch_rows, checked_grid
from vitpool.packing import Budget, plain_budgets
from vitpool.specs import ItemSpec, check_capacity_limits

EXTRA_ROWS = "extra_rows"  # rows of a clip's frames past its first (t - 1) * h * w


@dataclass(frozen=True)
class KimiK25Rules:
    """MoonViT's items: 4-D patches [t*h*w, C, P, P], grid (t, h, w), t <= max_frames."""

    channels: int
    patch_size: int
    merge_kernel: tuple[int, int]  # (kh, kw)
    max_frames: int  # the temporal position table's length (pos_emb_time)
    output_width: int  # the LLM's hidden size (the projector's output)
    row_factor: int = 1  # rows of a budget's buffer per (kh*kw * token)
    capacities: tuple[str, ...] = (EXTRA_ROWS,)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.channels, self.patch_size, self.patch_size)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    @property
    def merge_unit(self) -> int:
        return self.merge_kernel[0] * self.merge_kernel[1]

    def item_spec(self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, metadata: Any) -> ItemSpec:
        t, h, w = grid = checked_grid(modality, metadata, self.merge_kernel, f"merge kernel {self.merge_kernel}")
        if t > self.max_frames:
            raise ValueError(f"grid_thw {grid}: at most {self.max_frames} frames per clip (the model's pos_emb_time)")
        check_patch_rows(pixel_shape, self.row_shape, grid, t * h * w, "t*h*w")
        return ItemSpec(modality, tuple(pixel_shape), pixel_dtype, grid, h * w // self.merge_unit, ((EXTRA_ROWS, (t - 1) * h * w),))

    def extra_rows(self, num_tokens: int) -> int:
        """Rows past kh*kw per token that a budget of `num_tokens` holds."""
        return (self.row_factor - 1) * self.merge_unit * num_tokens

    def budgets(
        self, token_budgets: Sequence[int], max_items_per_batch: int | None, capacity_limits: Mapping[str, int]
    ) -> list[Budget]:
        check_capacity_limits(capacity_limits, self.capacities)
        limit = capacity_limits.get(EXTRA_ROWS)
        budgets = []
        for budget in plain_budgets(token_budgets, max_items_per_batch):
            held = self.extra_rows(budget.num_tokens)
            if limit is not None and limit > held:
                raise ValueError(
                    f"capacity_limits[{EXTRA_ROWS!r}] = {limit}: a budget of {budget.num_tokens} tokens holds "
                    f"{held} extra rows (row_factor {self.row_factor}); raise row_factor or lower the limit"
                )
            value = held if limit is None else limit
            budgets.append(Budget(budget.num_tokens, ((EXTRA_ROWS, value),), budget.max_items))
        return sorted(budgets)
