"""Plain data that crosses every layer: the inputs (Image, Video) and the output (Embedding),
and the checks at the public boundary that a pool and an in-process encoder share: a call's list
(`check_item_list`), each input turned into its spec (`prepare_items`), and the bound on one
item's size (`check_token_bound`).

Inputs are checked when they are encoded, not when they are built, so that an error can name
the item's position in the caller's list. What an item must look like is the model's business
(`vitpool.specs.ItemRules`); here only what every model shares is checked.

`Embedding` and `shared_results` are defined under the transport, which fills embeddings from a
batch's outputs and sits below this module (`vitpool.transport.embedding`: how an Embedding
pickles); they are a caller's names here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from vitpool.errors import InvalidItemError
from vitpool.rules.paths import PathRules
from vitpool.specs import IMAGE, VIDEO, ItemRules, ItemSpec
from vitpool.transport.embedding import Embedding, shared_results
from vitpool.transport.wire import WIRE_DTYPES, wire_dtype_name

__all__ = [
    "Embedding",
    "Image",
    "Item",
    "Prepared",
    "PreparedItem",
    "PreparedParts",
    "Video",
    "check_item_list",
    "check_token_bound",
    "prepare_item",
    "prepare_items",
    "shared_results",
]


@dataclass
class Image:
    """One image as the model's processor emits it.

    Args:
        pixel_values: the processor's pixels for this image (torch tensor or NumPy array,
            floating point), in its shape: flattened patches [t*h*w, C*T*P*P] for Qwen-style
            towers (merge blocks contiguous), tiles [tiles, C, P, P] for tiled towers, ...
        grid_thw: the processor's grid for this image, e.g. (t, h, w) in patches (t is 1 for an
            image), as a tensor, array or sequence; None for families that have none (tiles).
        inputs: the processor's further pixel tensors for this image, by the names it gives them,
            for families whose image is several inputs (Step-3.7's and DeepSeek-OCR-2's local
            crops: `{"pixel_values_local": out["pixel_values_local"]}`); None for the others.
    """

    pixel_values: Any
    grid_thw: Any = None
    inputs: Mapping[str, Any] | None = None


@dataclass
class Video:
    """One video clip: like `Image`, with the processor's video grid (t temporal patches)."""

    pixel_values: Any
    grid_thw: Any = None
    inputs: Mapping[str, Any] | None = None


Item = Image | Video


@dataclass(frozen=True)
class PreparedItem:
    """An item (or one part of an item of several inputs) that passed every check: its spec and
    its pixels as a torch tensor (not copied)."""

    spec: ItemSpec
    pixels: torch.Tensor

    @property
    def parts(self) -> tuple[PreparedItem, ...]:
        """The item's parts: itself (see `PreparedParts`)."""
        return (self,)

    @property
    def num_tokens(self) -> int:
        """Output tokens the item gives."""
        return self.spec.num_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of its pixels (the pool's queue bound), from its spec (no torch call)."""
        return math.prod(self.spec.pixel_shape) * WIRE_DTYPES[self.spec.pixel_dtype][1].itemsize


@dataclass(frozen=True)
class PreparedParts:
    """An item of several inputs, checked: one part per input it holds, each run by its own path's
    graphs, in the order their outputs are joined (`Embedding.joined`)."""

    parts: tuple[PreparedItem, ...]

    @property
    def num_tokens(self) -> int:
        return sum(part.spec.num_tokens for part in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


Prepared = PreparedItem | PreparedParts


def check_item_list(items: Any) -> None:
    """A call's items must come as a list (any sequence but a string): a tensor, a single item, a
    dict or a generator is a mistake worth naming before anything looks inside it.

    Raises:
        TypeError: `items` is not a list of items.
    """
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"items must be a list of vitpool.Image / vitpool.Video; got {type(items).__name__}")


def check_token_bound(
    index: int, prepared: Prepared, max_item_tokens: int | None, holder: str, raise_bound: str
) -> None:
    """Refuse item `index` where it gives more output tokens than `max_item_tokens` (None: no
    bound), before it costs any work. `holder` is what sets the bound ("pool", "encoder") and
    `raise_bound` how its user raises it ("launch the pool"), for the message.

    Raises:
        InvalidItemError: the item is over the bound (the message names the bound and the fixes).
    """
    if max_item_tokens is not None and prepared.num_tokens > max_item_tokens:
        num_rows = sum(part.spec.num_rows for part in prepared.parts)
        raise InvalidItemError(
            index,
            f"{prepared.num_tokens} output tokens ({num_rows} pixel rows) is over this {holder}'s bound, "
            f"max_item_tokens={max_item_tokens}: resize it as the model's processor does (its max_pixels), "
            f"or {raise_bound} with a larger max_item_tokens (None: no bound)",
        )


def prepare_items(items: Sequence[Any], rules: ItemRules) -> list[Prepared]:
    """Check every item against the model's rules; raises InvalidItemError naming the first bad one.

    Non-finite pixels are found later, on the device, once the pixels are there: scanning them on
    the host would cost as much as a small encode.
    """
    return [prepare_item(index, item, rules) for index, item in enumerate(items)]


def prepare_item(index: int, item: Any, rules: ItemRules) -> Prepared:
    """Check one item; `index` is its position in the caller's list, for the error message. An
    item of several inputs (the model's rules have `parts`: `PathRules`) gives its parts."""
    if not isinstance(item, (Image, Video)):
        raise InvalidItemError(index, f"expected vitpool.Image or vitpool.Video, got {type(item).__name__}")
    modality = VIDEO if isinstance(item, Video) else IMAGE
    if rules.parts:
        return _prepare_parts(index, item, modality, cast(PathRules, rules))
    if item.inputs:
        raise InvalidItemError(
            index, f"this model takes pixel_values alone; drop inputs {sorted(map(str, item.inputs))}"
        )
    pixels = _pixels(index, item.pixel_values)
    try:
        pixels = rules.pixel_rows(pixels)  # a processor's layout whose rows are not its first axis
        spec = rules.item_spec(modality, tuple(pixels.shape), wire_dtype_name(pixels.dtype), item.grid_thw)
    except (ValueError, TypeError) as error:
        raise InvalidItemError(index, str(error)) from None
    return PreparedItem(spec, pixels)


def _prepare_parts(index: int, item: Image | Video, modality: str, rules: PathRules) -> PreparedParts:
    if item.inputs is not None and not isinstance(item.inputs, Mapping):
        raise InvalidItemError(
            index, f"inputs must map input names to pixels; got {type(item.inputs).__name__}"
        )
    if rules.primary in (item.inputs or {}):
        raise InvalidItemError(index, f"pass {rules.primary} as the item's pixel_values, not in inputs")
    unknown = sorted(str(name) for name in (item.inputs or {}) if name not in rules.input_names)
    if unknown:
        raise InvalidItemError(index, f"unknown inputs {unknown}; this model takes {list(rules.input_names)}")
    named = {rules.primary: item.pixel_values, **(item.inputs or {})}
    tensors = {name: _pixels(index, value, name) for name, value in named.items() if value is not None}
    shapes = {name: (tuple(t.shape), wire_dtype_name(t.dtype)) for name, t in tensors.items()}
    try:
        specs = rules.part_specs(modality, shapes, item.grid_thw)
    except (ValueError, TypeError) as error:
        raise InvalidItemError(index, str(error)) from None
    return PreparedParts(tuple(PreparedItem(spec, tensors[spec.path]) for spec in specs))


def _pixels(index: int, pixel_values: Any, name: str = "pixel_values") -> torch.Tensor:
    if isinstance(pixel_values, np.ndarray):
        if pixel_values.dtype.type not in _NUMPY_FLOATS:
            raise InvalidItemError(
                index, f"{name} have dtype {pixel_values.dtype}; expected a floating-point dtype"
            )
        pixel_values = torch.from_numpy(pixel_values)  # of a dtype that travels: checked once, above
    elif not isinstance(pixel_values, torch.Tensor):
        raise InvalidItemError(
            index, f"{name} must be a torch tensor or NumPy array, got {type(pixel_values).__name__}"
        )
    elif pixel_values.dtype not in _TRAVELLING_DTYPES:  # all floating point
        raise InvalidItemError(
            index,
            f"{name} have dtype {pixel_values.dtype}; expected a floating-point dtype "
            "(float32, float16, bfloat16 or float64)",
        )
    if not pixel_values.shape:  # (each torch call here costs µs in a caller that wakes cold)
        raise InvalidItemError(index, f"{name} are a single number; expected rows of patches or tiles")
    return pixel_values


_NUMPY_FLOATS = (np.float16, np.float32, np.float64)
_TRAVELLING_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
