"""Tensors across processes as NumPy arrays, so Ray moves them through its object store without
pickling torch storage (zero-copy on the receiving side). bfloat16, which NumPy lacks, travels
as its 16-bit pattern and keeps its dtype."""

from __future__ import annotations

import warnings

import numpy as np
import torch

# torch dtypes that cross processes; bfloat16 travels as its int16 bit pattern (NumPy has no bf16)
WIRE_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype(np.float32)),
    "float16": (torch.float16, np.dtype(np.float16)),
    "bfloat16": (torch.bfloat16, np.dtype(np.int16)),
    "float64": (torch.float64, np.dtype(np.float64)),
}
_NAMES = {torch_dtype: name for name, (torch_dtype, _) in WIRE_DTYPES.items()}


def to_array(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (copied to the host first if it is not there); bf16 as int16.
    A CPU tensor that needs no grad (a caller's pixels) takes one torch call."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError):  # on a GPU, or it requires grad
        return tensor.detach().cpu().numpy()


def from_array(array: np.ndarray, dtype_name: str, copy_read_only: bool = True) -> torch.Tensor:
    """The tensor `to_array` was made from, sharing the array's memory.

    A read-only array (one in Ray's object store) is copied first unless `copy_read_only` is False,
    for a reader that never writes: writing into the store's memory would crash the process.
    """
    torch_dtype, wire_dtype = WIRE_DTYPES[dtype_name]
    if array.dtype != wire_dtype:
        raise TypeError(f"a {dtype_name} tensor travels as {wire_dtype}, got an array of {array.dtype}")
    if array.flags.writeable:
        tensor = torch.from_numpy(array)
    elif copy_read_only:
        tensor = torch.from_numpy(array.copy())
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(array)
    return tensor.view(torch_dtype) if tensor.dtype != torch_dtype else tensor


def wire_dtype_name(dtype: torch.dtype) -> str:
    """The name under which tensors of `dtype` travel; TypeError if they cannot."""
    if dtype not in _NAMES:
        raise TypeError(f"tensors of dtype {dtype} cannot cross processes; use one of {sorted(WIRE_DTYPES)}")
    return _NAMES[dtype]
