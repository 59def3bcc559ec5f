"""The item checks of a model without its weights: small and picklable, so a pool's callers can
validate items in their own process before anything is sent."""

from __future__ import annotations

from dataclasses import dataclass

from vitpool.models.protocol import Grid, ItemSize


@dataclass(frozen=True)
class SpatialMergeRules:
    """Towers that cut frames into patches and merge `merge_size` x `merge_size` patches into one
    output token (Qwen2-VL through Qwen3-VL, GLM-4.1V): one attention sequence per temporal patch."""

    row_width: int  # features per patch row: C * T * P * P
    merge_size: int

    def item_size(self, grid: Grid) -> ItemSize:
        t, h, w = grid
        if t <= 0 or h <= 0 or w <= 0:
            raise ValueError(f"grid_thw {grid} has a zero or negative size")
        if h % self.merge_size or w % self.merge_size:
            raise ValueError(
                f"grid_thw {grid}: h and w must be multiples of the spatial merge size {self.merge_size}"
            )
        num_rows = t * h * w
        return ItemSize(num_rows, num_rows // self.merge_size**2, num_sequences=t)
