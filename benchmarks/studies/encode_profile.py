"""Where one in-process `GraphEncoder.encode` spends its time beyond the graph's GPU work.

The real-size Qwen3-VL-8B tower (random bf16 weights), one workload (default one 224² image).
Times the whole call, the graph replay alone (CUDA events) and, under the profiler, the host
operations of the call (self CPU time per op, summed over the runs, per call).

    python benchmarks/studies/encode_profile.py [--side 224] [--items 1] [--runs 100] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
from common import QWEN3_VL_8B_VISION, gpu_ms, image, summarize, time_ms
from torch.profiler import ProfilerActivity, profile

from vitpool import GraphEncoder
from vitpool.items import prepare_items
from vitpool.packing import pack


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--items", type=int, default=1)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--compiled-blocks", default="off", choices=("on", "off"))
    parser.add_argument("--attention", default="auto", help="the encoder's attention: auto, cudnn, fa2, fa4")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(QWEN3_VL_8B_VISION))
        encoder = GraphEncoder.from_pretrained(
            directory,
            device="cuda",
            dtype=torch.bfloat16,
            compiled_blocks=args.compiled_blocks == "on",
            attention=args.attention,
        )
    items = [image(args.side) for _ in range(args.items)]
    call = summarize(time_ms(lambda: encoder.encode(items), args.runs, 20))
    batches = pack([item.spec for item in prepare_items(items, encoder.adapter.item_rules)], encoder.budgets)
    if len(batches) != 1 or batches[0].budget not in encoder._runner("").graphs:
        raise SystemExit("the items do not run as one graph; pick fewer or smaller items")
    budget = batches[0].budget
    replay = summarize(gpu_ms(encoder._runner("").graphs[budget].replay, args.runs))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.runs):
            encoder.encode(items)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
    ops = [(e.key, e.self_cpu_time_total / args.runs, e.count / args.runs) for e in rows]
    phases = _phases(encoder, items, budget, args.runs)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "side": args.side,
        "items": args.items,
        "budget": budget.num_tokens,
        "attention": args.attention,
        "call": call,
        "replay": replay,
        "host_ops_us_per_call": ops,
        "phases_ms": phases,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(
        f"GPU: {result['gpu']}; {args.items}x{args.side}², budget {budget.num_tokens} tokens, "
        f"attention {args.attention}, {args.runs} runs"
    )
    print(
        f"encode: {call['median_ms']:.3f} ms median ({call['p99_ms']:.3f} p99); "
        f"graph replay alone: {replay['median_ms']:.3f} ms ({replay['p99_ms']:.3f})"
    )
    print("| host op | self CPU µs per call | calls per call |\n|---|---|---|")
    for name, micros, count in ops:
        print(f"| {name[:70]} | {micros:.1f} | {count:.1f} |")
    print("| phase (host time; '+ wait' includes the GPU) | median ms | p99 ms |\n|---|---|---|")
    for name, row in phases.items():
        print(f"| {name} | {row['median_ms']:.3f} | {row['p99_ms']:.3f} |")


def _phases(encoder, items, budget, runs: int) -> dict:
    """The steps of one graph call, each timed alone on the host, the GPU idle before each."""
    prepared = prepare_items(items, encoder.adapter.item_rules)
    specs, pixels = [p.spec for p in prepared], [p.pixels for p in prepared]
    graph = encoder._runner("").graphs[budget]

    def timed(step, wait: bool) -> dict:
        samples = []
        for _ in range(runs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if wait:
                torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) * 1e3)
        return summarize(samples)

    rows = encoder._runner("").rows(budget)
    views, metadata_views = encoder._runner("").buffers.input_views(rows, budget)
    filled = sum(p.shape[0] for p in pixels)
    metadata = encoder.adapter.build_metadata(specs, rows, budget)

    def zero_padding() -> None:
        views[filled:].zero_()

    def copy_metadata() -> None:
        for name, tensor in metadata.items():
            metadata_views[name].copy_(tensor, non_blocking=True)

    return {
        "prepare items (checks)": timed(lambda: prepare_items(items, encoder.adapter.item_rules), False),
        "fill: copy pixels": timed(lambda: encoder._runner("").copy_rows(views, pixels), False),
        "fill: zero padding": timed(zero_padding, False),
        "fill: metadata copies": timed(copy_metadata, False),
        "fill buffers": timed(lambda: encoder._runner("").fill(budget, specs, pixels), False),
        "fill buffers + wait": timed(lambda: encoder._runner("").fill(budget, specs, pixels), True),
        "metadata on the host": timed(
            lambda: encoder.adapter.build_metadata(specs, encoder._runner("").rows(budget), budget), False
        ),
        "replay launch": timed(graph.replay, False),
        "replay + wait": timed(graph.replay, True),
        "clone outputs + wait": timed(
            lambda: encoder._runner("").buffers.output_copies(budget.num_tokens, False), True
        ),
    }


if __name__ == "__main__":
    main()
