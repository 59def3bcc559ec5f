"""Item rules of Gemma 4 (its vision tower and `embed_vision`): checks and sizes of an item
without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules).

One item is one image: its real patches only, `pixel_values` [h*w, 3*P*P] (the processor's
patchify order: patches row-major, each patch's pixels (row, column, channel)), with its grid
(1, h, w) in patches. Gemma 4's image processor pads every image's patches to a fixed
`max_soft_tokens * k²` rows and marks the padding rows' positions (-1, -1); `vitpool.items_from`
drops those rows and reads h and w from the real rows' (x, y) positions (`processor.py`). Why the
padding can go: `adapter.py`.

The tower's pooler averages each k x k block of patches into one token (k = the vision config's
`pooling_kernel_size`, 3 in every release), so an image gives h*w / k² tokens. h and w must be
multiples of k: the processor resizes every image to multiples of k*P pixels, and Hugging Face's
pooler numbers its blocks by `x // k + (w // k) * (y // k)`, which mixes the blocks of a side that
is not a multiple. Both sides must fit the learned position table (`position_embedding_size`
positions an axis). Every image is one attention sequence.

Videos: Gemma 4's `get_video_features` runs each frame as an image (its own sequence and pooling)
and joins the frames' tokens, so a video is its frames as Images, their tokens joined in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitpool.rules.base import RulesBase
from vitpool.rules.grids import check_row_count, checked_grid
from vitpool.specs import VIDEO, ItemSpec


@dataclass(frozen=True)
class Gemma4Rules(RulesBase):
    """Gemma 4's items: Images of their real patch rows [h*w, row_width] with a grid (1, h, w)."""

    row_width: int  # features per patch row: 3 * P * P
    pooling_kernel_size: int  # k: each k x k block of patches becomes one token
    max_side: int  # the position table's positions an axis (`position_embedding_size`)
    output_width: int  # the LLM's hidden size (`embed_vision`'s output)
    capacities: tuple[str, ...] = ()

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.row_width,)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    @property
    def merge_kernel(self) -> tuple[int, int]:
        return (self.pooling_kernel_size, self.pooling_kernel_size)

    @property
    def merge_unit(self) -> int:
        """Patch rows per output token."""
        return self.pooling_kernel_size**2

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality == VIDEO:
            raise ValueError(
                "Gemma 4 takes images only; its get_video_features runs each frame as an image: pass each "
                "frame as an Image and join their tokens"
            )
        k = self.pooling_kernel_size
        grid = checked_grid(
            modality, layout, self.merge_kernel, f"pooling kernel size {k}", takes_video=False
        )
        _, h, w = grid
        if max(h, w) > self.max_side:
            raise ValueError(
                f"grid_thw {grid}: a side of more than {self.max_side} patches is past the tower's position "
                "table (position_embedding_size)"
            )
        pixel_shape = tuple(pixel_shape)
        if len(pixel_shape) != 2:
            raise ValueError(
                "pixel_values must be 2-D [h*w, 3*P*P] (an image's real patch rows); got shape "
                f"{pixel_shape}: cut a processor batch with vitpool.items_from, which drops the padding rows"
            )
        if pixel_shape[1] != self.row_width:
            raise ValueError(
                f"pixel_values have {pixel_shape[1]} features per row; the model takes {self.row_width} "
                "(3 * patch * patch)"
            )
        check_row_count(
            pixel_shape, grid, h * w, "h*w (the real patches; the processor's padding rows dropped)"
        )
        return ItemSpec(modality, pixel_shape, pixel_dtype, grid, h * w // self.merge_unit)
