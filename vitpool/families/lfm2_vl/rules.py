"""Item rules of LFM2-VL (its SigLIP2 NaFlex tower and the pixel-unshuffle projector): checks and
sizes of an item without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules).

What an item is. LFM2-VL's image processor resizes a small image to one grid of h x w patches
(h and w multiples of the downsample factor f), and splits a large one into rows x cols tiles of
one square size, row by row, followed by a thumbnail of the whole image where the processor's
`use_thumbnail` says so (LFM2-VL-1.6B's default). Each of these is one entry of `pixel_values`
with its row (h, w) of `spatial_shapes`, and the model encodes each entry as its own attention
sequence: a tile never attends to its neighbours or to the thumbnail. The prompt, however, holds
one image: its tiles' tokens and the thumbnail's, between `<|image_start|>` and `<|image_end|>`.
So an item is one image, its entries in the processor's order, each its own sequence: the
embedding the LLM needs for one `<image>` and what a cache keys on. An entry alone (one row of
`spatial_shapes`) is a valid item too (the transformers drop-in encodes entry by entry, as
`get_image_features` answers).

The pixels. The processor pads every entry's patches to the batch's most patches per entry and
marks the real ones in `pixel_attention_mask`; an item holds only the real ones, packed: its
entries' patch rows one after the other, [sum of h*w, C*P*P], each patch flattened (row, column,
channel) as the processor flattens it (`vitpool.items_from` cuts them so). Its layout is its
`spatial_shapes` rows, (h, w) per entry in patches; a spec's layout is them flattened,
(h_0, w_0, h_1, w_1, ...), and given back as layout gives the same spec.

Sizes. The projector's pixel unshuffle turns each f x f block of an entry's patches into one
token: an entry gives (h/f)*(w/f) tokens, an item the sum over its entries, concatenated in entry
order (the prompt's order). h and w must be multiples of f: the processor resizes every tile and
thumbnail to multiples of P*f pixels, and Hugging Face's projector would drop a last patch row or
column from the tokens while the tower still attends to it. Each entry needs one of a batch's
"sequences" (`cu_seqlens` entries), up to 11 for the default processor (10 tiles and a thumbnail).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitpool.packing import SEQUENCES
from vitpool.rules.base import RulesBase
from vitpool.specs import IMAGE, VIDEO, ItemSpec, is_int

Shape = tuple[int, int]  # (h, w) of one entry, in patches


def parse_spatial_shapes(layout: Any) -> tuple[Shape, ...]:
    """An item's entries (h, w) from the processor's `spatial_shapes` rows ([n, 2] tensor, array or
    nested sequence), a single row (h, w), or a spec's flattened layout (h_0, w_0, h_1, w_1, ...).

    Raises:
        ValueError: anything else, or a size that is not positive.
    """
    values = layout.tolist() if hasattr(layout, "tolist") else layout
    pairs: list[tuple[Any, ...]] = []
    if isinstance(values, (list, tuple)) and values and all(isinstance(v, (list, tuple)) for v in values):
        pairs = [tuple(v) for v in values]
    elif isinstance(values, (list, tuple)) and values and len(values) % 2 == 0:
        pairs = [tuple(values[i : i + 2]) for i in range(0, len(values), 2)]
    if not pairs or any(len(pair) != 2 or not all(is_int(v) for v in pair) for pair in pairs):
        raise ValueError(
            "an LFM2-VL image needs its spatial_shapes rows, (h, w) in patches for each tile and thumbnail: "
            f"Image(pixels, out['spatial_shapes'][first:last]) (vitpool.items_from cuts them); got {layout!r}"
        )
    shapes = tuple((int(h), int(w)) for h, w in pairs)
    if any(h <= 0 or w <= 0 for h, w in shapes):
        raise ValueError(f"spatial_shapes {[list(s) for s in shapes]} have a zero or negative size")
    return shapes


@dataclass(frozen=True)
class Lfm2VlRules(RulesBase):
    """LFM2-VL's items: Images of patch rows [sum h*w, C*P*P] with their `spatial_shapes` rows."""

    channels: int
    patch_size: int
    downsample_factor: int  # the projector's pixel unshuffle: f x f patches per token
    output_width: int  # the LLM's hidden size (the projector's output)
    capacities: tuple[str, ...] = (SEQUENCES,)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.channels * self.patch_size * self.patch_size,)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    @property
    def merge_unit(self) -> int:
        """Patch rows per output token."""
        return self.downsample_factor * self.downsample_factor

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality == VIDEO:
            raise ValueError("LFM2-VL takes images only; pass each frame as an Image")
        shapes = parse_spatial_shapes(layout)
        f = self.downsample_factor
        for number, (h, w) in enumerate(shapes):
            if h % f or w % f:
                raise ValueError(
                    f"spatial_shapes row {number} is ({h}, {w}) patches; h and w must be multiples of the "
                    f"downsample factor {f} (LFM2-VL's processor resizes every tile and thumbnail to "
                    f"multiples of {self.patch_size * f} pixels)"
                )
        pixel_shape = tuple(pixel_shape)
        self._check_rows(pixel_shape)
        num_rows = sum(h * w for h, w in shapes)
        if pixel_shape[0] != num_rows:
            raise ValueError(
                f"pixel_values hold {pixel_shape[0]} patch rows but spatial_shapes "
                f"{[list(s) for s in shapes]} need sum of h*w = {num_rows}: an item holds each tile's real "
                "patches only, out['pixel_values'][i, :h*w] (vitpool.items_from cuts them)"
            )
        flat = tuple(value for shape in shapes for value in shape)
        return ItemSpec(
            IMAGE, pixel_shape, pixel_dtype, flat, num_rows // self.merge_unit, ((SEQUENCES, len(shapes)),)
        )

    def _check_rows(self, shape: tuple[int, ...]) -> None:
        width = self.row_shape[0]
        if len(shape) == 3 and shape[-1] == width:
            raise ValueError(
                f"pixel_values of shape {shape} are the processor's padded entries [n, max_patches, "
                f"{width}]; an item holds its real patches only, [sum of h*w, C*P*P]: cut the processor's "
                "output with vitpool.items_from(out)"
            )
        if len(shape) != 2 or shape[1] != width:
            raise ValueError(
                f"pixel_values must be patch rows [sum of h*w, {width}] ({self.channels} channels x "
                f"{self.patch_size} x {self.patch_size}, flattened as the processor flattens them); "
                f"got shape {shape}"
            )
