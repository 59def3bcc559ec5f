"""Item rules of MiniCPM-V 4.6 (its SigLIP-style NaViT tower, in-tower 2 x 2 window merger and
outer 2 x 2 merger): checks and sizes of an item without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules).

One item is one image as the processor emits it: the overview slice, then the refined slices row
by row, each a grid of h x w patches (`target_sizes` [S, 2]). Every slice is its own attention
sequence, so an image needs S of the batch's "sequences" (up to 10 with the default processor),
and gives h*w / 16 tokens per slice (two successive 2 x 2 merges, "16x" mode), concatenated in
slice order: exactly the placeholders the processor writes.

The pixels. The processor packs every slice's patches side by side into one strip
[1, C, P, N*P] (N = sum of h*w; patch n is columns n*P .. n*P+P-1), and has no other layout. vitpool
copies an item's pixels row by row into a static buffer [rows, *row_shape], so an item's rows are
its patches [N, C, P, P]: the rules' `pixel_rows` takes the strip as the processor emits it,
`Image(out["pixel_values"], out["target_sizes"])`, to that view of it (strided: the patch index
sits inside the last axis; the copy into the buffers gathers it), and passes patch rows given as
such through. An item's layout is the slice sizes flattened, (h_0, w_0, h_1, w_1, ...); given back
as layout it gives the same spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vitpool.packing import SEQUENCES
from vitpool.rules.base import RulesBase
from vitpool.specs import IMAGE, VIDEO, ItemSpec, is_int

MERGE_SIDE = 4  # patches per token along each side: the in-tower 2 x 2 merge, then the merger's 2 x 2
PATCHES_PER_TOKEN = MERGE_SIDE * MERGE_SIDE


def patch_rows(pixel_values: Any, patch_size: int = 14) -> Any:
    """The processor's strip [1, C, P, N*P] of one image as patch rows [N, C, P, P] (a torch
    tensor or a NumPy array, a view where the input allows)."""
    channels, side = pixel_values.shape[1], pixel_values.shape[2]
    strip = pixel_values[0].reshape(channels, side, -1, patch_size)  # [C, P, N, P]
    permute = getattr(strip, "permute", None) or strip.transpose  # torch, else NumPy
    return permute(2, 0, 1, 3)


@dataclass(frozen=True)
class MiniCPMV4_6Rules(RulesBase):
    """MiniCPM-V 4.6's items: Images of patch rows [sum h*w, C, P, P] with the processor's
    `target_sizes` [[h, w], ...] (one row per slice, in patches)."""

    channels: int
    patch_size: int
    output_width: int  # the LLM's hidden size (the merger's output)
    capacities: tuple[str, ...] = (SEQUENCES,)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.channels, self.patch_size, self.patch_size)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    def pixel_rows(self, pixel_values: Any) -> Any:
        """The processor's strip [1, C, P, N*P] as patch rows [N, C, P, P] (a view); anything
        else as it is (the spec's checks say what is wrong with it)."""
        shape = tuple(pixel_values.shape)
        channels, patch = self.channels, self.patch_size
        if len(shape) == 4 and shape[0] == 1 and shape[1:3] == (channels, patch) and shape[3] % patch == 0:
            return patch_rows(pixel_values, patch)
        return pixel_values

    # the family as messages name it, and what its merges ask of a slice's sides
    family_name: ClassVar[str] = "MiniCPM-V 4.6"

    @property
    def merge_side(self) -> int:
        """Patches a token takes along each side."""
        return MERGE_SIDE

    def _sides_rule(self) -> str:
        return f'h and w must be multiples of {MERGE_SIDE} (two 2 x 2 merges, the "16x" downsample mode)'

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        if modality == VIDEO:
            raise ValueError(
                f"{self.family_name} takes images only here; pass each frame's slices as an Image"
            )
        sizes = parse_target_sizes(layout)
        side = self.merge_side
        for number, (h, w) in enumerate(sizes):
            if h % side or w % side:
                raise ValueError(f"target_sizes: slice {number} is {h} x {w} patches; {self._sides_rule()}")
        self._check_pixels(tuple(pixel_shape))
        num_rows = sum(h * w for h, w in sizes)
        if pixel_shape[0] != num_rows:
            raise ValueError(
                f"pixel_values have {pixel_shape[0]} patch rows but target_sizes {[list(s) for s in sizes]} "
                f"need sum of h*w = {num_rows}"
            )
        layout = tuple(value for size in sizes for value in size)
        return ItemSpec(
            IMAGE,
            tuple(pixel_shape),
            pixel_dtype,
            layout,
            num_rows // (side * side),
            ((SEQUENCES, len(sizes)),),
        )

    def _check_pixels(self, pixel_shape: tuple[int, ...]) -> None:
        if len(pixel_shape) != 4:
            raise ValueError(
                f"pixel_values must be 4-D patch rows [sum h*w, C, P, P]; got shape {pixel_shape}"
            )
        if pixel_shape[1:] != self.row_shape:
            raise ValueError(
                f"pixel_values have patches of shape {pixel_shape[1:]}; the model takes {self.row_shape}"
            )


def parse_target_sizes(target_sizes: Any) -> tuple[tuple[int, int], ...]:
    """The slices' (h, w) from the processor's `target_sizes` ([S, 2] tensor, array or nested
    sequence) or from a spec's layout (h_0, w_0, h_1, w_1, ...). ValueError for anything else."""
    values = target_sizes.tolist() if hasattr(target_sizes, "tolist") else target_sizes
    if isinstance(values, (list, tuple)) and values and all(isinstance(v, (list, tuple)) for v in values):
        pairs = [tuple(v) for v in values]
    elif isinstance(values, (list, tuple)) and len(values) % 2 == 0:
        pairs = [tuple(values[i : i + 2]) for i in range(0, len(values), 2)]
    else:
        pairs = []
    if not pairs or any(len(pair) != 2 or not all(is_int(v) for v in pair) for pair in pairs):
        raise ValueError(
            f"target_sizes must be the processor's [[h, w], ...] for one image (one row per slice, "
            f"integers, at least one slice); got {target_sizes!r}"
        )
    sizes = tuple((int(h), int(w)) for h, w in pairs)
    if any(h <= 0 or w <= 0 for h, w in sizes):
        raise ValueError(f"target_sizes {[list(s) for s in sizes]} have a zero or negative size")
    return sizes
