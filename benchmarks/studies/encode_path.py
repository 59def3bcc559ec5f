"""Which path one encode of a family's workload took (graph, dense graph, eager), with how much
padding, its time seen from the host, and the kernels the GPU ran for it (the profiler sees a graph's
kernels too): the heaviest by name, and their sum against the host's time (a gap is host work or
idle GPU). Flagship config, random bf16 weights.

    python benchmarks/studies/encode_path.py --family hunyuan_vl --workload 1x1024 [--runs 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # family_latency.py lives one folder up

import torch
from common import summarize, time_ms
from family_latency import CONFIGS, VISION_MODEL_TYPES, flagship_encoder, workloads
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", required=True, choices=sorted(VISION_MODEL_TYPES))
    parser.add_argument("--workload", required=True)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    vision = json.loads(CONFIGS.read_text())[args.family]["vision_config"]
    encoder = flagship_encoder(args.family, vision)
    items = workloads(args.family, vision)[args.workload]
    before = encoder.stats()
    encoder.encode(items)
    after = encoder.stats()
    taken = {
        name: getattr(after, name) - getattr(before, name)
        for name in (
            "graph_items",
            "dense_items",
            "eager_items",
            "eager_batches",
            "batch_rows",
            "padding_rows",
        )
    }
    budgets = {
        b: n - before.replays_per_budget.get(b, 0)
        for b, n in after.replays_per_budget.items()
        if n != before.replays_per_budget.get(b, 0)
    }
    host = summarize(time_ms(lambda: encoder.encode(items), args.runs, 5))
    runs = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            encoder.encode(items)
        torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time_total / 1000 / runs
    print(
        f"GPU: {torch.cuda.get_device_name()}; {args.family}, {args.workload}: {taken}, "
        f"budgets run {budgets}; dense graphs {after.dense_graphs}"
    )
    print(
        f"  host {host['median_ms']:.2f} (p99 {host['p99_ms']:.2f}) ms; "
        f"kernels {sum(kernels.values()):.2f} ms an encode"
    )
    for name, ms in sorted(kernels.items(), key=lambda pair: -pair[1])[:6]:
        print(f"  {ms:8.2f}  {name[:100]}")


if __name__ == "__main__":
    main()
