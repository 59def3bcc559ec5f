"""Hugging Face's quick GELU, `x * sigmoid(1.702 * x)`, as one Triton kernel.

Its forward runs three elementwise kernels (the product with 1.702, the sigmoid, the product), each
a pass over the MLP's widest activation, [rows, intermediate], rounded to half precision after
each. Qwen2-VL, ERNIE-4.5-VL, Step-3.7 and the CLIP towers (LLaVA, LLaVA-NeXT) take it in every
layer. Here one pass computes it in fp32 and rounds once (`benchmarks/HISTORY.md`, "The fused
passes of the tiled and CLIP towers (issue 52, third step)").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers.activations import QuickGELUActivation

from vitpool.kernels.fused_switch import fused_ops_apply, triton_available

BLOCK = 2048  # elements a program


def install_quick_gelu(module: torch.nn.Module) -> None:
    """Wrap the forward of Hugging Face's quick GELU once if `module` is one."""
    if type(module) is QuickGELUActivation:
        _patch_quick_gelu(QuickGELUActivation)


def _patch_quick_gelu(cls: type) -> None:
    original = cls.forward
    if getattr(original, "__vitpool_original__", None) is not None:
        return

    @functools.wraps(original)
    def forward(self, input):
        if fused_ops_apply(input) and input.is_contiguous() and triton_available():
            return fused_quick_gelu(input)
        return original(self, input)

    forward.__vitpool_original__ = original
    cls.forward = forward


def fused_quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x) in fp32, rounded once to x's dtype (x contiguous, on CUDA)."""
    out = torch.empty_like(x)
    count = x.numel()
    if count:
        _quick_gelu_kernel()[(_blocks(count, BLOCK),)](x, out, count, BLOCK=BLOCK)
    return out


def _blocks(count: int, block: int) -> int:
    return -(-count // block)


@functools.cache
def _quick_gelu_kernel() -> Callable:
    """The Triton kernel, defined on first use (triton is imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def quick_gelu(x_ptr, out_ptr, count, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < count
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.sigmoid(1.702 * x)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)

    return quick_gelu
