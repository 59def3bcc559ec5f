"""Item rules shared by families: checks and sizes of an item without the weights.

Small and picklable, importing neither torch nor transformers: an actor builds them from its
model's config and hands them to the pool's callers (in `ActorInfo`), which check and size items
in their own process before anything is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitpool.packing import SEQUENCES
from vitpool.rules.base import RulesBase
from vitpool.specs import IMAGE, ItemSpec, is_int


@dataclass(frozen=True)
class SpatialMergeRules(RulesBase):
    """Towers that cut frames into patches and merge `merge_size` x `merge_size` patches into one
    output token (Qwen2-VL through Qwen3-VL, GLM-4.1V): pixels are flattened patches
    [t*h*w, row_width] with a `grid_thw` of (t, h, w); one attention sequence per temporal patch.
    """

    row_width: int  # features per patch row: C * T * P * P
    merge_size: int
    output_row_shapes: tuple[tuple[int, ...], ...]  # tokens, then any extra per-token outputs
    capacities: tuple[str, ...] = (SEQUENCES,)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.row_width,)

    @property
    def merge_unit(self) -> int:
        """Patch rows per output token."""
        return self.merge_size**2

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        t, h, w = grid = checked_grid(
            modality, layout, (self.merge_size, self.merge_size), f"spatial merge size {self.merge_size}"
        )
        if len(pixel_shape) != 2:
            raise ValueError(
                f"pixel_values must be 2-D [t*h*w, C*T*P*P] (flattened patches); got shape {pixel_shape}"
            )
        if pixel_shape[1] != self.row_width:
            raise ValueError(
                f"pixel_values have {pixel_shape[1]} features per row; the model takes "
                f"{self.row_width} (channels * temporal patch * patch * patch)"
            )
        num_rows = t * h * w
        check_row_count(pixel_shape, grid, num_rows, "t*h*w")
        return ItemSpec(
            modality, pixel_shape, pixel_dtype, grid, num_rows // self.merge_size**2, ((SEQUENCES, t),)
        )


def checked_grid(
    modality: str, grid_thw: Any, merge: tuple[int, int], merge_name: str, takes_video: bool = True
) -> tuple[int, int, int]:
    """One item's (t, h, w) with the checks every grid family makes: an Image has one frame, no
    size is zero or negative, h and w are multiples of the merge window `merge` (called
    `merge_name` in the message). ValueError naming what is wrong."""
    t, h, w = grid = parse_grid(grid_thw)
    if modality == IMAGE and t != 1:
        advice = "; use Video for clips" if takes_video else ""
        raise ValueError(f"an Image has grid t == 1, got grid_thw {grid}{advice}")
    if t <= 0 or h <= 0 or w <= 0:
        raise ValueError(f"grid_thw {grid} has a zero or negative size")
    if h % merge[0] or w % merge[1]:
        raise ValueError(f"grid_thw {grid}: h and w must be multiples of the {merge_name}")
    return grid


def check_patch_rows(
    pixel_shape: tuple[int, ...],
    row_shape: tuple[int, ...],
    grid: tuple[int, int, int],
    num_rows: int,
    rows_formula: str,
) -> None:
    """Pixels of towers that take one patch per row: [num_rows, *row_shape]."""
    if len(pixel_shape) != 1 + len(row_shape):
        raise ValueError(
            f"pixel_values must be {1 + len(row_shape)}-D [{rows_formula}, C, P, P] (one patch per row); "
            f"got shape {pixel_shape}"
        )
    if tuple(pixel_shape[1:]) != row_shape:
        raise ValueError(
            f"pixel_values have patches of shape {tuple(pixel_shape[1:])}; the model takes {row_shape}"
        )
    check_row_count(pixel_shape, grid, num_rows, rows_formula)


def check_row_count(
    pixel_shape: tuple[int, ...], grid: tuple[int, int, int], num_rows: int, rows_formula: str
) -> None:
    if pixel_shape[0] != num_rows:
        raise ValueError(
            f"pixel_values have {pixel_shape[0]} rows but grid_thw {grid} needs {rows_formula} = {num_rows}"
        )


def parse_grid(grid_thw: Any) -> tuple[int, int, int]:
    """(t, h, w) from a processor's grid for one item: a tensor, array or sequence, as [t, h, w]
    or [[t, h, w]]. ValueError for anything else."""
    values = grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw
    if isinstance(values, (list, tuple)) and len(values) == 1 and isinstance(values[0], (list, tuple)):
        values = values[0]
    if not isinstance(values, (list, tuple)) or len(values) != 3 or not all(is_int(v) for v in values):
        raise ValueError(f"grid_thw must be three integers (t, h, w); got {grid_thw!r}")
    return (int(values[0]), int(values[1]), int(values[2]))
