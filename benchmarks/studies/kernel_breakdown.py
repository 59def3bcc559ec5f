"""GPU time of one static forward of the Qwen3-VL-8B tower (random bf16 weights) by kernel class:
attention, GEMM, convolution, norm, elementwise, copy / gather, other. One square image padded to
the rows of a budget, the forward run as vitpool captures it, under the profiler.

    python benchmarks/studies/kernel_breakdown.py [--rows 196,3136] [--attention fa2,fa4] \
        [--fused off,on,compiled] [--precision bf16,fp8]

Prints one table per (rows, attention kernel, fused work): ms per class, its share, kernel launches,
and the replay time of the same forward captured as a CUDA graph (GPU time plus the gaps between
kernels). "compiled" is the fused ops plus the torch.compile'd blocks (`vitpool.kernels.compiled`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
from common import QWEN3_VL_8B_VISION, gpu_ms, padded_image_batch, summarize
from torch.profiler import ProfilerActivity, profile

from vitpool.kernels.attention import fa4_available, use_attention
from vitpool.kernels.compiled import use_compiled_blocks
from vitpool.kernels.cudnn_packed import bind_stream
from vitpool.kernels.fp8 import install_fp8_linears, use_fp8
from vitpool.kernels.fused import use_fused_ops
from vitpool.models import load_adapter

# First match wins: (class, pattern over the kernel's name)
CLASSES = [
    ("attention", re.compile(r"flash|fmha|attn|attention|cudnn.*sdpa|FlashAttn", re.IGNORECASE)),
    ("convolution", re.compile(r"conv|implicit", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|sm90_xmma|cutlass|nvjet|matmul|wgmma", re.IGNORECASE)),
    ("norm", re.compile(r"layer_norm|layernorm|rms_norm|rmsnorm", re.IGNORECASE)),
    ("copy / gather", re.compile(r"copy|cat|index|gather|scatter|memcpy|memset|fill", re.IGNORECASE)),
    (
        "elementwise",
        re.compile(r"elementwise|vectorized|unrolled|reduce|triton|pointwise|rotary", re.IGNORECASE),
    ),
]


def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "other"


def breakdown(adapter, rows: int, backend: str, fused_work: str, precision: str = "bf16") -> dict:
    pixels, metadata = padded_image_batch(adapter, rows)
    fused, compiled = fused_work in ("on", "compiled"), fused_work == "compiled"
    with (
        torch.no_grad(),
        use_attention(backend),
        use_fused_ops(fused),
        use_compiled_blocks(compiled),
        use_fp8(precision == "fp8"),
    ):
        for _ in range(3):
            adapter.forward(pixels, metadata)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            adapter.forward(pixels, metadata)
            torch.cuda.synchronize()
        replay_ms = _replay_ms(lambda: adapter.forward(pixels, metadata))
    per_class: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    top: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        label = kernel_class(event.name)
        per_class[label][0] += event.device_time / 1000
        per_class[label][1] += 1
        top[event.name] += event.device_time / 1000
    total = sum(ms for ms, _ in per_class.values())
    return {
        "rows": rows,
        "attention": backend,
        "fused": fused_work,
        "precision": precision,
        "total_ms": total,
        "replay_ms": replay_ms,
        "kernels": sum(n for _, n in per_class.values()),
        "classes": {
            label: {"ms": ms, "share": ms / total, "kernels": n} for label, (ms, n) in per_class.items()
        },
        "top_kernels": sorted(top.items(), key=lambda kv: -kv[1])[:8],
    }


def _replay_ms(forward, runs: int = 50) -> float:
    """Median time of one replay of `forward` captured as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    bind_stream(
        torch.device("cuda"), stream
    )  # packed cuDNN's handle on the capturing stream, as vitpool captures
    with torch.cuda.graph(graph, stream=stream):
        forward()
    return summarize(gpu_ms(graph.replay, runs))["median_ms"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="196,3136")
    parser.add_argument("--attention", default="fa2,fa4")
    parser.add_argument(
        "--fused",
        default="off,on,compiled",
        help="off, on (rotary, patch GEMM, MLP GELU), compiled (plus compiled blocks)",
    )
    parser.add_argument("--precision", default="bf16", help="comma-separated: bf16, fp8 (the FP8 GEMMs)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(QWEN3_VL_8B_VISION))
        adapter = load_adapter(directory, torch.device("cuda"), torch.bfloat16)
    backends = [b for b in args.attention.split(",") if b != "fa4" or fa4_available(torch.device("cuda"))]
    if "fp8" in args.precision:
        install_fp8_linears(adapter.tower)
    results = [
        breakdown(adapter, int(rows), backend, fused, precision)
        for rows in args.rows.split(",")
        for backend in backends
        for fused in args.fused.split(",")
        for precision in args.precision.split(",")
    ]
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=2))
    print(
        f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; "
        f"one static forward, Qwen3-VL-8B tower"
    )
    for result in results:
        print(
            f"\n{result['rows']} rows, attention {result['attention']}, fused {result['fused']}, "
            f"{result['precision']}: "
            f"{result['total_ms']:.2f} ms GPU time, "
            f"{result['kernels']} kernels, graph replay {result['replay_ms']:.2f} ms"
        )
        print("| class | ms | share | kernels |\n|---|---|---|---|")
        for label, row in sorted(result["classes"].items(), key=lambda kv: -kv[1]["ms"]):
            print(f"| {label} | {row['ms']:.3f} | {100 * row['share']:.0f}% | {row['kernels']} |")
        print("top kernels: " + "; ".join(f"{name[:60]} {ms:.3f}" for name, ms in result["top_kernels"][:5]))


if __name__ == "__main__":
    main()
