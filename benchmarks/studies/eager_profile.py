"""Where one large image's encode spends its time: the real-size Qwen3-VL-8B tower (random bf16
weights), one square image above the largest budget (eager at its own rows), defaults.

Times the call with the pixels on the host (float32, as processors emit them) and with the same
pixels already on the GPU (the difference is moving them), the host pixels copied into pinned
memory by one thread (`PinnedStaging.COPY_THREADS = 1`, the code before) and by the default
threads, in turns; and, under the profiler, the GPU time
of one call by kernel class (`kernel_breakdown.kernel_class`) and the host-to-device copies.

    python benchmarks/studies/eager_profile.py [--sides 1568] [--runs 20] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py lives one folder up
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import QWEN3_VL_8B_VISION, image, summarize, time_ms
from kernel_breakdown import kernel_class
from torch.profiler import ProfilerActivity, profile

from vitpool import GraphEncoder, Image
from vitpool.graphs.buffers import PinnedStaging


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sides", default="1568")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(QWEN3_VL_8B_VISION))
        encoder = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    results = []
    for side in (int(s) for s in args.sides.split(",")):
        host = [image(side)]
        device = [Image(host[0].pixel_values.cuda(), host[0].grid_thw)]
        samples: dict[str, list[float]] = defaultdict(list)
        threads = PinnedStaging.COPY_THREADS
        for _ in range(2):  # in turns, so drift favours neither
            for name, count in (("host_pixels_one_thread", 1), ("host_pixels", threads)):
                PinnedStaging.COPY_THREADS = count
                samples[name] += time_ms(lambda host=host: encoder.encode(host), args.runs // 2, 3)
        PinnedStaging.COPY_THREADS = threads
        samples["device_pixels"] = time_ms(lambda device=device: encoder.encode(device), args.runs, 3)
        row = {"side": side, **{name: summarize(values) for name, values in samples.items()}}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            encoder.encode(host)
            torch.cuda.synchronize()
        classes: dict[str, float] = defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                name = "host-to-device copy" if "HtoD" in event.name else kernel_class(event.name)
                classes[name] += event.device_time / 1000
        row["gpu_ms_by_class"] = dict(sorted(classes.items(), key=lambda kv: -kv[1]))
        row["gpu_ms"] = sum(classes.values())
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": results}, indent=2))
    print(f"\nGPU: {torch.cuda.get_device_name()}; median (p99) ms of {args.runs} calls")
    for row in results:
        host, on_device, one = row["host_pixels"], row["device_pixels"], row["host_pixels_one_thread"]
        print(
            f"{row['side']}²: host pixels {host['median_ms']:.2f} ({host['p99_ms']:.2f}), "
            f"copied by one thread {one['median_ms']:.2f} ({one['p99_ms']:.2f}), pixels on the GPU "
            f"{on_device['median_ms']:.2f} ({on_device['p99_ms']:.2f}); GPU time {row['gpu_ms']:.2f}: "
            + ", ".join(f"{name} {ms:.2f}" for name, ms in row["gpu_ms_by_class"].items())
        )


if __name__ == "__main__":
    main()
