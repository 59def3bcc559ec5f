"""Where one encode's GPU time goes, for a family at its flagship's real size (random bf16 weights):
the kernels of one `GraphEncoder.encode` of a `family_latency.py` workload, run eager at the
items' own size under the profiler (a graph's replay hides its kernels), grouped by class
(kernel_breakdown.py's) and the heaviest kernels by name, with the replay time of the same encode.

    python benchmarks/studies/family_profile.py --family deepseek_ocr2 [--workload "1 view"] [--top 15]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
from common import summarize, time_ms
from family_latency import CONFIGS, VISION_MODEL_TYPES, flagship_encoder, workloads
from kernel_breakdown import kernel_class
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", required=True, choices=sorted(VISION_MODEL_TYPES))
    parser.add_argument(
        "--workload", default=None, help="a workload name of family_latency.py (default: the first)"
    )
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--compiled-blocks", action="store_true")
    args = parser.parse_args()
    vision = json.loads(CONFIGS.read_text())[args.family]["vision_config"]
    encoder = flagship_encoder(args.family, vision, compiled_blocks=args.compiled_blocks)
    loads = workloads(args.family, vision)
    name = args.workload or next(iter(loads))
    items = loads[name]
    replay = summarize(time_ms(lambda: encoder.encode(items), 30, 5))
    runner = encoder._runners  # a benchmark reads the encoder's internals
    from vitpool.items import prepare_items

    prepared = [part for item in prepare_items(items, encoder.adapter.item_rules) for part in item.parts]
    by_path: dict[str, list] = defaultdict(list)
    for part in prepared:
        by_path[part.spec.path].append(part)
    with torch.no_grad():
        for path, members in by_path.items():  # warm
            runner[path].run_exact(members)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for path, members in by_path.items():
                runner[path].run_exact(members)
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name].append(event.device_time_total / 1000)
    classes: dict[str, float] = defaultdict(float)
    for kernel, times in kernels.items():
        classes[kernel_class(kernel)] += sum(times)
    total = sum(classes.values())
    print(
        f"\nGPU: {torch.cuda.get_device_name()}; {args.family}, {name}: "
        f"eager static forward {total:.2f} ms of kernels; "
        f"encode through the graphs median {replay['median_ms']:.2f} (p99 {replay['p99_ms']:.2f}) ms"
    )
    for kind, ms in sorted(classes.items(), key=lambda pair: -pair[1]):
        print(f"  {kind:14s} {ms:8.2f} ms  {100 * ms / total:5.1f}%")
    print(f"  top {args.top} kernels (ms, launches):")
    for kernel, times in sorted(kernels.items(), key=lambda pair: -sum(pair[1]))[: args.top]:
        print(f"  {sum(times):8.2f} {len(times):5d}  {kernel[:110]}")


if __name__ == "__main__":
    main()
