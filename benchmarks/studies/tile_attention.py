"""SDPA's kernels on the tiled towers' attention: a batch of equal-length sequences, dense
[views, heads, rows, head_dim] as a tiled tower runs it (no mask), each kernel captured in a CUDA
graph and replayed. What SDPA picks unasked (Hugging Face eager's kernel) against cuDNN, FlashAttention
and memory-efficient attention, forced.

    python benchmarks/studies/tile_attention.py [--runs 200] [--out tile_attention.json]

Prints median (p99) µs per call, TFLOP/s, and the error against fp32 math SDPA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
import torch.nn.functional as F
from attention_backends import graph_time
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {  # name -> (views, heads, rows, head_dim)
    "Gemma 3 1 view (896²)": (1, 16, 4096, 72),
    "Gemma 3 5 views": (5, 16, 4096, 72),
    "Idefics3 1 view (364²)": (1, 16, 676, 72),
    "Idefics3 10 views": (10, 16, 676, 72),
    "InternVL 7 views (448²)": (7, 16, 1025, 64),
    "Llama 4 7 views (336²)": (7, 16, 577, 88),
    "GLM-OCR 1x1024² (one sequence)": (1, 16, 5184, 64),
}
BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def run_with(backend: SDPBackend | None):
    def run(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    print(f"GPU: {results['gpu']}, torch {results['torch']}; median (p99) µs of {args.runs} graph replays")
    for name, (views, heads, rows, dim) in SHAPES.items():
        q, k, v = (
            torch.randn(views, heads, rows, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
        )
        with sdpa_kernel([SDPBackend.MATH]):
            want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        flops = 4 * views * heads * rows * rows * dim
        row = {}
        for label, backend in BACKENDS.items():
            try:
                timing, out = graph_time(run_with(backend), (q, k, v), args.runs)
            except RuntimeError as error:
                row[label] = {"error": str(error).splitlines()[0][:160]}
                continue
            error = float((out.float() - want).norm() / want.norm())
            row[label] = {**timing, "tflops": flops / (timing["median_ms"] * 1e-3) / 1e12, "rel_error": error}
        results["shapes"][name] = row
        cells = [
            f"{label} {r['median_ms'] * 1e3:.0f} ({r['p99_ms'] * 1e3:.0f}) "
            f"{r['tflops']:.0f} TF/s {r['rel_error']:.0e}"
            if "error" not in r
            else f"{label} failed: {r['error'][:60]}"
            for label, r in row.items()
        ]
        print(f"{name}: " + " | ".join(cells))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
