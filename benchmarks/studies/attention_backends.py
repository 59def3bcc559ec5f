"""Attention kernels at the vision towers' shapes, each captured in a CUDA graph and replayed:
PyTorch's FlashAttention-2 varlen (`varlen_attn`, vitpool's path today) against SDPA's backends
(cuDNN, FlashAttention, efficient) on the packed rows as nested (jagged) tensors, and on dense
[1, heads, rows, head_dim] where the batch is one sequence.

    python benchmarks/studies/attention_backends.py [--heads 16] [--head-dim 72] [--runs 200]

Prints median (p99) µs per call and the error against fp32 math SDPA; a backend that cannot run or
be captured at a shape says why.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
import torch.nn.functional as F
from common import summarize
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name -> sequence lengths packed into one batch
    "1x3136 (896²)": [3136],
    "1x3136 + 960 pad": [3136, 960],
    "1x12544 (1792²)": [12544],
    "1x12544 + 1792 pad": [12544, 1792],
    "4x4096": [4096] * 4,
    "64x256": [256] * 64,
    "16x196 + pad": [196] * 16 + [64],
}


def flash_attention_4(q, k, v, cu, max_len):
    """FlashAttention-4 (`flash-attn-4`, CuTe DSL; FA3-style kernels on Hopper), when installed."""
    from flash_attn.cute import flash_attn_varlen_func

    out = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len
    )
    return out[0] if isinstance(out, tuple) else out


def varlen(q, k, v, cu, max_len):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, max_len, max_len)


def nested_sdpa(backend: SDPBackend) -> Callable:
    def run(q, k, v, cu, max_len):
        def jagged(t):
            return torch.nested.nested_tensor_from_jagged(t, cu, min_seqlen=1, max_seqlen=max_len).transpose(
                1, 2
            )

        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(jagged(q), jagged(k), jagged(v))
        return out.transpose(1, 2).values()

    return run


def ragged_cudnn(q, k, v, cu, max_len):
    """cuDNN's ragged (packed) attention, called as the nested-tensor path calls it."""
    out = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, False)[0]
    return out


def masked_dense(backend: SDPBackend) -> Callable:
    """The buffer's rows as one dense sequence, keys past the first sequence masked out: the first
    sequence's rows are exact; what the padding rows get does not matter."""

    def run(q, k, v, cu, max_len):
        rows = q.shape[0]
        valid = torch.arange(rows, device=q.device) < cu[1]
        bias = torch.zeros(rows, device=q.device, dtype=q.dtype).masked_fill(~valid, float("-inf"))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(
                *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=bias.view(1, 1, 1, rows)
            )
        return out[0].transpose(0, 1)

    return run


def dense_sdpa(backend: SDPBackend) -> Callable:
    def run(q, k, v, cu, max_len):
        if q.shape[0] != max_len:
            raise ValueError("dense runs one sequence only")
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
        return out[0].transpose(0, 1)

    return run


def reference(q, k, v, lengths):
    outs, start = [], 0
    for n in lengths:
        part = [t[start : start + n].transpose(0, 1)[None].float() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            outs.append(F.scaled_dot_product_attention(*part)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def graph_time(fn: Callable, args: tuple, runs: int) -> tuple[dict, torch.Tensor]:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    for _ in range(10):
        graph.replay()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(runs):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return summarize(times), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=72)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    backends = {
        "varlen_attn (FA2)": varlen,
        "FA4 varlen": flash_attention_4,
        "nested cuDNN": nested_sdpa(SDPBackend.CUDNN_ATTENTION),
        "ragged cuDNN (aten)": ragged_cudnn,
        "nested flash": nested_sdpa(SDPBackend.FLASH_ATTENTION),
        "nested efficient": nested_sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "dense cuDNN": dense_sdpa(SDPBackend.CUDNN_ATTENTION),
        "masked dense cuDNN": masked_dense(SDPBackend.CUDNN_ATTENTION),
        "masked dense efficient": masked_dense(SDPBackend.EFFICIENT_ATTENTION),
        "dense flash": dense_sdpa(SDPBackend.FLASH_ATTENTION),
    }
    gpu = torch.cuda.get_device_name()
    results = {
        "gpu": gpu,
        "torch": torch.__version__,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "rows": [],
    }
    generator = torch.Generator(device="cuda").manual_seed(0)
    for shape, lengths in SHAPES.items():
        rows = sum(lengths)
        q, k, v = (
            torch.randn(
                rows, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=generator
            )
            for _ in range(3)
        )
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        want = reference(q, k, v, lengths)
        for name, fn in backends.items():
            try:
                stats, out = graph_time(fn, (q, k, v, cu, max(lengths)), args.runs)
                if name.startswith("masked"):  # only the first sequence's rows are meant to be exact
                    out, want_rows = out[: lengths[0]], want[: lengths[0]]
                else:
                    want_rows = want
                error = float((out.float() - want_rows).norm() / want_rows.norm())
                row = {"shape": shape, "backend": name, **stats, "rel_error": error}
            except Exception as exc:  # noqa: BLE001 - a backend that fails is a result here
                row = {"shape": shape, "backend": name, "error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            results["rows"].append(row)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)
    print(
        f"\n{gpu}, torch {torch.__version__}, heads {args.heads}, head_dim {args.head_dim}, bf16, "
        f"CUDA-graph replays, median (p99) µs of {args.runs}"
    )
    print("| shape | backend | µs | rel. err |\n|---|---|---|---|")
    for row in results["rows"]:
        if "error" in row:
            print(f"| {row['shape']} | {row['backend']} | — | {row['error']} |")
        else:
            print(
                f"| {row['shape']} | {row['backend']} "
                f"| {1000 * row['median_ms']:.0f} ({1000 * row['p99_ms']:.0f}) "
                f"| {row['rel_error']:.1e} |"
            )


if __name__ == "__main__":
    main()
