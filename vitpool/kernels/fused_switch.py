"""When the fused kernels (`vitpool.kernels.fused`) may take over from a tower's own code.

Only inside `use_fused_ops(True)` (the encoder sets it around its forwards) and only on CUDA
tensors in half precision: anything else runs Hugging Face's own code, so a reference tower in the
same process is untouched and the CPU path stays the exact reference.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import inspect
from collections.abc import Callable

import torch

from vitpool.kernels.scoped import scoped_value

HALF_DTYPES = (torch.float16, torch.bfloat16)
FUSED_OPS: contextvars.ContextVar[bool] = contextvars.ContextVar("vitpool_fused_ops", default=False)


def use_fused_ops(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Let the installed fused kernels run (on CUDA, half precision) while the block runs."""
    return scoped_value(FUSED_OPS, enabled)


def fused_ops_apply(x: torch.Tensor) -> bool:
    """Whether a tower's own code may take its fused path on `x`: under `use_fused_ops(True)`,
    outside a compiled block (inductor fuses the plain code itself), on CUDA in half precision,
    and with no autograd through `x` (the Triton kernels have no backward)."""
    return (
        FUSED_OPS.get()
        and not torch.compiler.is_compiling()
        and x.is_cuda
        and x.dtype in HALF_DTYPES
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def next_power_of_two(n: int) -> int:
    """A Triton block size that covers `n` (block sizes are powers of two)."""
    return 1 << max(0, (n - 1).bit_length())


def source_body(function: Callable | None) -> tuple[str, ...] | None:
    """A function's statements after its signature, whitespace, comments and docstring removed."""
    function = getattr(function, "__vitpool_original__", function)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    lines = ["".join(line.split()) for line in source.splitlines()]
    start = (
        next((number for number, line in enumerate(lines) if line.endswith(":")), 0) + 1
    )  # past the signature
    return tuple(line for line in lines[start:] if line and not line.startswith(("#", '"""')))
