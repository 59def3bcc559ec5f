"""Attention for one long sequence at the towers' shape (16 heads of 72, bf16): PyTorch's
FlashAttention-2 (`varlen_attn`) against SDPA's cuDNN kernel, dense at the sequence's own rows, and
vitpool's `dense_attention` (cuDNN over rows padded to a bucket, the padding keys masked by an extra
head dimension), with the copies it makes. Eager calls (that is how vitpool runs them), CUDA-event
medians (p99) in µs; the first call at each new length (a cuDNN plan is built per shape) in ms; the
error against fp32 math SDPA.

    python benchmarks/studies/dense_attention.py [--lengths 256,1024,...] [--runs 50] [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py lives one folder up

import torch
import torch.nn.functional as F
from common import gpu_ms, summarize
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import varlen_attn

from vitpool.kernels.attention import dense_attention

DEFAULT_LENGTHS = "256,512,784,1024,1600,2304,3136,4900,7056,9604,12544,16384"


def fa2(q, k, v, n):
    cu = torch.tensor([0, n], device=q.device, dtype=torch.int32)
    return varlen_attn(q, k, v, cu, cu, n, n)


def cudnn_exact(q, k, v, n):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
    return out[0].transpose(0, 1)


def vitpool_dense(q, k, v, n):
    return dense_attention(q, k, v, (0, n), None)


def first_call_ms(function, *args) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    function(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=72)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    kernels = {"fa2": fa2, "cudnn_exact": cudnn_exact, "vitpool_dense": vitpool_dense}
    # load cuDNN's library before anything is timed (its first call of all takes ~1 s)
    warm = torch.randn(256, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    cudnn_exact(warm, warm, warm, 256)
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        q, k, v = (
            torch.randn(n, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
        )
        with sdpa_kernel([SDPBackend.MATH]):
            want = F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q, k, v)))
        want = want[0].transpose(0, 1)
        row = {"rows": n}
        for name, kernel in kernels.items():
            row[f"{name}_first_ms"] = first_call_ms(kernel, q, k, v, n)
            got = kernel(q, k, v, n).float()
            row[f"{name}_rel_error"] = float((got - want).norm() / want.norm())
            timings = gpu_ms(lambda kernel=kernel, q=q, k=k, v=v, n=n: kernel(q, k, v, n), args.runs)
            row[name] = summarize([1e3 * t for t in timings])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows}, indent=2))
    print(
        f"\nGPU: {gpu}, torch {torch.__version__}; {args.heads} heads of {args.head_dim}; median (p99) µs "
        f"of {args.runs} eager calls; first call at the length in ms"
    )
    print(
        "| rows | FA2 | cuDNN exact | vitpool dense (bucketed) | dense / FA2 "
        "| first call FA2 / cuDNN exact / dense | rel. err FA2 / dense |"
    )
    print("|---" * 7 + "|")
    for row in rows:
        cells = [str(row["rows"])] + [
            f"{row[name]['median_ms']:.0f} ({row[name]['p99_ms']:.0f})" for name in kernels
        ]
        cells.append(f"{row['vitpool_dense']['median_ms'] / row['fa2']['median_ms']:.2f}")
        cells.append(" / ".join(f"{row[f'{name}_first_ms']:.1f}" for name in kernels))
        cells.append(f"{row['fa2_rel_error']:.1e} / {row['vitpool_dense_rel_error']:.1e}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
