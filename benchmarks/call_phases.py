"""Where one pool call's time goes, phase by phase, timed in both processes.

On Linux `time.perf_counter` reads CLOCK_MONOTONIC, one clock for every process of the machine,
so the caller's and the actor's timestamps can be subtracted. Probes are wrapped around the
same-node channel's message functions (and a few of the actor's and caller's steps) in the caller
(this process) and in the pool's actor (run there with `__ray_call__`); the library is not
changed. Phases of one `pool.encode`:

- caller checks and packing: the items checked against the model's rules and the pool's bounds,
  queued, packed into a batch, dispatched, until the channel's send begins;
- caller pixel copy: the pixels copied into the segment, the request built and sent;
- request wake: from the request's send until the actor's thread has read it;
- actor receive: the plan parsed, the pixels' views of the segment;
- actor checks: `EncoderActor.run_batch` up to its combiner (pixels as tensors, the plan checked);
- actor combine: the combiner, up to the encoder's `start_plans`;
- actor plan prep: `start_plans` up to its batch runner's `launch` (plan checks, merging, items);
- launch: the runner's fill, replay (on a CPU: the forward) and output copies, queued;
- collect: waiting for the device, the items' Embeddings, the receipt (the end of `run_batch`);
- actor after the encode: outputs written to the segment (by DMA from a GPU), synchronise, reply;
- reply wake: from the reply's send until the caller's thread has read it;
- caller after the reply: outputs viewed (or copied out), Embeddings, the call's bookkeeping.

"added" is the pool's median minus the in-process median. Against earlier results: the older
"caller before send" is the first two phases, "actor before encode" is actor receive, and
"encode" the five from actor checks to collect ("actor run" in the table).

Against in-process `GraphEncoder.encode` (results on the GPU, synchronised) in the same run,
in blocks of `--block` calls; the pool's actor holds half of the same GPU.

    python benchmarks/call_phases.py [--runs 200] [--warmup 30] [--block 20] [--out phases.json]

Without a GPU, `--device cpu` runs both the in-process encoder and the pool's one actor on the CPU
(one torch thread each), by default with the tiny model shipped with vitpool (`--model tiny`): the
encode phase then means little, but the phases around it are the same host work as on a GPU
machine (no DMA: the actor copies outputs into the segment with NumPy). Indicative only.

    python benchmarks/call_phases.py --device cpu [--model tiny|qwen3-vl-8b] [--runs 200]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch
from common import image, save_random_tower, summarize

from vitpool import EncoderPool, GraphEncoder
from vitpool.transport import channel_client, shared_memory

WORKLOADS = {"1x224": lambda: [image(224)], "4x224": lambda: [image(224) for _ in range(4)]}
PHASES = (
    "caller_checks_and_packing",
    "caller_pixel_copy",
    "request_wake",
    "actor_receive",
    "actor_checks",
    "actor_combine",
    "actor_plan_prep",
    "launch",
    "collect",
    "actor_after_encode",
    "reply_wake",
    "caller_after_reply",
)
ACTOR_RUN = ("actor_checks", "actor_combine", "actor_plan_prep", "launch", "collect")  # = the older "encode"


def install_actor_probes(actor) -> bool:
    """Run inside the encoder actor: every channel reply carries the actor's timestamps. One call
    at a time (this benchmark's), so one set of stamps serves every thread."""
    from vitpool.transport import channel_server as channel

    stamps: dict[str, float] = {}
    receive, send = channel.receive_message, channel.send_message
    server = actor._channel

    def stamped(name: str, function):
        def timed(*args, **kwargs):
            stamps[name] = time.perf_counter()
            return function(*args, **kwargs)

        return timed

    class StampedCombiner:  # the actor's combiner, stamped when a batch enters it
        def __init__(self, combiner) -> None:
            self._combiner, self._call = combiner, stamped("combine_start", combiner)

        def __call__(self, *args, **kwargs):
            return self._call(*args, **kwargs)

        def __getattr__(self, name: str):
            return getattr(self._combiner, name)  # its counters, for the actor's stats

    def timed_receive(connection):
        message = receive(connection)
        stamps["received"] = time.perf_counter()
        return message

    run_batch = server._run_batch

    def timed_run_batch(*args, **kwargs):
        stamps["run_start"] = time.perf_counter()
        try:
            return run_batch(*args, **kwargs)
        finally:
            stamps["run_end"] = time.perf_counter()

    for runner in actor.encoder._runners.values():

        def timed_launch(*args, _launch=runner.launch, **kwargs):
            stamps["launch_start"] = time.perf_counter()
            try:
                return _launch(*args, **kwargs)
            finally:
                stamps["launch_end"] = time.perf_counter()

        runner.launch = timed_launch

    def timed_send(connection, message):
        names = (
            "received",
            "run_start",
            "combine_start",
            "plans_start",
            "launch_start",
            "launch_end",
            "run_end",
        )
        probe = [stamps.get(name, float("nan")) for name in names] + [time.perf_counter()]
        send(connection, dict(message, probe=probe))

    channel.receive_message, channel.send_message = timed_receive, timed_send
    server._run_batch = timed_run_batch
    actor._combiner = StampedCombiner(actor._combiner)
    actor.encoder.start_plans = stamped("plans_start", actor.encoder.start_plans)
    return True


class CallerProbes:
    """Wraps this process's channel functions: when the last request's send began and when it was
    sent, and the last reply (with the actor's probe) and when it was read, for the calling thread."""

    def __init__(self) -> None:
        self.last = threading.local()
        receive, send = channel_client.receive_message, channel_client.send_message
        check_pixels = channel_client._check_pixels  # the first step of a send, before the pixel copy

        def timed_check_pixels(plan, pixels):
            self.last.send_start = time.perf_counter()
            check_pixels(plan, pixels)

        def timed_send(connection, message):
            self.last.sent = time.perf_counter()  # before: the actor may read it before sendall returns
            send(connection, message)

        def timed_receive(connection):
            message = receive(connection)
            self.last.received, self.last.probe = time.perf_counter(), (message or {}).get("probe")
            return message

        channel_client.receive_message, channel_client.send_message = timed_receive, timed_send
        channel_client._check_pixels = timed_check_pixels

    def phases(self, start: float, end: float) -> dict[str, float]:
        *actor_marks, replied_at = self.last.probe
        marks = [
            start,
            self.last.send_start,
            self.last.sent,
            *actor_marks,
            replied_at,
            self.last.received,
            end,
        ]
        return {name: (b - a) * 1e3 for name, a, b in zip(PHASES, marks, marks[1:])}


def count_segments() -> tuple[collections.Counter, collections.Counter]:
    """Counts, in this process, of segments created (by size) and of batches whose outputs found
    no free output segment (copied out instead)."""
    created, copied = collections.Counter(), collections.Counter()
    init, take = shared_memory.OwnedSegment.__init__, shared_memory.OutputSegments.take

    def counted_init(self, size):
        created[size] += 1
        init(self, size)

    def counted_take(self, nbytes):
        chosen = take(self, nbytes)
        copied["copied" if chosen is None else "viewed"] += 1
        return chosen

    shared_memory.OwnedSegment.__init__, shared_memory.OutputSegments.take = counted_init, counted_take
    return created, copied


def once_ms(function, device: str) -> float:
    """One call of `function` in ms, the GPU synchronised after it (on a GPU)."""
    start = time.perf_counter()
    function()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def measure(encoder, pool, probes: CallerProbes, items: list, args) -> tuple[list, list, dict]:
    """In-process and pool calls of `items` in alternating blocks: their times (ms) and the pool
    calls' phases."""
    baseline, totals, phases = [], [], {phase: [] for phase in PHASES}

    def pool_call(record: bool) -> None:
        start = time.perf_counter()
        pool.encode(items)
        end = time.perf_counter()
        if record:
            totals.append((end - start) * 1e3)
            for phase, value in probes.phases(start, end).items():
                phases[phase].append(value)

    for _ in range(args.warmup):
        once_ms(lambda: encoder.encode(items), args.device)
        pool_call(record=False)
    for _ in range(args.runs // args.block):
        for _ in range(args.block):
            baseline.append(once_ms(lambda: encoder.encode(items), args.device))
        for _ in range(args.block):
            pool_call(record=True)
    return baseline, totals, phases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument(
        "--spin", type=float, default=None, help="the pool's channel_spin_s (default: the pool's)"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--model",
        choices=("qwen3-vl-8b", "tiny"),
        default=None,
        help="the real-size Qwen3-VL-8B tower with random weights (default on a GPU) or vitpool's "
        "shipped tiny model (default on the CPU)",
    )
    args = parser.parse_args()
    model = args.model or ("qwen3-vl-8b" if args.device == "cuda" else "tiny")
    if args.device == "cuda":
        gpu = torch.cuda.get_device_name()
        dtype, options, settings = "bfloat16", {"num_gpus": 0.5}, {}
    else:
        torch.set_num_threads(1)  # as the pool's CPU actor, which gets one CPU
        gpu = f"none (CPU, {torch.get_num_threads()} torch thread)"
        dtype, options, settings = "float32", {"num_gpus": 0, "num_cpus": 1}, {"device": "cpu"}

    directory = None if model == "tiny" else str(save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-")))
    encoder = GraphEncoder.from_pretrained(directory, device=args.device, dtype=getattr(torch, dtype))
    spin = {} if args.spin is None else {"channel_spin_s": args.spin}
    pool = EncoderPool.launch(
        model=directory, num_actors=1, dtype=dtype, actor_options=options, **settings, **spin
    )
    actor = ray.get_actor("vitpool-encoder-0", namespace="vitpool")
    ray.get(actor.__ray_call__.remote(install_actor_probes))
    probes = CallerProbes()
    segment_counts, output_counts = count_segments()

    results = {
        "gpu": gpu,
        "model": model,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "runs": args.runs,
        "block": args.block,
        "spin_s": args.spin,
        "actor_device": pool.stats().actors[0].device,
        "workloads": {},
    }
    for name, build in WORKLOADS.items():
        baseline, totals, phases = measure(encoder, pool, probes, build(), args)
        row = {"in_process": summarize(baseline), "pool": summarize(totals)}
        row["phases_median_ms"] = {phase: statistics.median(values) for phase, values in phases.items()}
        row["phases_p90_ms"] = {
            phase: statistics.quantiles(values, n=10)[-1] for phase, values in phases.items()
        }
        row["segments_created"], row["outputs_copied"] = dict(segment_counts), dict(output_counts)
        segment_counts.clear()
        output_counts.clear()
        row["ratio"] = row["pool"]["median_ms"] / row["in_process"]["median_ms"]
        row["added_ms"] = row["pool"]["median_ms"] - row["in_process"]["median_ms"]
        row["actor_run_median_ms"] = statistics.median(
            sum(values) for values in zip(*(phases[phase] for phase in ACTOR_RUN))
        )
        results["workloads"][name] = row
    results["pool_stats"] = pool.stats().summary()
    pool.shutdown()

    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    spin_s = "default" if args.spin is None else args.spin
    print(
        f"\nGPU: {gpu}; model {model}; actor on {results['actor_device']}; channel_spin_s={spin_s}; "
        f"median of {args.runs} runs in blocks of {args.block}"
    )
    print("| workload | in-process | pool | added | ratio | " + " | ".join(PHASES) + " | actor run |")
    print("|---" * (6 + len(PHASES)) + "|")
    for name, row in results["workloads"].items():
        cells = [f"{row['phases_median_ms'][phase]:.3f}" for phase in PHASES]
        print(
            f"| {name} | {row['in_process']['median_ms']:.2f} ({row['in_process']['p99_ms']:.2f}) "
            f"| {row['pool']['median_ms']:.2f} ({row['pool']['p99_ms']:.2f}) | {row['added_ms']:+.2f} "
            f"| {row['ratio']:.2f} | " + " | ".join(cells) + f" | {row['actor_run_median_ms']:.3f} |"
        )
    for name, row in results["workloads"].items():
        p90 = ", ".join(f"{phase} {value:.3f}" for phase, value in row["phases_p90_ms"].items())
        print(
            f"{name} p90: {p90}; segments created {row['segments_created']}, outputs {row['outputs_copied']}"
        )


if __name__ == "__main__":
    main()
