"""Where one encode of a family's workload spends its time outside the GPU's kernels: the host ops
of `GraphEncoder.encode` through the graphs (self CPU time per call), the GPU's kernel time per call
and the wall time, at the flagship's real size (random bf16 weights). family_profile.py shows the
kernels; this shows what lies between them (copies of the caller's pixels, checks, launches).

    python benchmarks/studies/family_host_ops.py --family internvl --workload "7 views" [--runs 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
from common import summarize, time_ms
from family_latency import CONFIGS, VISION_MODEL_TYPES, flagship_encoder, workloads
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", required=True, choices=sorted(VISION_MODEL_TYPES))
    parser.add_argument("--workload", default=None, help="a workload name of family_latency.py")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    vision = json.loads(CONFIGS.read_text())[args.family]["vision_config"]
    encoder = flagship_encoder(args.family, vision)
    loads = workloads(args.family, vision)
    name = args.workload or next(iter(loads))
    items = loads[name]
    wall = summarize(time_ms(lambda: encoder.encode(items), args.runs, 5))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.runs):
            encoder.encode(items)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    cuda = torch.autograd.DeviceType.CUDA
    gpu_ms = sum(e.self_device_time_total for e in averages if e.device_type == cuda) / 1000 / args.runs
    print(
        f"\nGPU: {torch.cuda.get_device_name()}; {args.family}, {name}: encode median "
        f"{wall['median_ms']:.2f} (p99 {wall['p99_ms']:.2f}) ms; GPU time per call {gpu_ms:.2f} ms "
        "(under the profiler)"
    )
    print("  host ops by self CPU time per call (us, calls):")
    for event in sorted(averages, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        _row(event.self_cpu_time_total / args.runs, event.count / args.runs, event.key)
    print("  GPU ops by time per call (us, calls):")
    device_ops = [e for e in averages if e.self_device_time_total > 0]
    for event in sorted(device_ops, key=lambda e: -e.self_device_time_total)[: args.top]:
        _row(event.self_device_time_total / args.runs, event.count / args.runs, event.key)


def _row(microseconds: float, calls: float, name: str) -> None:
    print(f"  {microseconds:9.1f} {calls:6.1f}  {name[:100]}")


if __name__ == "__main__":
    main()
