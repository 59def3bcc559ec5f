"""Throughput and tail latency of a pool of 1, 2, 4... actors under many concurrent callers.

Callers are separate processes (Ray actors that `EncoderPool.connect` by name, as LLM
deployments would), each with several threads, sending a realistic mix: calls of one or two
images of 224² to 1024² (sides drawn independently, so aspect ratios vary) and, in 15% of
calls, an 8-frame video of 224² to 448². Pixels are float32, as processors emit them.

For each pool size: the saturated rate (every caller thread calls back to back), then an open
loop of Poisson arrivals at 70% of that rate (`--loads 0.5,0.7`: one open loop per fraction, in
turn), where latency counts from each call's scheduled arrival. Each call is also timed alone
first: the p99 / p50 of those unloaded latencies is the mix's own spread, the floor for p99 / p50
at any load. The pool grows between sizes with `pool.scale`, while no call is in flight. The open
loops' latencies are also given per call size (output tokens: small <= 256 < medium <= 1024 <
large), and as slowdowns: per size class, each call's latency over the unloaded p50 of its class
(its calls timed alone, one at a time, before the runs); over all calls, each call's latency over
the same call's unloaded latency.

`--small-first off,256-nostream,256` runs the whole measurement once per setting of the pool's
`small_first_tokens` (small calls dispatched and run ahead of large ones; "-nostream": without
the urgent lane, `urgent_tokens=None`), in that order, each on
a freshly launched pool: before and after in one run (a setting named twice is measured twice,
in turns with the others). The open loops of every setting run at their
fractions of the first setting's saturated rate (`--load-basis first`), so all face the same
offered load.

    python benchmarks/pool_throughput.py [--actors 1,2,4] [--seconds 20] [--callers 8] [--threads 8]
    python benchmarks/pool_throughput.py --actors 1 --seconds 12 --small-first off,256-nostream,256
    python benchmarks/pool_throughput.py --actors 1 --seconds 14 --small-first 256,256-stream --loads 0.5,0.7
    python benchmarks/pool_throughput.py --device cpu --actors 1 --callers 1 --threads 2 --seconds 2  # smoke
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray
import torch
from common import PATCH, ROW_WIDTH, GpuBusy, save_random_tower

from vitpool import EncoderPool
from vitpool.pool.settings import PoolSettings

IMAGE_SIDES = (224, 320, 448, 512, 640, 768, 896, 1024)
VIDEO_SIDES = (224, 320, 448)
VIDEO_SHARE = 0.15
POOL_NAME = "vitpool-throughput"
SIZE_CLASSES = ("small", "medium", "large")


def random_call(rng: random.Random) -> list[tuple[bool, tuple[int, int, int], np.ndarray]]:
    """(is video, grid, float32 pixels) of each item of one call."""
    if rng.random() < VIDEO_SHARE:
        side = rng.choice(VIDEO_SIDES) // PATCH
        shapes = [(True, (4, side, side))]  # 8 frames / temporal patch 2
    else:
        shapes = [
            (False, (1, rng.choice(IMAGE_SIDES) // PATCH, rng.choice(IMAGE_SIDES) // PATCH))
            for _ in range(rng.choice((1, 1, 2)))
        ]
    generator = np.random.default_rng(rng.randrange(1 << 30))
    return [
        (
            is_video,
            grid,
            generator.standard_normal((grid[0] * grid[1] * grid[2], ROW_WIDTH), dtype=np.float32),
        )
        for is_video, grid in shapes
    ]


@ray.remote(num_cpus=1)
class Caller:
    """One client process with its own pool handle and its own set of prepared calls."""

    def __init__(self, seed: int, num_calls: int) -> None:
        from vitpool import Image, Video

        self.pool = EncoderPool.connect(POOL_NAME)
        rng = random.Random(seed)
        self.calls = [
            [
                (Video if is_video else Image)(torch.from_numpy(pixels), grid)
                for is_video, grid, pixels in random_call(rng)
            ]
            for _ in range(num_calls)
        ]
        self.rng = rng

    def mean_items_per_call(self) -> float:
        return statistics.mean(len(c) for c in self.calls)

    def call_tokens(self) -> list[int]:
        return [sum(int(np.prod(item.grid_thw)) // 4 for item in call) for call in self.calls]

    def unloaded(self) -> list[float]:
        """Each prepared call alone, once warm: its latency with nothing else in the pool."""
        seconds = []
        for call in self.calls:
            self.pool.encode(call)
            start = time.monotonic()
            self.pool.encode(call)
            seconds.append(time.monotonic() - start)
        return seconds

    def closed_loop(self, seconds: float, threads: int) -> dict:
        """Every thread calls back to back until the deadline."""
        deadline = time.monotonic() + seconds

        def worker(offset: int) -> tuple[int, list[float]]:
            items, latencies, number = 0, [], offset
            while time.monotonic() < deadline:
                call = self.calls[number % len(self.calls)]
                number += threads
                start = time.monotonic()
                self.pool.encode(call)
                latencies.append(time.monotonic() - start)
                items += len(call)
            return items, latencies

        start, cpu_start = time.monotonic(), time.process_time()
        with concurrent.futures.ThreadPoolExecutor(threads) as executor:
            outcomes = list(executor.map(worker, range(threads)))
        elapsed = time.monotonic() - start
        return {
            "items": sum(o[0] for o in outcomes),
            "latencies": [x for o in outcomes for x in o[1]],
            "seconds": elapsed,
            # the process's CPU time over the wall time: near 1 (or above, outside the GIL), the caller limits
            "cpu_share": (time.process_time() - cpu_start) / elapsed,
        }

    def open_loop(self, seconds: float, calls_per_second: float, max_threads: int) -> dict:
        """Poisson arrivals; a call's latency counts from its scheduled arrival."""
        latencies, indices, items = [], [], [0]

        def one(number: int, scheduled: float) -> None:
            call = self.calls[number % len(self.calls)]
            self.pool.encode(call)
            latencies.append(time.monotonic() - scheduled)
            indices.append(number % len(self.calls))
            items[0] += len(call)

        start = time.monotonic()
        next_arrival = start
        number = 0
        with concurrent.futures.ThreadPoolExecutor(max_threads) as executor:
            while next_arrival < start + seconds:
                delay = next_arrival - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                executor.submit(one, number, next_arrival)
                number += 1
                next_arrival += self.rng.expovariate(calls_per_second)
        return {
            "items": items[0],
            "latencies": latencies,
            "indices": indices,
            "seconds": time.monotonic() - start,
            "calls": number,
        }


def size_class(tokens: int) -> str:
    return "small" if tokens <= 256 else "medium" if tokens <= 1024 else "large"


def percentile_ms(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return (
        1e3 * ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))] if ordered else 0.0
    )


def class_rows(tokens: list[list[int]], alone: list[list[float]], loaded: list[dict]) -> dict:
    """Per size class at load: calls, p50 / p99 ms, the class's unloaded p50 ms, the p50 / p99
    of each call's latency over that unloaded p50, and over the call's own unloaded latency."""
    unloaded: dict[str, list[float]] = {name: [] for name in SIZE_CLASSES}
    for caller_tokens, caller_alone in zip(tokens, alone):
        for call_tokens, seconds in zip(caller_tokens, caller_alone):
            unloaded[size_class(call_tokens)].append(seconds)
    latencies: dict[str, list[float]] = {name: [] for name in SIZE_CLASSES}
    own: dict[str, list[float]] = {name: [] for name in SIZE_CLASSES}
    for caller_number, outcome in enumerate(loaded):
        for latency, index in zip(outcome["latencies"], outcome["indices"]):
            latencies[size_class(tokens[caller_number][index])].append(latency)
            own[size_class(tokens[caller_number][index])].append(latency / alone[caller_number][index])
    rows = {}
    for name in SIZE_CLASSES:
        base_ms = percentile_ms(unloaded[name], 0.5)
        slowdowns = [1e3 * latency / base_ms for latency in latencies[name]] if base_ms else []
        rows[name] = {
            "calls": len(latencies[name]),
            "p50_ms": percentile_ms(latencies[name], 0.5),
            "p99_ms": percentile_ms(latencies[name], 0.99),
            "unloaded_calls": len(unloaded[name]),
            "unloaded_p50_ms": base_ms,
            "slowdown_p50": percentile_ms(slowdowns, 0.5) / 1e3,
            "slowdown_p99": percentile_ms(slowdowns, 0.99) / 1e3,
            "own_slowdown_p50": percentile_ms(own[name], 0.5) / 1e3,
            "own_slowdown_p99": percentile_ms(own[name], 0.99) / 1e3,
        }
    return rows


def open_loop_row(callers: list, items_per_s: float, items_per_call: float, args, tokens, alone) -> dict:
    """An open loop of Poisson arrivals offering `items_per_s` over every caller: items/s served,
    p50 / p99 ms, per size class, and each call's latency over its own unloaded latency."""
    calls_per_second = items_per_s / items_per_call / len(callers)
    loaded = ray.get([c.open_loop.remote(args.seconds, calls_per_second, 4 * args.threads) for c in callers])
    latencies = [x for o in loaded for x in o["latencies"]]
    slowdowns = [
        latency / alone[caller_number][index]
        for caller_number, outcome in enumerate(loaded)
        for latency, index in zip(outcome["latencies"], outcome["indices"])
    ]
    row = {
        "offered_items_per_s": items_per_s,
        "items_per_s": sum(o["items"] for o in loaded) / max(o["seconds"] for o in loaded),
        "p50_ms": percentile_ms(latencies, 0.5),
        "p99_ms": percentile_ms(latencies, 0.99),
        "calls": len(latencies),
        "by_size": class_rows(tokens, alone, loaded),
        "slowdown_p50": percentile_ms(slowdowns, 0.5) / 1e3,
        "slowdown_p99": percentile_ms(slowdowns, 0.99) / 1e3,
    }
    row["p99_over_p50"] = row["p99_ms"] / row["p50_ms"]
    return row


def setting_overrides(value: str | None) -> tuple[str, dict]:
    """(label, pool settings) for one `--small-first` value: "off", a token count, or None (the
    pool's default)."""
    if value is None:
        return "default", {}
    if "small_first_tokens" not in PoolSettings.__dataclass_fields__:
        raise SystemExit("--small-first: this vitpool's PoolSettings has no small_first_tokens setting")
    tokens, _, lane = value.partition("-")
    overrides: dict = {"small_first_tokens": None if tokens == "off" else int(tokens)}
    if lane:
        if lane not in ("nostream", "stream") or "urgent_tokens" not in PoolSettings.__dataclass_fields__:
            raise SystemExit(f"--small-first {value!r}: use off, N, N-nostream or N-stream")
        # the urgent lane (once `small_first_stream`) for the batches small-first runs first
        overrides["urgent_tokens"] = None if tokens == "off" or lane == "nostream" else int(tokens)
    return f"small_first={value}", overrides


def measure_setting(label: str, overrides: dict, args, sizes: list[int], settings: dict, basis: dict) -> dict:
    """Launch a pool with `settings` and `overrides`, then for each size: saturated, then an open
    loop at each of `args.loads` of `basis[size]` (or of its own saturated rate, where `basis` has
    none yet)."""
    device_settings = {"device": "cpu", "dtype": "float32"} if args.device == "cpu" else {"dtype": "bfloat16"}
    options = {"actor_options": {"num_gpus": 0, "num_cpus": 1}} if args.device == "cpu" else {}
    pool = EncoderPool.launch(
        model=args.model_dir,
        num_actors=sizes[0],
        name=POOL_NAME,
        **device_settings,
        **options,
        **settings,
        **overrides,
    )
    caller_cpus = 0 if args.device == "cpu" else 1  # a CPU machine's cores go to the actors
    callers = [
        Caller.options(num_cpus=caller_cpus).remote(seed, args.calls_per_caller)
        for seed in range(args.callers)
    ]
    items_per_call = statistics.mean(ray.get([c.mean_items_per_call.remote() for c in callers]))
    tokens = ray.get([c.call_tokens.remote() for c in callers])
    alone = [ray.get(c.unloaded.remote()) for c in callers]  # one caller at a time: alone in the pool
    unloaded = [x for seconds in alone for x in seconds]
    result = {
        "overrides": overrides,
        "items_per_call": items_per_call,
        "sizes": {},
        "unloaded_p50_ms": percentile_ms(unloaded, 0.5),
        "unloaded_p99_ms": percentile_ms(unloaded, 0.99),
    }
    print(
        f"[{label}] unloaded: {len(unloaded)} calls, p50 {result['unloaded_p50_ms']:.1f} ms, p99 "
        f"{result['unloaded_p99_ms']:.1f} ms (the mix's own spread)",
        flush=True,
    )
    for size in sizes:
        if size != pool.num_actors:
            pool.scale(size)
        ray.get([c.closed_loop.remote(args.warmup_seconds, args.threads) for c in callers])
        busy_before = {actor.actor_index: actor.busy_seconds for actor in pool.stats().actors}
        with GpuBusy() as gpu_busy:
            saturated = ray.get([c.closed_loop.remote(args.seconds, args.threads) for c in callers])
        window = max(o["seconds"] for o in saturated)
        # each actor's share of the window with a batch running (the GPU's share is nvidia-smi's)
        actor_busy = sorted(
            (actor.busy_seconds - busy_before.get(actor.actor_index, 0.0)) / window
            for actor in pool.stats().actors
        )
        rate = sum(o["items"] for o in saturated) / max(o["seconds"] for o in saturated)
        closed_latencies = [x for o in saturated for x in o["latencies"]]
        basis.setdefault(size, rate)
        row = {
            "saturated_items_per_s": rate,
            "saturated_p50_ms": percentile_ms(closed_latencies, 0.5),
            "saturated_p99_ms": percentile_ms(closed_latencies, 0.99),
            # nvidia-smi's utilization per GPU while saturated: below 1, the GPUs waited for the host
            "saturated_gpu_busy": gpu_busy.busy,
            "saturated_actor_busy": actor_busy,
            "caller_cpu_share": sorted(o["cpu_share"] for o in saturated),
            "basis_items_per_s": basis[size],
            "loads": {
                f"{fraction:g}": open_loop_row(
                    callers, fraction * basis[size], items_per_call, args, tokens, alone
                )
                for fraction in args.loads
            },
        }
        print(f"[{label}] {size} actors: {json.dumps(row)}", flush=True)
        stats = pool.stats()
        row["padding_waste"] = [actor.padding_waste for actor in stats.actors]
        row["runs"] = sum(actor.runs for actor in stats.actors)
        row["combined_batches"] = sum(actor.combined_batches for actor in stats.actors)
        print(stats.summary(), flush=True)
        result["sizes"][size] = row
    one = result["sizes"][sizes[0]]["saturated_items_per_s"] / sizes[0]
    for size, row in result["sizes"].items():
        row["scaling_vs_one"] = row["saturated_items_per_s"] / (size * one)
    for caller in callers:
        ray.kill(caller)
    pool.shutdown()
    return result


def print_tables(results: dict) -> None:
    print(
        f"\nGPU: {results['gpu']} x{results['gpus']}, Ray {ray.__version__}; "
        f"{results['callers']} caller processes x {results['threads_per_caller']} threads, "
        f"{results['seconds']:.0f} s per measurement"
    )
    first: dict[int, float] = {}  # saturated items/s of the first setting, per pool size
    print(
        "| setting | actors | saturated items/s | vs first | per actor vs 1 | p50 / p99 ms (saturated) "
        "| unloaded p50 / p99 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, setting in results["settings"].items():
        for size, row in setting["sizes"].items():
            first.setdefault(size, row["saturated_items_per_s"])
            print(
                f"| {label} | {size} | {row['saturated_items_per_s']:.1f} "
                f"| {row['saturated_items_per_s'] / first[size]:.3f} | {row['scaling_vs_one']:.2f} "
                f"| {row['saturated_p50_ms']:.1f} / {row['saturated_p99_ms']:.1f} "
                f"| {setting['unloaded_p50_ms']:.1f} / {setting['unloaded_p99_ms']:.1f} |"
            )
    print(
        "\nOpen loops (load: a fraction of the basis's saturated items/s), per call size (output tokens): "
        "calls, p50 / p99 ms, and slowdown p50 / p99 = latency over the class's unloaded p50 (ms), "
        "own = each call over its own unloaded latency; last column: the same over all calls"
    )
    print(
        "| setting | actors | load: items/s (offered) | p50 / p99 ms | small <= 256 | medium <= 1024 | large "
        "| all calls: slowdown p50 / p99 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, setting in results["settings"].items():
        for size, row in setting["sizes"].items():
            for load, loaded in row["loads"].items():
                cells = [
                    f"{c['calls']}, {c['p50_ms']:.1f} / {c['p99_ms']:.1f} ms, x{c['slowdown_p50']:.2f} / "
                    f"x{c['slowdown_p99']:.2f} (unloaded {c['unloaded_p50_ms']:.1f}); "
                    f"own x{c['own_slowdown_p50']:.2f} / x{c['own_slowdown_p99']:.2f}"
                    for c in loaded["by_size"].values()
                ]
                print(
                    f"| {label} | {size} "
                    f"| {load}: {loaded['items_per_s']:.1f} ({loaded['offered_items_per_s']:.1f}) "
                    f"| {loaded['p50_ms']:.1f} / {loaded['p99_ms']:.1f} | "
                    + " | ".join(cells)
                    + f" | {loaded['slowdown_p50']:.2f} / {loaded['slowdown_p99']:.2f} |"
                )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--actors", default="1,2,4")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-seconds", type=float, default=5.0)
    parser.add_argument("--callers", type=int, default=8, help="caller processes")
    parser.add_argument("--threads", type=int, default=8, help="threads per caller process")
    parser.add_argument("--calls-per-caller", type=int, default=24, help="distinct prepared calls per caller")
    parser.add_argument(
        "--spin", type=float, default=None, help="the pool's channel_spin_s (default: the pool's)"
    )
    parser.add_argument("--max-tokens-per-run", type=int, default=None, help="the pool's max_tokens_per_run")
    parser.add_argument(
        "--attention", default="auto", help="the pool's attention kernel: auto, cudnn, fa2, fa4"
    )
    parser.add_argument(
        "--fused-ops", default="on", choices=("on", "off"), help="fused rotary, patch GEMM, MLP GELU"
    )
    parser.add_argument(
        "--compiled-blocks", default="off", choices=("on", "off"), help="torch.compile'd blocks"
    )
    parser.add_argument(
        "--overlap-runs", default="on", choices=("on", "off"), help="actors overlap runs with host work"
    )
    parser.add_argument(
        "--budgets", default=None, help="comma-separated token budgets (default: the device's)"
    )
    parser.add_argument(
        "--precision",
        default="bf16",
        help="comma-separated precisions (bf16, fp8), each measured on its own pool in turn",
    )
    parser.add_argument(
        "--small-first",
        default=None,
        help="comma-separated small_first_tokens settings, each measured on its own pool in turn ('off' or "
        "a token count; N-nostream without the urgent lane, N-stream with it (small batches interrupt large "
        "runs), N the pool's default; e.g. off,256-nostream,256-stream); default: the pool's default only",
    )
    parser.add_argument(
        "--loads",
        default="0.7",
        type=lambda text: [float(x) for x in text.split(",") if x],
        help="comma-separated open-loop loads, fractions of the basis's saturated items/s, each measured in "
        "turn ('': none, saturated only)",
    )
    parser.add_argument(
        "--load-basis",
        default="first",
        choices=("first", "own"),
        help="the open loops' loads are fractions of the first setting's saturated rate (same offered load) "
        "or of each one's own",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: a smoke run with the shipped tiny model on a CPU actor",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sizes = [int(n) for n in args.actors.split(",")]
    if args.device == "cuda":
        gpu, num_gpus = torch.cuda.get_device_name(), torch.cuda.device_count()
        args.model_dir = str(save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-")))
    else:
        gpu, num_gpus, args.model_dir = "none (CPU, tiny model)", 0, None

    settings = {} if args.spin is None else {"channel_spin_s": args.spin}
    settings["max_tokens_per_run"] = args.max_tokens_per_run
    settings["attention"] = args.attention
    settings["fused_ops"] = args.fused_ops == "on"
    settings["compiled_blocks"] = args.compiled_blocks == "on"
    settings["overlap_runs"] = args.overlap_runs == "on"
    if args.budgets:
        settings["budgets"] = tuple(int(b) for b in args.budgets.split(","))
    results = {
        "gpu": gpu,
        "gpus": num_gpus,
        "ray": ray.__version__,
        "callers": args.callers,
        "threads_per_caller": args.threads,
        "seconds": args.seconds,
        "channel_spin_s": args.spin,
        "max_tokens_per_run": args.max_tokens_per_run,
        "attention": args.attention,
        "fused_ops": args.fused_ops,
        "compiled_blocks": args.compiled_blocks,
        "budgets": args.budgets,
        "overlap_runs": args.overlap_runs,
        "load_basis": args.load_basis,
        "loads": args.loads,
        "settings": {},
    }
    basis: dict[int, float] = {}
    values = args.small_first.split(",") if args.small_first else [None]
    for value, precision in [(v, p) for v in values for p in args.precision.split(",")]:
        label, overrides = setting_overrides(value)
        if precision != "bf16":
            label, overrides = f"{label} {precision}", {**overrides, "precision": precision}
        if label in results["settings"]:  # a setting repeated, to measure it in turns with another
            label += f" #{sum(name.split(' #')[0] == label for name in results['settings']) + 1}"
        results["settings"][label] = measure_setting(label, overrides, args, sizes, settings, basis)
        if args.load_basis == "own":
            basis.clear()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print_tables(results)


if __name__ == "__main__":
    main()
