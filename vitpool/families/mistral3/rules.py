"""Item rules of Mistral 3 (its Pixtral tower and the patch-merging projector): checks and sizes of
an item without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules).

One item is one image as Mistral 3's processor gives it: its pixels [C, H, W] cropped to its real
size (the processor pads a batch to its largest image) with its row of `image_sizes`, (H, W) in
pixels: `Image(out["pixel_values"][i, :, :H, :W], out["image_sizes"][i])` (`vitpool.items_from`
cuts a batch so). The tower cuts the image into P x P patches (its `patch_conv`), so vitpool's rows
are those patches, [h*w, C, P, P] in row-major order, h = H / P and w = W / P: the rules'
`pixel_rows` cuts an image into them (one copy), and passes patch rows given as such through. An
item's layout is its grid (1, h, w) in patches; a spec's own layout gives back the same spec, and
patch rows with a (1, h, w) grid are taken as well.

Every image is one attention sequence, and the projector's patch merger turns each m x m block of
patches into one token: an image gives h*w / m² tokens, its `[IMG]` placeholders. h and w must be
multiples of m: Mistral 3's processor (`PixtralProcessor`) resizes every image to multiples of
P*m pixels. An image the processor could not have made is refused: Hugging Face's merger would
drop its last patch row or column from the tokens while still attending to them, and an image
under m patches a side gives no token at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitpool.rules.patch_rows import Grid, PatchRows
from vitpool.specs import VIDEO, ItemSpec, is_int


def patch_rows(image: Any, patch_size: int) -> Any:
    """An image [C, H, W] (a torch tensor or a NumPy array; H and W multiples of `patch_size`) as
    its patches [h*w, C, P, P], row-major as the tower's `patch_conv` and `flatten` order them."""
    channels, height, width = image.shape
    h, w = height // patch_size, width // patch_size
    blocks = image.reshape(channels, h, patch_size, w, patch_size)  # a view: dims are only split
    permute = getattr(blocks, "permute", None) or blocks.transpose  # torch, else NumPy
    return permute(1, 3, 0, 2, 4).reshape(h * w, channels, patch_size, patch_size)


@dataclass(frozen=True)
class Mistral3Rules(PatchRows):
    """Mistral 3's items: Images [C, H, W] with their (H, W) in pixels, or patch rows
    [h*w, C, P, P] with a grid (1, h, w); cut into patch rows either way."""

    channels: int
    patch_size: int
    merge_size: int  # the patch merger's spatial merge (merge x merge patches per token)
    output_width: int  # the LLM's hidden size (the projector's output)
    capacities: tuple[str, ...] = ()

    @property
    def merge_kernel(self) -> tuple[int, int]:
        return (self.merge_size, self.merge_size)

    def pixel_rows(self, pixel_values: Any) -> Any:
        """An image [C, H, W] (or a batch of one, [1, C, H, W]) whose sides are multiples of the
        patch size, as patch rows [h*w, C, P, P]; anything else as it is (the spec's checks say
        what is wrong with it). A single patch row [1, C, P, P] is its own image: the same rows."""
        shape = tuple(pixel_values.shape)
        image = pixel_values[0] if len(shape) == 4 and shape[0] == 1 else pixel_values
        if self._cuttable(tuple(image.shape)):
            return patch_rows(image, self.patch_size)
        return pixel_values

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality == VIDEO:
            raise ValueError("Mistral 3 takes images only; pass each frame as an Image")
        grid = self.grid_of(layout)
        _, h, w = grid
        pixel_shape = tuple(pixel_shape)
        if len(pixel_shape) != 4 or pixel_shape[1:] != self.row_shape:
            raise ValueError(self._not_rows(pixel_shape))
        if pixel_shape[0] != h * w:
            raise ValueError(
                f"pixel_values hold {pixel_shape[0]} patches of {self.patch_size} pixels but the image's "
                f"size ({h * self.patch_size}, {w * self.patch_size}) is {h} x {w} = {h * w} patches: crop "
                "an image of a padded batch to its image_sizes row, pixel_values[i, :, :H, :W] "
                "(vitpool.items_from does)"
            )
        return ItemSpec(modality, pixel_shape, pixel_dtype, grid, h * w // self.merge_unit)

    def grid_of(self, layout: Any) -> Grid:
        """(1, h, w) in patches from an image's (H, W) in pixels (a row of `image_sizes`) or from
        a grid (1, h, w); ValueError naming what is wrong."""
        values = layout.tolist() if hasattr(layout, "tolist") else layout
        if isinstance(values, (list, tuple)) and len(values) == 1 and isinstance(values[0], (list, tuple)):
            values = values[0]
        if (
            not isinstance(values, (list, tuple))
            or len(values) not in (2, 3)
            or not all(is_int(v) for v in values)
        ):
            raise ValueError(
                "an image needs its size (H, W) in pixels, its row of the processor's image_sizes: "
                f"Image(pixels, out['image_sizes'][i]) (or a grid (1, h, w) in patches); got {layout!r}"
            )
        p, m = self.patch_size, self.merge_size
        if len(values) == 3:
            t, h, w = (int(v) for v in values)
            if t != 1:
                raise ValueError(f"an Image has grid t == 1, got {tuple(values)}")
            if h <= 0 or w <= 0:
                raise ValueError(f"grid {tuple(values)} has a zero or negative size")
            if h % m or w % m:
                raise ValueError(
                    f"grid {tuple(values)}: h and w must be multiples of the spatial merge size {m} "
                    f"(Mistral 3's processor resizes images to multiples of {p * m} pixels)"
                )
            return (1, h, w)
        height, width = (int(v) for v in values)
        if height <= 0 or width <= 0:
            raise ValueError(f"image size {(height, width)} has a zero or negative side")
        if height % (p * m) or width % (p * m):
            raise ValueError(
                f"image size {(height, width)}: height and width must be multiples of patch_size x "
                f"spatial_merge_size = {p * m} pixels, as Mistral 3's processor (PixtralProcessor) resizes "
                f"them; an image processor used alone needs patch_size={{'height': {p * m}, 'width': "
                f"{p * m}}}"
            )
        return (1, height // p, width // p)

    def _cuttable(self, shape: tuple[int, ...]) -> bool:
        return (
            len(shape) == 3
            and shape[0] == self.channels
            and shape[1] > 0
            and shape[2] > 0
            and shape[1] % self.patch_size == 0
            and shape[2] % self.patch_size == 0
        )

    def _not_rows(self, shape: tuple[int, ...]) -> str:
        image = shape[1:] if len(shape) == 4 and shape[0] == 1 else shape
        if len(image) == 3 and image[0] == self.channels:
            return (
                f"pixel_values of shape {shape}: an image's height and width must be multiples of the patch "
                f"size {self.patch_size}"
            )
        return (
            f"pixel_values must be an image [C, H, W] of {self.channels} channels, or patch rows [h*w, C, P, "
            f"P] with patches of shape {self.row_shape}; got shape {shape}"
        )
