"""The rotary position embedding as one Triton kernel per tensor.

Every family's `apply_rotary_pos_emb_vision(q, k, cos, sin)` casts q and k to fp32, multiplies,
rotates halves with a `cat`, adds and casts back: many elementwise and copy kernels and several
fp32 copies of [rows, heads, head_dim] per layer, most of the elementwise and copy kernels of a
small forward (`benchmarks/RESULTS.md`, "Figures the code's design rests on"). Here one kernel per
tensor computes the same fp32 math from the half-precision input and writes half precision.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable

import torch

from vitpool.kernels.fused_switch import FUSED_OPS, HALF_DTYPES, next_power_of_two, triton_available

ROTARY_FUNCTION = "apply_rotary_pos_emb_vision"


def install_rotary(module: torch.nn.Module) -> None:
    """Wrap the rotary function of the modeling module that defines `module`'s class, if it has one."""
    modeling = sys.modules.get(type(module).__module__)
    if modeling is not None and callable(getattr(modeling, ROTARY_FUNCTION, None)):
        _patch_rotary(modeling)


def _patch_rotary(modeling: types.ModuleType) -> None:
    original = getattr(modeling, ROTARY_FUNCTION)
    if getattr(original, "__vitpool_original__", None) is not None:
        return

    @functools.wraps(original)
    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        # inside a compiled block (`vitpool.kernels.compiled`) inductor fuses Hugging Face's math itself
        if not torch.compiler.is_compiling() and FUSED_OPS.get():
            # Kimi-K2.5 passes [1, rows, heads, head_dim] (and may pass cos as [1, rows, head_dim])
            batched = q.dim() == 4 and q.shape[0] == 1 and k.dim() == 4 and k.shape[0] == 1
            q3, k3 = (q[0], k[0]) if batched else (q, k)
            cos2 = cos[0] if cos.dim() == 3 and cos.shape[0] == 1 else cos
            sin2 = sin[0] if sin.dim() == 3 and sin.shape[0] == 1 else sin
            if _rotary_fits(q3, k3, cos2, sin2):
                q_out, k_out = fused_rotary(q3, cos2, sin2), fused_rotary(k3, cos2, sin2)
                return (q_out[None], k_out[None]) if batched else (q_out, k_out)
        return original(q, k, cos, sin)

    apply_rotary_pos_emb_vision.__vitpool_original__ = original
    setattr(modeling, ROTARY_FUNCTION, apply_rotary_pos_emb_vision)


def _rotary_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The shapes every family passes: q, k [rows, heads, head_dim] in half precision with unit
    stride in head_dim; cos, sin [rows, head_dim] fp32 with unit stride."""
    if not (q.is_cuda and q.dtype in HALF_DTYPES and k.dtype == q.dtype and triton_available()):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return False  # the kernel has no backward
    if q.dim() != 3 or k.shape != q.shape or cos.dim() != 2 or sin.shape != cos.shape:
        return False
    rows, _, head_dim = q.shape
    return (
        cos.shape == (rows, head_dim)
        and head_dim % 2 == 0
        and cos.dtype == sin.dtype == torch.float32
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
        and cos.stride(0) == sin.stride(0)
    )


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in fp32, cast back to x's dtype: [rows, heads, head_dim].

    cos and sin are fp32 [positions, head_dim] (unit stride in head_dim), and row r of x takes
    position r % positions: one table per row, or one sequence's table for a batch of
    equal-length sequences flattened to rows (no copy of the table per sequence)."""
    rows, heads, head_dim = x.shape
    positions = cos.shape[0]
    if sin.shape != cos.shape or cos.shape[1] != head_dim or (rows and (not positions or rows % positions)):
        raise ValueError(f"rotary tables {tuple(cos.shape)} do not fit rows {tuple(x.shape)}")
    out = torch.empty((rows, heads, head_dim), device=x.device, dtype=x.dtype)
    if rows:
        half = head_dim // 2
        _rotary_kernel()[(rows,)](
            x,
            cos,
            sin,
            out,
            heads,
            positions,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            HALF=half,
            BLOCK_HEADS=next_power_of_two(heads),
            BLOCK_HALF=next_power_of_two(half),
        )
    return out


@functools.cache
def _rotary_kernel() -> Callable:
    """The Triton kernel, defined on first use (triton is imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rotary(
        x_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        num_heads,
        num_positions,
        x_row_stride,
        x_head_stride,
        cos_row_stride,
        HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 past ~600k rows
        position = row % num_positions
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        cols = tl.arange(0, BLOCK_HALF)[None, :]
        col_ok = cols < HALF
        mask = (heads < num_heads) & col_ok
        x = x_ptr + row * x_row_stride + heads * x_head_stride + cols
        x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
        c = cos_ptr + position * cos_row_stride + cols
        s = sin_ptr + position * cos_row_stride + cols
        cos1 = tl.load(c, mask=col_ok, other=0.0)
        cos2 = tl.load(c + HALF, mask=col_ok, other=0.0)
        sin1 = tl.load(s, mask=col_ok, other=0.0)
        sin2 = tl.load(s + HALF, mask=col_ok, other=0.0)
        # rotate_half(x) = cat(-x2, x1), as Hugging Face computes it, in fp32
        first = x1 * cos1 + (-x2) * sin1
        second = x2 * cos2 + x1 * sin2
        out = out_ptr + row * (num_heads * 2 * HALF) + heads * (2 * HALF) + cols
        tl.store(out, first.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, second.to(out_ptr.dtype.element_ty), mask=mask)

    return rotary
