"""Item rules of HunYuan-VL (HunyuanOCR): checks and sizes of an item without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules).

One item is one image as `HunYuanVLImageProcessor` gives it: its flattened patches `pixel_values`
[h*w, C*P*P] (raster order, row by row of patches: the tower's merger reshapes them to [C, h, w])
with its row (1, h, w) of `image_grid_thw`, exactly what the Qwen-style processors emit, so
`vitpool.items_from` cuts a batch with the shared grid cutter. The processor has no video path and
the tower takes one frame (`temporal_patch_size` 1): images only. h and w are multiples of the
spatial merge m (the processor resizes to multiples of P*m pixels; the merger's m x m convolution
would drop a last odd row or column).

Every image is one attention sequence. Its tokens are what the merger hands the LLM: one per
m x m block, a newline token after each row of blocks, and a begin and an end token around them,
(h/m) * (w/m + 1) + 2 in all (the processor's `replace_image_token`). So tokens are not rows/m²:
an image of h*w rows gives at least 3 tokens more than h*w/m² (one row of blocks, begin, end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitpool.rules.base import RulesBase
from vitpool.rules.grids import check_row_count, checked_grid
from vitpool.specs import VIDEO, ItemSpec

BOUNDARY_TOKENS = 2  # image_begin and image_end, around every image
# The fewest tokens an image gives beyond its blocks: one newline (one row of blocks) and the boundaries.
FEWEST_EXTRA_TOKENS = 1 + BOUNDARY_TOKENS


def image_tokens(h: int, w: int, merge_size: int) -> int:
    """Tokens of an image of h x w patches: a row of w/m blocks and its newline per block row,
    then the begin and end tokens."""
    return (h // merge_size) * (w // merge_size + 1) + BOUNDARY_TOKENS


@dataclass(frozen=True)
class HunYuanVLRules(RulesBase):
    """HunYuan-VL's items: Images of flattened patches [h*w, row_width] with a grid (1, h, w)."""

    row_width: int  # features per patch row: C * P * P
    merge_size: int  # the merger's spatial merge (merge x merge patches per block token)
    output_width: int  # the LLM's hidden size (the merger's output)
    capacities: tuple[str, ...] = ()

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.row_width,)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality == VIDEO:
            raise ValueError("HunYuan-VL takes images only; pass each frame as an Image")
        m = self.merge_size
        grid = checked_grid(modality, layout, (m, m), f"spatial merge size {m}", takes_video=False)
        _, h, w = grid
        pixel_shape = tuple(pixel_shape)
        if len(pixel_shape) != 2:
            raise ValueError(
                f"pixel_values must be 2-D [h*w, C*P*P] (flattened patches); got shape {pixel_shape}"
            )
        if pixel_shape[1] != self.row_width:
            raise ValueError(
                f"pixel_values have {pixel_shape[1]} features per row; the model takes {self.row_width} "
                "(channels * patch * patch)"
            )
        check_row_count(pixel_shape, grid, h * w, "h*w")
        return ItemSpec(modality, pixel_shape, pixel_dtype, grid, image_tokens(h, w, m))
