"""Latency of one encode: Hugging Face eager (sdpa) vs vitpool's GraphEncoder, same weights, same run.

The real-size Qwen3-VL-8B vision tower (its config values, random bf16 weights) on one GPU.
Both paths start from the processor's output (float32 pixels on the host) and end with the
embeddings on the GPU, synchronised. Prints a Markdown table; writes JSON with --out.

    python benchmarks/encoder_latency.py [--runs 60] [--warmup 10] [--out results.json]
    python benchmarks/encoder_latency.py --family glm4v     # another family: family_latency.py's run
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from common import QWEN3_VL_8B_VISION, image, summarize, time_ms, video

from vitpool import GraphEncoder

WORKLOADS = {
    "1x224": lambda: [image(224)],
    "4x224": lambda: [image(224) for _ in range(4)],
    "1x448": lambda: [image(448)],
    "1x896": lambda: [image(896)],
    "video 8x224": lambda: [video(8, 224)],
    "mix of 8 images": lambda: [image(s) for s in (224, 256, 320, 384, 448, 512, 640, 768)],
}


def hugging_face_eager(tower: torch.nn.Module, items: list) -> list[torch.Tensor]:
    """The usual way: all items in one call, grid_thw on the GPU, the tower computes its metadata."""
    pixels = torch.cat([it.pixel_values for it in items]).to("cuda", torch.bfloat16)
    grid_thw = torch.tensor([it.grid_thw for it in items], device="cuda")
    output = tower(pixels, grid_thw=grid_thw)
    return [output.pooler_output, *output.deepstack_features]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--budgets", type=str, default=None, help="comma-separated token budgets")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--attention", default="auto", help="the encoder's attention kernel: auto, fa2, fa4")
    parser.add_argument(
        "--fused-ops", default="on", choices=("on", "off"), help="fused rotary, patch GEMM, MLP GELU"
    )
    parser.add_argument(
        "--compiled-blocks", default="off", choices=("on", "off"), help="torch.compile'd blocks"
    )
    parser.add_argument(
        "--pinned-staging",
        default="on",
        choices=("on", "off"),
        help="off: large host pixels copy straight from pageable memory (the code before it)",
    )
    parser.add_argument(
        "--family",
        default="qwen3_vl",
        help="qwen3_vl (this script's workloads) or a family of family_latency.py",
    )
    args = parser.parse_args()
    if args.family != "qwen3_vl":
        import sys

        import family_latency

        sys.argv = [
            sys.argv[0],
            "--families",
            args.family,
            "--runs",
            str(args.runs),
            "--warmup",
            str(args.warmup),
        ]
        if args.out:
            sys.argv += ["--out", str(args.out)]
        family_latency.main()
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    gpu = torch.cuda.get_device_name()
    if args.pinned_staging == "off":
        from vitpool.graphs.buffers import PinnedStaging

        PinnedStaging.MIN_BYTES = PinnedStaging.MAX_BYTES + 1  # nothing is staged

    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(QWEN3_VL_8B_VISION))
        torch.manual_seed(0)
        budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else None
        start = time.perf_counter()
        encoder = GraphEncoder.from_pretrained(
            directory,
            budgets=budgets,
            device="cuda",
            dtype=torch.bfloat16,
            attention=args.attention,
            fused_ops=args.fused_ops == "on",
            compiled_blocks=args.compiled_blocks == "on",
        )
        build_s = time.perf_counter() - start
    stats = encoder.stats()
    memory_after_capture_gib = torch.cuda.memory_reserved() / 1024**3
    reference = copy.deepcopy(encoder.adapter.tower)
    reference.config._attn_implementation = "sdpa"

    results = {
        "gpu": gpu,
        "torch": torch.__version__,
        "attention": args.attention,
        "fused_ops": args.fused_ops,
        "compiled_blocks": args.compiled_blocks,
        "pinned_staging": args.pinned_staging,
        "num_budgets": len(encoder.budgets),
        "budgets": [b.num_tokens for b in encoder.budgets],
        "capture_and_check_s": stats.capture_seconds,
        "build_s": build_s,
        "disabled_budgets": stats.disabled_budgets,
        "memory_reserved_after_capture_gib": memory_after_capture_gib,
        "weights_gib": sum(p.numel() * p.element_size() for p in encoder.adapter.tower.parameters())
        / 1024**3,
        "workloads": {},
    }
    with torch.no_grad():
        for name, build in WORKLOADS.items():
            items = build()
            # same items, same weights: check agreement before timing
            graph_out = encoder.encode(items)
            eager_out = hugging_face_eager(reference, items)
            got = torch.cat([e.tokens for e in graph_out]).float()
            rel_error = float(
                torch.linalg.vector_norm(got - eager_out[0].float())
                / torch.linalg.vector_norm(eager_out[0].float())
            )
            eager = summarize(
                time_ms(lambda items=items: hugging_face_eager(reference, items), args.runs, args.warmup)
            )
            graph = summarize(time_ms(lambda items=items: encoder.encode(items), args.runs, args.warmup))
            results["workloads"][name] = {
                "patches": sum(it.pixel_values.shape[0] for it in items),
                "hf_eager": eager,
                "vitpool": graph,
                "ratio": graph["median_ms"] / eager["median_ms"],
                "rel_error_vs_hf": rel_error,
            }
    final = encoder.stats()
    results["graph_items"] = final.graph_items
    results["eager_items"] = final.eager_items
    results["padding_waste"] = final.padding_waste

    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(
        f"\nGPU: {gpu}, torch {torch.__version__}; {args.runs} runs after {args.warmup} warm-up; attention "
        f"{args.attention}, fused ops {args.fused_ops}, compiled blocks {args.compiled_blocks}, "
        f"pinned staging {args.pinned_staging}"
    )
    print(
        f"{len(encoder.budgets)} budgets {results['budgets'][0]}..{results['budgets'][-1]} tokens, "
        f"built in {build_s:.1f} s (captured and checked in {stats.capture_seconds:.2f} s), "
        f"{memory_after_capture_gib:.2f} GiB reserved after capture "
        f"({results['weights_gib']:.2f} GiB of it weights), disabled: {stats.disabled_budgets}"
    )
    print(
        "| workload | patches | HF eager median (p99) ms | vitpool median (p99) ms | ratio | rel. err vs HF |"
    )
    print("|---|---|---|---|---|---|")
    for name, row in results["workloads"].items():
        print(
            f"| {name} | {row['patches']} "
            f"| {row['hf_eager']['median_ms']:.2f} ({row['hf_eager']['p99_ms']:.2f}) "
            f"| {row['vitpool']['median_ms']:.2f} ({row['vitpool']['p99_ms']:.2f}) | {row['ratio']:.2f} "
            f"| {row['rel_error_vs_hf']:.1e} |"
        )


if __name__ == "__main__":
    main()
