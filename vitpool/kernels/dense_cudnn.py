"""Dense cuDNN attention (SDPA's cuDNN kernel) over sequences whose boundaries are known.

cuDNN's dense kernel has no packed form that can be captured, a padding mask takes its gain away,
and it builds a plan for every new shape. So each call covers one whole sequence, padded to a
multiple of `DENSE_BUCKET_ROWS` rows so that the plans stay few, and the padding keys are masked by
one extra head dimension, not by a mask tensor: an eager batch's long sequences one call each
(`dense_attention`), or a budget's graph of one sequence and its padding
(`leading_sequence_attention`, the end read on the device). When these run is
`vitpool.kernels.attention`'s choice.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vitpool.kernels.fused_switch import next_power_of_two, triton_available

# cuDNN builds a plan per shape: sequences are padded up to a multiple of this many rows
DENSE_BUCKET_ROWS = 256
# The padding keys' extra head dimension: with the queries' 1 there, their scores sit this far
# below every real key's (times the softmax scale), so their weights are exactly 0 in fp32.
_MASKED_KEY = -30000.0


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: tuple[int, ...], scaling: float | None
) -> torch.Tensor:
    """Attention within each sequence [start, end) of `boundaries` over [rows, heads, head_dim],
    one dense SDPA call per sequence (cuDNN's kernel on a GPU).

    Each sequence is padded to a multiple of `DENSE_BUCKET_ROWS` rows, so that a stream of
    varied sizes needs few cuDNN plans, and its head dimension by at least one column, where
    queries hold 1 and keys 0, or `_MASKED_KEY` for the padding rows: their scores fall out of
    the softmax without a mask tensor (which would cost cuDNN its speed). Rows outside every
    sequence are left as zeros.
    """
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    nonempty = [(start, end) for start, end in itertools.pairwise(boundaries) if end > start]
    if nonempty == [(0, q.shape[0])]:  # one sequence over every row: no second copy
        return _dense_sequence(q, k, v, scale).contiguous()
    out = torch.zeros_like(q) if boundaries[-1] < q.shape[0] or boundaries[0] > 0 else torch.empty_like(q)
    for start, end in itertools.pairwise(boundaries):
        if end > start:
            out[start:end] = _dense_sequence(q[start:end], k[start:end], v[start:end], scale)
    return out


def leading_sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Attention of every row over the keys of the first sequence [0, cu_seqlens[1]), one dense
    SDPA call over all rows, the end read on the device (capturable). Exact for a batch of one
    sequence followed by padding rows (whose outputs attend to the sequence and are finite)."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    return _dense_sequence(q, k, v, scale, masked_from=cu_seqlens[1], padded_rows=q.shape[0]).contiguous()


def _dense_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    masked_from: int | torch.Tensor | None = None,
    padded_rows: int | None = None,
) -> torch.Tensor:
    """Dense SDPA over [rows, heads, head_dim]; keys from row `masked_from` on (default: none of
    the rows) and the padding up to `padded_rows` (default: the next bucket) are masked."""
    rows, _, head_dim = q.shape
    if padded_rows is None:
        padded_rows = -(-rows // DENSE_BUCKET_ROWS) * DENSE_BUCKET_ROWS
    padded_dim = (head_dim // 8 + 1) * 8  # cuDNN takes multiples of 8; one column at least is free
    masked_from = rows if masked_from is None else masked_from
    padded = pad_for_dense_attention(q, k, v, padded_rows, padded_dim, masked_from, _MASKED_KEY)
    if padded is not None:
        q_pad, k_pad, v_pad = padded
    else:
        pad = (0, padded_dim - head_dim, 0, 0, 0, padded_rows - rows)
        q_pad, k_pad, v_pad = (F.pad(t, pad) for t in (q, k, v))
        q_pad[:, :, head_dim] = 1.0
        if isinstance(masked_from, torch.Tensor):
            row = torch.arange(padded_rows, device=q.device, dtype=masked_from.dtype)
            k_pad[:, :, head_dim] = torch.where(row >= masked_from, _MASKED_KEY, 0.0).to(q.dtype).unsqueeze(1)
        else:
            k_pad[masked_from:, :, head_dim] = _MASKED_KEY
    # [rows, heads, dim] -> [1, heads, rows, dim]: SDPA's layout, the rows-major memory kept
    q_pad, k_pad, v_pad = (t.transpose(0, 1).unsqueeze(0) for t in (q_pad, k_pad, v_pad))
    backends = [SDPBackend.CUDNN_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        out = F.scaled_dot_product_attention(q_pad, k_pad, v_pad, scale=scale)
    return out[0, :, :rows, :head_dim].transpose(0, 1)


def pad_for_dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padded_rows: int,
    padded_dim: int,
    masked_from: int | torch.Tensor,
    masked_key: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q, k, v [rows, heads, head_dim] copied into zeros of [padded_rows, heads, padded_dim] by one
    Triton kernel, column head_dim set to 1 in q and, in k, to `masked_key` from row `masked_from`
    (an int, or a 0-d int32 tensor on the device) on: the padding of `_dense_sequence`. Torch's own
    ops take six kernels (a fill and a copy per tensor) and the two column writes, more GPU time
    than this kernel and the copies left (`benchmarks/HISTORY.md`, "Attention where compute
    dominates: cuDNN on the default install").
    None where the kernel cannot run (CPU, no Triton, a head stride that is not unit)."""
    rows, heads, head_dim = q.shape
    if not (
        q.is_cuda and triton_available() and all(t.stride(-1) == 1 and t.shape == q.shape for t in (k, v))
    ):
        return None
    on_device = isinstance(masked_from, torch.Tensor)
    outputs = [
        torch.empty((padded_rows, heads, padded_dim), device=q.device, dtype=q.dtype) for _ in range(3)
    ]
    with torch.cuda.device(q.device):
        _pad_kernel()[(padded_rows,)](
            q,
            k,
            v,
            *outputs,
            rows,
            masked_from if on_device else q,
            0 if on_device else int(masked_from),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            heads,
            masked_key,
            HEAD_DIM=head_dim,
            PADDED_DIM=padded_dim,
            MASK_FROM_DEVICE=on_device,
            BLOCK_HEADS=next_power_of_two(heads),
            BLOCK_DIM=next_power_of_two(padded_dim),
        )
    return outputs[0], outputs[1], outputs[2]


@functools.cache
def _pad_kernel() -> Callable:
    """The Triton kernel, defined on first use (triton is imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def pad(
        q_ptr,
        k_ptr,
        v_ptr,
        q_out,
        k_out,
        v_out,
        rows,
        limit_ptr,
        limit_value,
        q_row_stride,
        q_head_stride,
        k_row_stride,
        k_head_stride,
        v_row_stride,
        v_head_stride,
        num_heads,
        masked_key,
        HEAD_DIM: tl.constexpr,
        PADDED_DIM: tl.constexpr,
        MASK_FROM_DEVICE: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_DIM: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        cols = tl.arange(0, BLOCK_DIM)[None, :]
        load_mask = (heads < num_heads) & (cols < HEAD_DIM) & (row < rows)
        q = tl.load(q_ptr + row * q_row_stride + heads * q_head_stride + cols, mask=load_mask, other=0.0)
        k = tl.load(k_ptr + row * k_row_stride + heads * k_head_stride + cols, mask=load_mask, other=0.0)
        v = tl.load(v_ptr + row * v_row_stride + heads * v_head_stride + cols, mask=load_mask, other=0.0)
        limit = tl.load(limit_ptr).to(tl.int64) if MASK_FROM_DEVICE else limit_value
        extra = cols == HEAD_DIM
        q = tl.where(extra, 1.0, q)
        k = tl.where(extra & (row >= limit), masked_key, k)
        offsets = row * (num_heads * PADDED_DIM) + heads * PADDED_DIM + cols
        store_mask = (heads < num_heads) & (cols < PADDED_DIM)
        tl.store(q_out + offsets, q.to(q_out.dtype.element_ty), mask=store_mask)
        tl.store(k_out + offsets, k.to(k_out.dtype.element_ty), mask=store_mask)
        tl.store(v_out + offsets, v.to(v_out.dtype.element_ty), mask=store_mask)

    return pad
