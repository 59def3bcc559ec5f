"""Where one pool call's time goes, phase by phase, timed in both processes.

On Linux `time.perf_counter` reads CLOCK_MONOTONIC, one clock for every process of the machine,
so the caller's and the actor's timestamps can be subtracted. Probes are wrapped around the
same-node channel's message functions in the caller (this process) and in the pool's actor (run
there with `__ray_call__`); the library is not changed. Phases of one `pool.encode`:

- caller, before the send: checks, packing, dispatch, pixels copied into the segment;
- request wake: from the request's send until the actor's thread has read it;
- actor, before the encode: parsing, item views, the actor's bookkeeping;
- encode: the actor's run (combiner, encode_each, its finiteness check waits for the GPU);
- actor, after the encode: outputs written to the segment by DMA, synchronise, receipt;
- reply wake: from the reply's send until the caller's thread has read it;
- caller, after the reply: outputs copied out, Embeddings, the call's bookkeeping.

Against in-process `GraphEncoder.encode` (results on the GPU, synchronised) in the same run,
in blocks of `--block` calls; the pool's actor holds half of the same GPU.

    python benchmarks/call_phases.py [--runs 200] [--warmup 30] [--block 20] [--out phases.json]
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
from common import image, once_ms, save_random_tower, summarize

from vitpool import EncoderPool, GraphEncoder
from vitpool.transport import channel_client, segments

WORKLOADS = {"1x224": lambda: [image(224)], "4x224": lambda: [image(224) for _ in range(4)]}
PHASES = (
    "caller_before_send", "request_wake", "actor_before_encode", "encode", "actor_after_encode",
    "reply_wake", "caller_after_reply",
)


def install_actor_probes(actor) -> bool:
    """Run inside the encoder actor: every channel reply carries the actor's timestamps."""
    from vitpool.transport import channel_server as channel

    stamps = threading.local()
    receive, send = channel.receive_message, channel.send_message
    server = actor._channel
    run_batch = server._run_batch

    def timed_receive(connection):
        message = receive(connection)
        stamps.received = time.perf_counter()
        return message

    def timed_run_batch(*args, **kwargs):
        stamps.run_start = time.perf_counter()
        try:
            return run_batch(*args, **kwargs)
        finally:
            stamps.run_end = time.perf_counter()

    def timed_send(connection, message):
        probe = [stamps.received, stamps.run_start, stamps.run_end, time.perf_counter()]
        send(connection, dict(message, probe=probe))

    channel.receive_message, channel.send_message = timed_receive, timed_send
    server._run_batch = timed_run_batch
    return True


class CallerProbes:
    """Wraps this process's channel functions: the last request's send time and the last reply
    (with the actor's probe) and when it was read, for the calling thread."""

    def __init__(self) -> None:
        self.last = threading.local()
        receive, send = channel_client.receive_message, channel_client.send_message

        def timed_send(connection, message):
            self.last.sent = time.perf_counter()  # before: the actor may read it before sendall returns
            send(connection, message)

        def timed_receive(connection):
            message = receive(connection)
            self.last.received, self.last.probe = time.perf_counter(), (message or {}).get("probe")
            return message

        channel_client.receive_message, channel_client.send_message = timed_receive, timed_send

    def phases(self, start: float, end: float) -> dict[str, float]:
        received_at, run_start, run_end, replied_at = self.last.probe
        marks = [start, self.last.sent, received_at, run_start, run_end, replied_at, self.last.received, end]
        return {name: (b - a) * 1e3 for name, a, b in zip(PHASES, marks, marks[1:])}


def count_segments() -> tuple[collections.Counter, collections.Counter]:
    """Counts, in this process, of segments created (by size) and of batches whose outputs found
    no free output segment (copied out instead)."""
    created, copied = collections.Counter(), collections.Counter()
    init, take = segments.OwnedSegment.__init__, segments.OutputSegments.take

    def counted_init(self, size):
        created[size] += 1
        init(self, size)

    def counted_take(self, nbytes):
        chosen = take(self, nbytes)
        copied["copied" if chosen is None else "viewed"] += 1
        return chosen

    segments.OwnedSegment.__init__, segments.OutputSegments.take = counted_init, counted_take
    return created, copied


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
        once_ms(lambda: encoder.encode(items))
        pool_call(record=False)
    for _ in range(args.runs // args.block):
        for _ in range(args.block):
            baseline.append(once_ms(lambda: encoder.encode(items)))
        for _ in range(args.block):
            pool_call(record=True)
    return baseline, totals, phases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--spin", type=float, default=None, help="the pool's channel_spin_s (default: the pool's)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()

    directory = str(save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-")))
    encoder = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    options = {"num_gpus": 0.5}
    spin = {} if args.spin is None else {"channel_spin_s": args.spin}
    pool = EncoderPool.launch(model=directory, num_actors=1, dtype="bfloat16", actor_options=options, **spin)
    actor = ray.get_actor("vitpool-encoder-0", namespace="vitpool")
    ray.get(actor.__ray_call__.remote(install_actor_probes))
    probes = CallerProbes()
    segment_counts, output_counts = count_segments()

    results = {
        "gpu": gpu, "torch": torch.__version__, "ray": ray.__version__, "runs": args.runs, "block": args.block,
        "spin_s": args.spin, "actor_device": pool.stats().actors[0].device,
        "workloads": {},
    }
    for name, build in WORKLOADS.items():
        baseline, totals, phases = measure(encoder, pool, probes, build(), args)
        row = {"in_process": summarize(baseline), "pool": summarize(totals)}
        row["phases_median_ms"] = {phase: statistics.median(values) for phase, values in phases.items()}
        row["phases_p90_ms"] = {phase: statistics.quantiles(values, n=10)[-1] for phase, values in phases.items()}
        row["segments_created"], row["outputs_copied"] = dict(segment_counts), dict(output_counts)
        segment_counts.clear()
        output_counts.clear()
        row["ratio"] = row["pool"]["median_ms"] / row["in_process"]["median_ms"]
        results["workloads"][name] = row
    results["pool_stats"] = pool.stats().summary()
    pool.shutdown()

    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    spin_s = "default" if args.spin is None else args.spin
    print(f"\nGPU: {gpu}; actor on {results['actor_device']}; channel_spin_s={spin_s}; "
          f"median of {args.runs} runs in blocks of {args.block}")
    print("| workload | in-process | pool | ratio | " + " | ".join(PHASES) + " |")
    print("|---" * (4 + len(PHASES)) + "|")
    for name, row in results["workloads"].items():
        cells = [f"{row['phases_median_ms'][phase]:.3f}" for phase in PHASES]
        print(
            f"| {name} | {row['in_process']['median_ms']:.2f} ({row['in_process']['p99_ms']:.2f}) "
            f"| {row['pool']['median_ms']:.2f} ({row['pool']['p99_ms']:.2f}) | {row['ratio']:.2f} | "
            + " | ".join(cells) + " |"
        )
    for name, row in results["workloads"].items():
        p90 = ", ".join(f"{phase} {value:.3f}" for phase, value in row["phases_p90_ms"].items())
        print(f"{name} p90: {p90}; segments created {row['segments_created']}, outputs {row['outputs_copied']}")


if __name__ == "__main__":
    main()
