"""Plain data that crosses every layer: the inputs (Image, Video) and the output (Embedding).

Inputs are checked when they are encoded, not when they are built, so that an error can name
the item's position in the caller's list.

Between processes tensors travel as NumPy arrays (bfloat16 as its 16-bit pattern), which Ray
moves through its object store without pickling torch storage. An `Embedding` pickles that way
by itself, so `ray.get` on a pool's result reference gives an `Embedding`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Image:
    """One image as the model's processor emits it.

    Args:
        pixel_values: flattened patches [t*h*w, C*T*P*P] (torch tensor or NumPy array, floating
            point), in the processor's order (merge blocks contiguous).
        grid_thw: (t, h, w) in patches; t is 1 for an image.
    """

    pixel_values: Any
    grid_thw: Any


@dataclass
class Video:
    """One video clip: like `Image`, with t temporal patches (frames / temporal patch size)."""

    pixel_values: Any
    grid_thw: Any


Item = Image | Video


@dataclass
class Embedding:
    """The encoder's output for one item.

    Attributes:
        tokens: merged output tokens [num_tokens, hidden] (the LLM's embedding width).
        deepstack: per-deepstack-layer features, each [num_tokens, hidden]; empty for models
            without deepstack.
    """

    tokens: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)

    def __reduce__(self) -> tuple:
        dtype_name = wire_dtype_name(self.tokens.dtype)
        return _embedding_from_arrays, (dtype_name, to_array(self.tokens), [to_array(d) for d in self.deepstack])


# torch dtypes that cross processes; bfloat16 travels as its int16 bit pattern (NumPy has no bf16)
WIRE_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype(np.float32)),
    "float16": (torch.float16, np.dtype(np.float16)),
    "bfloat16": (torch.bfloat16, np.dtype(np.int16)),
    "float64": (torch.float64, np.dtype(np.float64)),
}
_NAMES = {torch_dtype: name for name, (torch_dtype, _) in WIRE_DTYPES.items()}


def to_array(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (copied to the host first if it is not there); bf16 as int16."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def from_array(array: np.ndarray, dtype_name: str) -> torch.Tensor:
    """The tensor `to_array` was made from. Shares memory; a read-only array (Ray's object store)
    is copied first, so the tensor is always safe to write."""
    torch_dtype, wire_dtype = WIRE_DTYPES[dtype_name]
    if array.dtype != wire_dtype:
        raise TypeError(f"a {dtype_name} tensor travels as {wire_dtype}, got an array of {array.dtype}")
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor.view(torch_dtype) if tensor.dtype != torch_dtype else tensor


def wire_dtype_name(dtype: torch.dtype) -> str:
    """The name under which tensors of `dtype` travel; TypeError if they cannot."""
    if dtype not in _NAMES:
        raise TypeError(f"tensors of dtype {dtype} cannot cross processes; use one of {sorted(WIRE_DTYPES)}")
    return _NAMES[dtype]


def _embedding_from_arrays(dtype_name: str, tokens: np.ndarray, deepstack: list[np.ndarray]) -> Embedding:
    return Embedding(from_array(tokens, dtype_name), [from_array(d, dtype_name) for d in deepstack])
