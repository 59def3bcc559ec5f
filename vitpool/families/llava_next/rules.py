"""Item rules of LLaVA-NeXT: what an item is, how many tokens it gives, and the budgets, without the
weights. Importing neither torch nor transformers (a pool's callers unpickle these rules).

An image is its image processor's tiles [n, C, S, S] (S the CLIP tower's `image_size`, 336 in the
releases) with its original size (H, W) in pixels, a row of the processor's `image_sizes`:
`Image(out["pixel_values"][i, :n], out["image_sizes"][i])`. Its grid is the pinpoint of the
checkpoint's `image_grid_pinpoints` that `select_best_resolution` picks for (H, W), gh x gw crops of
S pixels; the processor gives the whole image resized to S first (the base tile), then the crops
row by row, so n = gh * gw + 1 always (`LlavaNextModel.get_image_features` counts an image's tiles
so, `image_size_to_num_patches`: it has no image of the base tile alone).

What the LLM receives (`pack_image_features`, "spatial_unpad"): the base tile's side² features
(side = S // patch_size, CLIP's class token dropped), then the crops' feature grid, less the rows or
columns the processor's letterbox padding covered, each row followed by one `image_newline` token.
That is LLaVA-OneVision's geometry without its pooling (LLaVA-NeXT has no `vision_aspect_ratio`), so
these rules are OneVision's (`LlavaOnevisionRules`) with a most-tiles' worth of features no grid
reaches, images of one tile and videos refused. Every tile is one attention sequence; budgets bound
their tiles (`max_tiles`) as OneVision's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitpool.families.llava_onevision.rules import LlavaOnevisionRules
from vitpool.specs import IMAGE, ItemSpec

SIZE_HINT = (
    "Image(out['pixel_values'][i, :n], out['image_sizes'][i]) "
    "(vitpool.items_from(out, family='llava_next') cuts them)"
)


@dataclass(frozen=True)
class LlavaNextRules(LlavaOnevisionRules):
    """LLaVA-NeXT's items: images of tiles [n, C, S, S], a base tile and the crops of their grid,
    with their size (H, W). Build them with `of` (no pooling)."""

    @classmethod
    def of(
        cls,
        channels: int,
        tile_size: int,
        patch_size: int,
        pinpoints: tuple[tuple[int, int], ...],
        output_width: int,
    ) -> LlavaNextRules:
        """The rules of a checkpoint: OneVision's pooling bound set to the largest grid's crops, which
        no unpadded grid exceeds, so nothing is pooled (as in `LlavaNextModel.pack_image_features`).

        Raises:
            ValueError: pinpoints that are not whole tiles (Hugging Face's model views the crops'
                features as such a grid).
        """
        pinpoints = tuple((int(height), int(width)) for height, width in pinpoints)
        most_crops = max((max(h // tile_size, 1) * max(w // tile_size, 1) for h, w in pinpoints), default=1)
        return cls(channels, tile_size, patch_size, pinpoints, most_crops, output_width)

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality != IMAGE:
            raise ValueError("LLaVA-NeXT takes images only (its llava_next model has no videos)")
        pixel_shape = tuple(pixel_shape)
        if len(pixel_shape) != 4 or pixel_shape[1:] != self.row_shape or pixel_shape[0] < 1:
            raise ValueError(
                f"pixel_values must be tiles [n, {self.channels}, {self.tile_size}, {self.tile_size}], an "
                f"image's base tile and crops, n >= 1; got shape {pixel_shape}"
            )
        size = self.size_of(layout)
        grid = self.packed_grid(*size)
        if pixel_shape[0] != grid.num_crops + 1:
            raise ValueError(
                f"an image of size {size} is cut into {grid.grid_rows} x {grid.grid_cols} crops and a base "
                f"tile, {grid.num_crops + 1} tiles (the checkpoint's image_grid_pinpoints); got "
                f"{pixel_shape[0]}. Pass the image's own tiles, not the batch's padding: {SIZE_HINT}"
            )
        return super().item_spec(IMAGE, pixel_shape, pixel_dtype, size)

    def size_of(self, layout: Any) -> tuple[int, int]:
        """An image's (H, W) in pixels, from a row of `image_sizes` (a sequence, tensor or array).

        Raises:
            ValueError: anything but two positive whole numbers.
        """
        try:
            return super().size_of(layout)
        except ValueError:
            raise ValueError(
                "an image needs its original size (H, W) in pixels, two positive integers, its row of the "
                f"processor's image_sizes: {SIZE_HINT}; got {layout!r}"
            ) from None
