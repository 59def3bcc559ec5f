"""The rotary position embedding as one Triton kernel per tensor.

Every family's `apply_rotary_pos_emb_vision(q, k, cos, sin)` casts q and k to fp32, multiplies,
rotates halves with a `cat`, adds and casts back: many elementwise and copy kernels and several
fp32 copies of [rows, heads, head_dim] per layer, most of the elementwise and copy kernels of a
small forward (`benchmarks/RESULTS.md`, "Figures the code's design rests on"). Here one kernel per
tensor computes the same fp32 math from the half-precision input and writes half precision.

MiniMax-M3-VL's turns only the first dims of a head, from half-precision tables, and passes the rest
through (its function's source is recognised: `PARTIAL_ROTARY_BODY`); the same kernel copies the
tail. Llama 4's `vision_apply_rotary_emb(query, key, freqs_ci)` rotates interleaved pairs as complex
numbers (`view_as_complex`, a complex product, `view_as_real`): a kernel of its own reads the
complex table in place (`fused_interleaved_rotary`).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable

import torch

from vitpool.kernels.fused_switch import (
    FUSED_OPS,
    HALF_DTYPES,
    next_power_of_two,
    source_body,
    triton_available,
)

ROTARY_FUNCTION = "apply_rotary_pos_emb_vision"
INTERLEAVED_ROTARY_FUNCTION = "vision_apply_rotary_emb"  # Llama 4's
# MiniMax-M3-VL's apply_rotary_pos_emb_vision, whitespace removed (`source_body`): the first
# cos.shape[-1] dims of each head turned, the rest passed through, in the tables' half precision
PARTIAL_ROTARY_BODY = (
    "rot_dim=cos.shape[-1]",
    "cos,sin=cos[:,None,:],sin[:,None,:]",
    "q_rot,q_pass=q[...,:rot_dim],q[...,rot_dim:]",
    "k_rot,k_pass=k[...,:rot_dim],k[...,rot_dim:]",
    "q_rot=q_rot*cos+rotate_half(q_rot)*sin",
    "k_rot=k_rot*cos+rotate_half(k_rot)*sin",
    "returntorch.cat([q_rot,q_pass],dim=-1),torch.cat([k_rot,k_pass],dim=-1)",
)


def install_rotary(module: torch.nn.Module) -> None:
    """Wrap the rotary function of the modeling module that defines `module`'s class, if it has one."""
    modeling = sys.modules.get(type(module).__module__)
    if modeling is not None and callable(getattr(modeling, ROTARY_FUNCTION, None)):
        _patch_rotary(modeling)
    if modeling is not None and callable(getattr(modeling, INTERLEAVED_ROTARY_FUNCTION, None)):
        _patch_interleaved_rotary(modeling)


def _patch_rotary(modeling: types.ModuleType) -> None:
    original = getattr(modeling, ROTARY_FUNCTION)
    if getattr(original, "__vitpool_original__", None) is not None:
        return
    partial = source_body(original) == PARTIAL_ROTARY_BODY

    @functools.wraps(original)
    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        # inside a compiled block (`vitpool.kernels.compiled`) inductor fuses Hugging Face's math itself
        if not torch.compiler.is_compiling() and FUSED_OPS.get():
            cos2 = cos[0] if cos.dim() == 3 and cos.shape[0] == 1 else cos  # Kimi-K2.5: [1, rows, d]
            sin2 = sin[0] if sin.dim() == 3 and sin.shape[0] == 1 else sin
            # [batch, rows, heads, head_dim] against one table [rows, head_dim], as Hugging Face's
            # broadcast reads it (Kimi-K2.5's batch of one, Step-3.7's tiles): flattened to rows,
            # row r takes table row r % rows
            batched = q.dim() == 4 and k.shape == q.shape and cos2.dim() == 2 and q.shape[1] == cos2.shape[0]
            q3, k3 = (q.flatten(0, 1), k.flatten(0, 1)) if batched else (q, k)
            one_table_a_row = q.dim() == 3 and cos2.shape[:1] == q.shape[:1]
            if (batched or one_table_a_row) and _rotary_fits(q3, k3, cos2, sin2, partial):
                q_out, k_out = fused_rotary(q3, cos2, sin2), fused_rotary(k3, cos2, sin2)
                return q_out.view(q.shape), k_out.view(k.shape)
        return original(q, k, cos, sin)

    apply_rotary_pos_emb_vision.__vitpool_original__ = original
    setattr(modeling, ROTARY_FUNCTION, apply_rotary_pos_emb_vision)


def _rotary_fits(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, partial: bool = False
) -> bool:
    """The shapes every family passes: q, k [rows, heads, head_dim] in half precision with unit
    stride in head_dim; cos, sin [positions, head_dim] (narrower where the function turns only part
    of a head) fp32 or half precision with unit stride, positions dividing rows."""
    if not _kernel_takes(q, k):
        return False
    if q.dim() != 3 or k.shape != q.shape or cos.dim() != 2 or sin.shape != cos.shape:
        return False
    rows, _, head_dim = q.shape
    width = cos.shape[1]
    return (
        (width == head_dim or partial and 0 < width < head_dim)
        and cos.shape[0] > 0
        and rows % cos.shape[0] == 0
        and width % 2 == 0
        and cos.dtype == sin.dtype
        and cos.dtype in (torch.float32, *HALF_DTYPES)
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
        and cos.stride(0) == sin.stride(0)
    )


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in fp32, cast back to x's dtype: [rows, heads, head_dim].

    cos and sin are [positions, width] (fp32 or half precision, unit stride in width), and row r of
    x takes position r % positions: one table per row, or one sequence's table for a batch of
    equal-length sequences flattened to rows (no copy of the table per sequence). The first width
    dims of each head are turned, the rest copied (width == head_dim for every family but
    MiniMax-M3-VL)."""
    rows, heads, head_dim = x.shape
    positions, width = cos.shape
    fits = sin.shape == cos.shape and 0 < width <= head_dim and not width % 2
    if not fits or (rows and (not positions or rows % positions)):
        raise ValueError(f"rotary tables {tuple(cos.shape)} do not fit rows {tuple(x.shape)}")
    out = torch.empty((rows, heads, head_dim), device=x.device, dtype=x.dtype)
    if rows:
        half, passed = width // 2, head_dim - width
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
            PASSED=passed,
            BLOCK_HEADS=next_power_of_two(heads),
            BLOCK_HALF=next_power_of_two(half),
            BLOCK_PASSED=next_power_of_two(max(passed, 1)),
        )
    return out


def fused_interleaved_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Llama 4's rotary in fp32, cast back to x's dtype: each pair (x[2i], x[2i + 1]) of x [rows,
    heads, head_dim] as a complex number times table[r % positions, i] (`table`: complex64
    [positions, head_dim / 2], read in place)."""
    rows, heads, head_dim = x.shape
    positions = table.shape[0]
    fits = table.dtype == torch.complex64 and table.shape[1:] == (head_dim // 2,) and not head_dim % 2
    if not fits or (rows and (not positions or rows % positions)):
        raise ValueError(f"rotary table {tuple(table.shape)}, {table.dtype}, does not fit {tuple(x.shape)}")
    pairs = torch.view_as_real(table)  # [positions, head_dim / 2, (cos, sin)], no copy
    out = torch.empty((rows, heads, head_dim), device=x.device, dtype=x.dtype)
    if rows:
        half = head_dim // 2
        _interleaved_rotary_kernel()[(rows,)](
            x,
            pairs,
            out,
            heads,
            positions,
            x.stride(0),
            x.stride(1),
            pairs.stride(0),
            pairs.stride(1),
            HALF=half,
            BLOCK_HEADS=next_power_of_two(heads),
            BLOCK_HALF=next_power_of_two(half),
        )
    return out


def _kernel_takes(q: torch.Tensor, k: torch.Tensor) -> bool:
    """q and k in half precision on CUDA with no autograd through them (the kernel has no backward)."""
    if not (q.is_cuda and q.dtype in HALF_DTYPES and k.dtype == q.dtype and triton_available()):
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))


def _patch_interleaved_rotary(modeling: types.ModuleType) -> None:
    original = getattr(modeling, INTERLEAVED_ROTARY_FUNCTION)
    if getattr(original, "__vitpool_original__", None) is not None:
        return

    @functools.wraps(original)
    def vision_apply_rotary_emb(query, key, freqs_ci):
        # query, key [batch, rows, heads, head_dim]; freqs_ci complex64 holding [rows, head_dim / 2]
        # (Hugging Face views it as [1, rows, 1, head_dim / 2])
        if not torch.compiler.is_compiling() and FUSED_OPS.get() and _interleaved_fits(query, key, freqs_ci):
            table = freqs_ci.reshape(query.shape[1], query.shape[-1] // 2)
            rows = (-1, *query.shape[2:])
            return (
                fused_interleaved_rotary(query.reshape(rows), table).view(query.shape),
                fused_interleaved_rotary(key.reshape(rows), table).view(key.shape),
            )
        return original(query, key, freqs_ci)

    vision_apply_rotary_emb.__vitpool_original__ = original
    setattr(modeling, INTERLEAVED_ROTARY_FUNCTION, vision_apply_rotary_emb)


def _interleaved_fits(query: torch.Tensor, key: torch.Tensor, freqs_ci: torch.Tensor) -> bool:
    if not _kernel_takes(query, key) or query.dim() != 4 or key.shape != query.shape:
        return False
    head_dim = query.shape[-1]
    return (
        head_dim % 2 == 0
        and freqs_ci.dtype == torch.complex64
        and freqs_ci.device == query.device
        and freqs_ci.is_contiguous()
        and freqs_ci.numel() == query.shape[1] * head_dim // 2
        and query.stride(-1) == 1
        and key.stride(-1) == 1
    )


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
        PASSED: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASSED: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 past ~600k rows
        position = row % num_positions
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        cols = tl.arange(0, BLOCK_HALF)[None, :]
        col_ok = cols < HALF
        mask = (heads < num_heads) & col_ok
        x_head = x_ptr + row * x_row_stride + heads * x_head_stride
        out_head = out_ptr + row * (num_heads * (2 * HALF + PASSED)) + heads * (2 * HALF + PASSED)
        x = x_head + cols
        x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
        c = cos_ptr + position * cos_row_stride + cols
        s = sin_ptr + position * cos_row_stride + cols
        cos1 = tl.load(c, mask=col_ok, other=0.0).to(tl.float32)
        cos2 = tl.load(c + HALF, mask=col_ok, other=0.0).to(tl.float32)
        sin1 = tl.load(s, mask=col_ok, other=0.0).to(tl.float32)
        sin2 = tl.load(s + HALF, mask=col_ok, other=0.0).to(tl.float32)
        # rotate_half(x) = cat(-x2, x1), as Hugging Face computes it, in fp32
        first = x1 * cos1 + (-x2) * sin1
        second = x2 * cos2 + x1 * sin2
        out = out_head + cols
        tl.store(out, first.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, second.to(out_ptr.dtype.element_ty), mask=mask)
        if PASSED > 0:  # the dims past the table's width, as they are
            tail = tl.arange(0, BLOCK_PASSED)[None, :]
            tail_mask = (heads < num_heads) & (tail < PASSED)
            kept = tl.load(x_head + 2 * HALF + tail, mask=tail_mask, other=0.0)
            tl.store(out_head + 2 * HALF + tail, kept, mask=tail_mask)

    return rotary


@functools.cache
def _interleaved_rotary_kernel() -> Callable:
    """Llama 4's: each row's heads loaded whole (contiguous, vectorized) and split into their pairs
    in registers; stride-2 loads of the pairs ran slower than Hugging Face's five kernels."""
    import triton
    import triton.language as tl

    @triton.jit
    def interleaved_rotary(
        x_ptr,
        table_ptr,
        out_ptr,
        num_heads,
        num_positions,
        x_row_stride,
        x_head_stride,
        table_row_stride,
        table_pair_stride,
        HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        position = row % num_positions
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        cols = tl.arange(0, 2 * BLOCK_HALF)[None, :]
        mask = (heads < num_heads) & (cols < 2 * HALF)
        x = tl.load(x_ptr + row * x_row_stride + heads * x_head_stride + cols, mask=mask, other=0.0)
        real, imaginary = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_HEADS, BLOCK_HALF, 2)))
        pairs = tl.arange(0, BLOCK_HALF)[None, :]
        angle = table_ptr + position * table_row_stride + pairs * table_pair_stride
        cos = tl.load(angle, mask=pairs < HALF, other=0.0)
        sin = tl.load(angle + 1, mask=pairs < HALF, other=0.0)
        # (real + i imaginary)(cos + i sin), as Hugging Face's complex product in fp32
        rotated = tl.interleave(real * cos - imaginary * sin, imaginary * cos + real * sin)
        out = out_ptr + row * (num_heads * 2 * HALF) + heads * (2 * HALF) + cols
        tl.store(out, rotated.to(out_ptr.dtype.element_ty), mask=mask)

    return interleaved_rotary
