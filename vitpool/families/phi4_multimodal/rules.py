"""Item rules of Phi-4-multimodal's vision path: one image's crops and its global crop, with the
image's HD layout (checks and sizes of an item without the weights).

Importing neither torch nor transformers (a pool's callers unpickle these rules).

An item is one image as `Phi4MultimodalImageProcessor` emits it, its padding crops dropped:
pixels [1 + rows * cols, C, S, S], the global crop (the whole image resized to one crop) first,
then the crops of the HD canvas row by row. The canvas is `image_sizes`' (height, width) in pixels,
rows x cols crops of S pixels; the processor resizes the image onto it keeping its aspect and pads
the bottom or the right with white, and `image_attention_mask` marks the canvas' patches that hold
image: a top-left rectangle of `valid_rows` x `valid_cols` patches (every crop holds some of it).
The layout is (height, width, valid_rows, valid_cols); (height, width) alone means no padding.

Tokens, as `Phi4MultimodalImageEmbedding` hands them to the LLM: the tower's features of each crop
pooled 2 x 2 into b x b (b = ceil(S / patch / 2), 16 for 448-pixel crops of 14-pixel patches);
the crops' pooled grids joined into the canvas' (rows * b) x (cols * b), cut to the rows and
columns the mask keeps (every second patch of the mask), each row followed by the `sub_GN`
separator; then the `glb_GN` separator; then the global crop's b rows of b, each followed by
`sub_GN`. That is `num_img_tokens` of the processor: useful_rows * (useful_cols + 1) + 1 + b * (b + 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import SEQUENCES, Budget, plain_budgets
from vitpool.rules.base import RulesBase
from vitpool.specs import IMAGE, ItemSpec, is_int

ITEM_HINT = (
    "pass Image(out['image_pixel_values'][i, :1 + rows * cols], (height, width, valid_rows, valid_cols)) "
    "with (height, width) = out['image_sizes'][i] and the patches image_attention_mask marks; "
    "vitpool.items_from(out) builds it"
)


@dataclass(frozen=True)
class HdLayout:
    """One image's canvas: crop rows and columns, and the patch rows and columns holding image."""

    crop_rows: int
    crop_cols: int
    valid_rows: int
    valid_cols: int

    @property
    def num_crops(self) -> int:
        """Crops of the canvas (the global crop not counted)."""
        return self.crop_rows * self.crop_cols


@dataclass(frozen=True)
class Phi4MultimodalRules(RulesBase):
    """Phi-4-multimodal's items: Images of crops [1 + rows * cols, C, S, S] with their canvas
    (height, width[, valid_rows, valid_cols]). Every crop is one attention sequence ("sequences"),
    and the static buffers hold one crop a row: a budget holds `max_crops(tokens)` crops, so it
    bounds a batch's sequences to that (or to the user's lower bound)."""

    channels: int
    crop_size: int  # pixels a crop side (the vision config's crop_size = image_size)
    patch_size: int
    output_width: int  # the LLM's hidden size (img_projection_down's output)
    capacities: tuple[str, ...] = (SEQUENCES,)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.channels, self.crop_size, self.crop_size)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    @property
    def patches_per_side(self) -> int:
        return self.crop_size // self.patch_size

    @property
    def pooled_side(self) -> int:
        """b: a crop's side after the 2 x 2 pooling (an odd patch side is reflection-padded by one)."""
        return (self.patches_per_side + 1) // 2

    @property
    def tokens_per_crop(self) -> int:
        return self.pooled_side**2

    def max_crops(self, num_tokens: int) -> int:
        """Crops (buffer rows) a budget of `num_tokens` holds: as many as any batch of unpadded
        images of that many tokens has. An image of c crops (its global one included) gives
        b² * c + b * (canvas rows + 1) + 1 >= b² * c + 2b + 1 tokens, so c <= (n - 2b - 1) / b².
        A padded image gives fewer tokens a crop; the budget's bound on sequences (this number)
        sends it to a larger budget."""
        b = self.pooled_side
        return max(1, (num_tokens - 2 * b - 1) // self.tokens_per_crop)

    def parse_layout(self, layout: Any) -> HdLayout:
        """The canvas from (height, width[, valid_rows, valid_cols]) (a sequence, tensor or array of
        integers). ValueError naming what is wrong."""
        values = layout.tolist() if hasattr(layout, "tolist") else layout
        if not isinstance(values, (list, tuple)) or len(values) not in (2, 4) or not all(map(is_int, values)):
            raise ValueError(
                f"the layout must be (height, width) or (height, width, valid_rows, valid_cols), integers; "
                f"got {layout!r}: {ITEM_HINT}"
            )
        height, width = int(values[0]), int(values[1])
        side, patches = self.crop_size, self.patches_per_side
        if height < side or width < side or height % side or width % side:
            raise ValueError(
                f"image size {height} x {width} is not a whole number of {side}-pixel crops a side "
                f"(image_sizes holds the processor's padded canvas): {ITEM_HINT}"
            )
        rows, cols = height // side, width // side
        valid_rows, valid_cols = rows * patches, cols * patches  # (height, width) alone: no padding
        if len(values) == 4:
            valid_rows, valid_cols = int(values[2]), int(values[3])
        for name, valid, crops in (("valid_rows", valid_rows, rows), ("valid_cols", valid_cols, cols)):
            if not patches * (crops - 1) < valid <= patches * crops:
                raise ValueError(
                    f"{name} {valid}: a canvas of {crops} crops of {patches} patches holds image in "
                    f"{patches * (crops - 1) + 1}..{patches * crops} of them (every crop holds some, as the "
                    "processor pads less than a crop)"
                )
        return HdLayout(rows, cols, valid_rows, valid_cols)

    def useful_size(self, hd: HdLayout) -> tuple[int, int]:
        """Rows and columns of the canvas' pooled grid the model keeps: every second patch of the
        mask, crop by crop (all crops but the last row's / column's are whole)."""
        patches, pooled = self.patches_per_side, self.pooled_side
        last_rows = hd.valid_rows - patches * (hd.crop_rows - 1)
        last_cols = hd.valid_cols - patches * (hd.crop_cols - 1)
        return (
            pooled * (hd.crop_rows - 1) + (last_rows + 1) // 2,
            pooled * (hd.crop_cols - 1) + (last_cols + 1) // 2,
        )

    def num_tokens(self, hd: HdLayout) -> int:
        rows, cols = self.useful_size(hd)
        return rows * (cols + 1) + 1 + self.pooled_side * (self.pooled_side + 1)

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality != IMAGE:
            raise ValueError("Phi-4-multimodal takes images only")
        if layout is None:
            raise ValueError(f"an item needs its canvas: {ITEM_HINT}")
        hd = self.parse_layout(layout)
        crops = 1 + hd.num_crops
        expected = (crops, *self.row_shape)
        if tuple(pixel_shape) != expected:
            raise ValueError(
                f"pixel_values have shape {tuple(pixel_shape)}; a canvas of {hd.crop_rows} x {hd.crop_cols} "
                f"crops needs {list(expected)} (the global crop, then the crops row by row, padding crops "
                "dropped)"
            )
        spec_layout = (
            hd.crop_rows * self.crop_size,
            hd.crop_cols * self.crop_size,
            hd.valid_rows,
            hd.valid_cols,
        )
        return ItemSpec(
            IMAGE, tuple(pixel_shape), pixel_dtype, spec_layout, self.num_tokens(hd), ((SEQUENCES, crops),)
        )

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """Budgets bounded by tokens, items and crops: the crops a budget's buffers hold, or
        `capacity_limits["sequences"]` where that is lower."""
        check_capacity_limits(capacity_limits, self.capacities)
        user_limit = capacity_limits.get(SEQUENCES)
        budgets = []
        for budget in plain_budgets(token_budgets, max_items_per_batch):
            crops = self.max_crops(budget.num_tokens)
            crops = crops if user_limit is None else min(crops, user_limit)
            budgets.append(dataclasses.replace(budget, limits=((SEQUENCES, crops),)))
        return budgets
