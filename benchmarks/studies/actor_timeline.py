"""Where a saturated actor's GPU time goes, with Ray and the channel's sockets out of the way.

An in-process `EncoderActor` (real-size Qwen3-VL-8B tower, random bf16 weights) takes
`pool_throughput.py`'s mix from many threads at once, the way the same-node channel hands it
over: pixels in pinned memory (the channel's segments are registered with CUDA), outputs left
on the device and copied to pinned host memory on each thread's own stream.

Per setting it reports items/s (no profiler running), and, from a short window under
torch.profiler's CUDA activity:
- the share of wall time in which a kernel ran, in which only a copy ran, and in which the GPU
  was idle, and the idle gaps between kernels by length;
- the host's time per run: to start it (`GraphEncoder.start_plans`), how long collecting it
  waited for the GPU, and what came after the wait (embeddings, waking callers).

If the GPU here is busy nearly all the time while `pool_throughput.py` finds it idle, what is
missing is in the transport; if it is idle here too, it is in the actor and the encoder.

    python benchmarks/studies/actor_timeline.py [--threads 64] [--seconds 8] [--overlap-runs on,off]
"""

from __future__ import annotations

import argparse
import gc
import gzip
import itertools
import json
import logging
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
from common import save_random_tower
from pool_throughput import random_call
from torch.profiler import ProfilerActivity, profile

from vitpool import Image, Video
from vitpool.actors.encoder_actor import EncoderActor
from vitpool.encoder_spec import ActorSpec, EncoderSpec
from vitpool.graphs import PlansInFlight
from vitpool.items import prepare_items
from vitpool.packing import smallest_fitting
from vitpool.specs import BatchPlan


def planned_calls(encoder, seed: int, count: int, pinned: bool) -> list[tuple[BatchPlan, list[torch.Tensor]]]:
    """`count` calls of the mix, each planned as a pool's caller plans it."""
    rng = random.Random(seed)
    calls = []
    for _ in range(count):
        items = [
            (Video if is_video else Image)(torch.from_numpy(pixels), grid)
            for is_video, grid, pixels in random_call(rng)
        ]
        prepared = prepare_items(items, encoder.adapter.item_rules)
        needs: dict[str, int] = {}
        for item in prepared:
            for name, amount in item.spec.needs:
                needs[name] = needs.get(name, 0) + amount
        tokens = sum(item.spec.num_tokens for item in prepared)
        budget = smallest_fitting(encoder.budgets, len(prepared), tokens, tuple(sorted(needs.items())))
        pixels = [item.pixels.pin_memory() if pinned else item.pixels for item in prepared]
        calls.append((BatchPlan(budget, tuple(item.spec for item in prepared)), pixels))
    return calls


class HostTimes:
    """Per run, the host's seconds in `start_plans`, waiting in `result()`, and after the wait."""

    def __init__(self, encoder) -> None:
        self.start: list[float] = []
        self.wait: list[float] = []
        self.after: list[float] = []
        self.recording = False
        self._lock = threading.Lock()
        started = encoder.start_plans

        def timed_start(*args, **kwargs):
            begin = time.perf_counter()
            flight = started(*args, **kwargs)
            self._add(self.start, time.perf_counter() - begin)
            return flight

        encoder.start_plans = timed_start  # the actor calls it through the encoder instance
        self._encoder = encoder
        self._result = PlansInFlight.result
        times = self

        def timed_result(flight: PlansInFlight):
            begin = time.perf_counter()
            if flight.launched.done is not None:
                flight.launched.done.synchronize()
            waited = time.perf_counter()
            outcome = times._result(flight)
            times._add(times.wait, waited - begin)
            times._add(times.after, time.perf_counter() - waited)
            return outcome

        PlansInFlight.result = timed_result

    def _add(self, values: list[float], seconds: float) -> None:
        if self.recording:
            with self._lock:
                values.append(seconds)

    def restore(self) -> None:
        PlansInFlight.result = self._result
        del self._encoder.start_plans

    def summary(self) -> dict:
        def median_ms(values: list[float]) -> float | None:
            return statistics.median(values) * 1e3 if values else None

        return {
            "runs": len(self.start),
            "start_ms": median_ms(self.start),
            "wait_ms": median_ms(self.wait),
            "after_ms": median_ms(self.after),
        }


def union_length(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total length of the intervals' union, and the union itself (sorted, disjoint)."""
    merged: list[tuple[float, float]] = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return sum(end - begin for begin, end in merged), merged


def gpu_timeline(trace_path: Path) -> dict:
    """Kernel, copy-only and idle shares of the traced window, and the idle gaps by length."""
    with open(trace_path) as file:
        events = json.load(file)["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    copy_bytes: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "gpu_memcpy":
            kind = e["name"].split(" (")[0]
            copy_bytes[kind] = copy_bytes.get(kind, 0.0) + e.get("args", {}).get("bytes", 0)
    if not kernels:
        return {}
    window = (min(b for b, _ in kernels + copies), max(e for _, e in kernels + copies))
    wall = window[1] - window[0]
    kernel_time, kernel_union = union_length(kernels)
    busy_time, _ = union_length(kernels + copies)
    gaps = [b - e for (_, e), (b, _) in itertools.pairwise(kernel_union)]
    edges = (10, 50, 200, 1000, float("inf"))
    by_length = {}
    lower = 0
    for edge in edges:
        chosen = [g for g in gaps if lower <= g < edge]
        by_length[f"{lower}-{edge} us"] = {"gaps": len(chosen), "share_of_wall": sum(chosen) / wall}
        lower = edge
    return {
        "window_ms": wall / 1e3,
        "kernel_share": kernel_time / wall,
        "copy_only_share": (busy_time - kernel_time) / wall,
        "idle_share": 1 - busy_time / wall,
        "idle_gaps_between_kernels": by_length,
        "copy_mb": {kind: total / 1e6 for kind, total in copy_bytes.items()},
    }


def measure(args, directory: Path, overlap_runs: bool, pinned: bool, out: Path | None) -> dict:
    actor = EncoderActor(
        0,
        ActorSpec(
            EncoderSpec(model=str(directory), dtype="bfloat16", device="cuda", attention=args.attention),
            serve_channel=False,
            overlap_runs=overlap_runs,
        ),
    )
    encoder = actor.encoder
    calls = [planned_calls(encoder, seed, args.calls_per_thread, pinned) for seed in range(args.threads)]
    times = HostTimes(encoder)
    items = [0] * args.threads
    phase = {"stop": 0.0, "counting": False}

    def caller(index: int) -> None:
        copies = torch.cuda.Stream()
        n = 0
        while time.perf_counter() < phase["stop"]:
            plan, pixels = calls[index][n % len(calls[index])]
            n += 1
            values, _ = actor.run_batch(plan, pixels, None)
            with torch.cuda.stream(copies):  # as the channel writes outputs to the caller's segment
                hosts = [
                    torch.empty(o.shape, dtype=o.dtype, pin_memory=True).copy_(o, non_blocking=True)
                    for value in values
                    for o in value.outputs
                ]
            copies.synchronize()
            del hosts
            if phase["counting"]:
                items[index] += len(values)

    def saturate(seconds: float, during=None) -> float:
        """Items/s over `seconds` with every thread calling back to back."""
        phase["stop"] = time.perf_counter() + args.warmup_seconds + seconds
        threads = [threading.Thread(target=caller, args=(i,)) for i in range(args.threads)]
        for thread in threads:
            thread.start()
        time.sleep(args.warmup_seconds)
        items[:] = [0] * args.threads
        phase["counting"], begin = True, time.perf_counter()
        if during is not None:
            during()
        for thread in threads:
            thread.join()
        phase["counting"] = False
        return sum(items) / (time.perf_counter() - begin)

    rate = saturate(args.seconds)
    label = f"overlap_{'on' if overlap_runs else 'off'}_{'pinned' if pinned else 'pageable'}"
    trace = Path(tempfile.mkdtemp()) / f"{label}.json"

    def profiled() -> None:
        times.recording = True
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            time.sleep(args.profile_seconds)
        times.recording = False
        prof.export_chrome_trace(str(trace))

    saturate(args.profile_seconds + 1.0, profiled)
    times.restore()
    result = {"setting": label, "items_per_s": rate, "host_per_run": times.summary(), **gpu_timeline(trace)}
    if out is not None:
        with open(trace, "rb") as source, gzip.open(out / f"{label}.json.gz", "wb") as target:
            target.write(source.read())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=64, help="caller threads (the pool benchmark's 8 x 8)")
    parser.add_argument("--calls-per-thread", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument("--profile-seconds", type=float, default=1.0)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--overlap-runs", default="on,off", help="comma-separated: on, off")
    parser.add_argument(
        "--pixels", default="pinned", help="comma-separated: pinned (the channel), pageable (Ray)"
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval for this process (default: Python's 5 ms)",
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json and gzipped traces")
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    directory = save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-"))
    results = {
        "gpu": torch.cuda.get_device_name(),
        "threads": args.threads,
        "runs": [],
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
    }
    for overlap in args.overlap_runs.split(","):
        for pixels in args.pixels.split(","):
            row = measure(args, directory, overlap == "on", pixels == "pinned", args.out)
            gc.collect()  # the actor and its graphs, before the next one captures
            torch.cuda.empty_cache()
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nGPU: {results['gpu']}; {args.threads} threads; host ms per run are medians")
    print(
        "| setting | items/s | kernel | copy only | idle | gaps >= 200 us (share) | start / wait / after ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in results["runs"]:
        gaps = row.get("idle_gaps_between_kernels", {})
        long_share = sum(v["share_of_wall"] for k, v in gaps.items() if k.startswith(("200", "1000")))
        host = row["host_per_run"]
        print(
            f"| {row['setting']} | {row['items_per_s']:.1f} | {row.get('kernel_share', 0):.2f} "
            f"| {row.get('copy_only_share', 0):.2f} | {row.get('idle_share', 0):.2f} | {long_share:.2f} "
            f"| {host['start_ms']:.2f} / {host['wait_ms']:.2f} / {host['after_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
