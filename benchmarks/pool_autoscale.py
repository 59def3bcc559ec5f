"""A detached, autoscaled pool under a load that rises and falls: items/s per phase, whether any
call failed or came back wrong, and when each actor joined and left.

The pool is started the way a user would, so that it is truly detached from this process: a Ray
head of its own (`ray start --head --block`, `--num-gpus` as the machine has, on a free port),
then `python -m vitpool serve --num-actors 1 --autoscale 1,N` as a subprocess, which returns once
its actor is ready. `2 * GPUs` caller processes (spawned; Ray drivers, not Ray actors) each
`EncoderPool.connect` by name and call `pool.encode` with one 224² image a call, rotating over a
few images of their own. Each result is compared with its reference, the pool's own result for
that image computed once before the schedule starts (while the pool has its one actor): "wrong"
counts results not equal bit for bit (`torch.equal`), "beyond tol." those whose relative error
(norm of the difference over the reference's) passes 1e-4 in float32, 2e-2 in bfloat16. The
callers follow one shared schedule of phases:

- low: Poisson arrivals at `--low-rate` calls/s in all (split over the callers); each call's
  latency counts from its scheduled arrival. Low enough that the actors stay under 25% busy.
- high: every caller's `--threads` threads call back to back (latency from each call's send),
  enough to keep one actor over 75% busy, so the autoscaler adds actors up to N.
- idle: no calls.

The default schedule is low, high, low, with lengths from the autoscaler's policy
(`vitpool.pool.autoscaler`: one reading every `autoscale_interval_s`, 5 s, an actor added after 3
busy readings in a row and retired after 12 idle ones, the count starting again after each
change and while an actor starts): long enough for 1 -> N in the high phase and N -> 1 in the
last. The main process reads the pool's membership every `--poll-s` (and each active actor's busy
share since the last reading) to time when each actor started, joined (took work), began
retiring and was gone. A call counts in the phase in which it returned. At the end: `vitpool
stop`, then the head is stopped (what `ray stop` does, for this cluster only).

    python benchmarks/pool_autoscale.py [--max-actors N] [--phases low:30,high:110,low:125] [--out FILE.json]
    python benchmarks/pool_autoscale.py --device cpu --out /tmp/autoscale_cpu.json   # 2 fake GPUs, tiny model

`--device cpu` runs the tiny model shipped with vitpool on CPU actors, each holding one of
`--fake-gpus` fake GPUs (so the cluster's GPUs bound the pool, as on a GPU machine).
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import json
import math
import multiprocessing as mp
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from common import image, save_random_tower

from vitpool import EncoderPool
from vitpool.pool.autoscaler import DOWN_BUSY, DOWN_READINGS, UP_BUSY, UP_READINGS
from vitpool.pool.settings import PoolSettings

POOL_NAME = "vitpool-autoscale"
KINDS = ("low", "high", "idle")
# a call's outcome: its result equal bit for bit to the reference; not equal but within TOLERANCE
# (relative error, by dtype); beyond it; or the call raised
OK, INEXACT, WRONG, FAILED = 0, 1, 2, 3
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# Rough time for an added actor to start, load and capture (RESULTS.md "Startup": about 25 s for
# the 8B tower on an H100; the tiny model on a CPU takes a few seconds): only for default phases.
ACTOR_START_S = {"cuda": 30.0, "cpu": 5.0}
SETTLE_S = {"cuda": 60.0, "cpu": 15.0}  # default time at N actors, then at one, after the autoscaler's steps
LOW_S = {"cuda": 30.0, "cpu": 10.0}  # the first phase
# calls/s of a low phase by default: one 224² image costs an actor about 3 ms on an H100
# (RESULTS.md) and 5-10 ms on a CPU, so that these keep one actor well under 25% busy
LOW_RATE = {"cuda": 20.0, "cpu": 10.0}


@dataclass(frozen=True)
class Phase:
    kind: str  # one of KINDS
    seconds: float


@dataclass(frozen=True)
class CallerPlan:
    """What one caller process does; the start time comes once every caller is ready."""

    number: int
    pool_name: str
    phases: tuple[Phase, ...]
    images: int
    threads: int
    low_rate: float  # this caller's calls/s in a low phase
    call_timeout_s: float | None


@dataclass
class Sample:
    """One reading of the pool by the main process."""

    t: float  # time.monotonic()
    active: list[int]  # actors taking work
    held: list[int]  # every actor the controller holds: starting and retiring ones too
    busy: dict[int, float] = field(default_factory=dict)  # active actor -> busy share since the last reading


# the schedule


def parse_phases(text: str) -> list[Phase]:
    """`low:30,high:150,low:120` as phases."""
    phases = []
    for part in text.split(","):
        kind, _, seconds = part.partition(":")
        if kind not in KINDS or not seconds:
            raise SystemExit(f"--phases {text!r}: use KIND:SECONDS,... with KIND one of {KINDS}")
        phases.append(Phase(kind, float(seconds)))
    return phases


def default_phases(max_actors: int, interval_s: float, device: str) -> list[Phase]:
    """Low; high, long enough for 1 -> max_actors (per step: one reading more than the policy
    needs, and an actor's start) and then some time at max_actors; low, long enough for
    max_actors -> 1 (per step: one idle reading more than the policy needs) and then some time
    at one actor."""
    steps = max_actors - 1
    settle = SETTLE_S[device]
    up = steps * ((UP_READINGS + 1) * interval_s + ACTOR_START_S[device]) + settle
    down = steps * (DOWN_READINGS + 1) * interval_s + settle
    return [
        Phase("low", LOW_S[device]),
        Phase("high", math.ceil(up / 5) * 5),
        Phase("low", math.ceil(down / 5) * 5),
    ]


def phase_labels(phases: list[Phase] | tuple[Phase, ...]) -> list[str]:
    return [f"{number}-{phase.kind}" for number, phase in enumerate(phases, 1)]


def phase_bounds(phases: list[Phase] | tuple[Phase, ...]) -> list[tuple[float, float]]:
    """Each phase's (start, end) in seconds from the schedule's start."""
    bounds, start = [], 0.0
    for phase in phases:
        bounds.append((start, start + phase.seconds))
        start += phase.seconds
    return bounds


# one caller process


def caller_main(plan: CallerPlan, start_at: Any, go: Any, ready: Any, results: Any) -> None:
    """Connect, compute the references, wait for the start, run the schedule, send the records:
    (seconds from the start when the call returned, latency s, outcome)."""
    torch.set_num_threads(1)
    pool = EncoderPool.connect(plan.pool_name)
    torch.manual_seed(1000 + plan.number)
    items = [image(224) for _ in range(plan.images)]
    references = [[t.clone() for t in pool.encode([item])[0].outputs] for item in items]
    ready.put(plan.number)
    go.wait()
    start = start_at.value
    records: list[tuple[float, float, int]] = []  # appended from many threads (one tuple: atomic)
    errors: list[str] = []
    largest_error = [0.0]  # relative, over the results that were not bit-equal
    rng = random.Random(plan.number)

    def call(which: int, began: float) -> None:
        item, reference = items[which % len(items)], references[which % len(items)]
        try:
            (result,) = pool.encode([item], timeout_s=plan.call_timeout_s)
        except Exception as error:  # noqa: BLE001 - counted and reported
            records.append((time.monotonic() - start, time.monotonic() - began, FAILED))
            errors.append(f"{type(error).__name__}: {error}")
            return
        done = time.monotonic()
        records.append((done - start, done - began, _outcome(result.outputs, reference, largest_error)))

    with concurrent.futures.ThreadPoolExecutor(plan.threads) as executor:
        for phase, (phase_start, phase_end) in zip(plan.phases, phase_bounds(plan.phases)):
            begin, end = start + phase_start, start + phase_end
            time.sleep(max(0.0, begin - time.monotonic()))
            if phase.kind == "high":  # closed loop: every thread back to back until the end

                def loop(offset: int, end: float = end) -> None:
                    number = offset
                    while time.monotonic() < end:
                        call(number, time.monotonic())
                        number += plan.threads

                for future in [executor.submit(loop, n) for n in range(plan.threads)]:
                    future.result()
            elif phase.kind == "low":  # open loop: Poisson arrivals
                arrival, number = begin + rng.expovariate(plan.low_rate), plan.number
                while arrival < end:
                    time.sleep(max(0.0, arrival - time.monotonic()))
                    executor.submit(call, number, arrival)
                    number += 1
                    arrival += rng.expovariate(plan.low_rate)
            time.sleep(max(0.0, end - time.monotonic()))  # idle, or the rest of a low phase
    results.put(
        {
            "number": plan.number,
            "records": records,
            "errors": errors[:5],
            "error_count": len(errors),
            "largest_error": largest_error[0],
        }
    )
    pool.close()


def _outcome(got: list[torch.Tensor], want: list[torch.Tensor], largest_error: list[float]) -> int:
    """OK, INEXACT or WRONG; keeps the largest relative error (norm of the difference over the
    reference's, per output) of a result that is not bit-equal in `largest_error[0]`."""
    if len(got) != len(want) or any(g.shape != w.shape or g.dtype != w.dtype for g, w in zip(got, want)):
        largest_error[0] = math.inf
        return WRONG
    if all(torch.equal(g, w) for g, w in zip(got, want)):
        return OK
    error = max(
        float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)) for g, w in zip(got, want)
    )
    largest_error[0] = max(largest_error[0], error)
    return INEXACT if error <= TOLERANCE.get(want[0].dtype, 1e-2) else WRONG


# the cluster and the pool, as a user would start them


def run_command(command: list[str], check: bool = True) -> None:
    print("$ " + " ".join(command), flush=True)
    finished = subprocess.run(command, check=False)
    if check and finished.returncode != 0:
        raise SystemExit(f"`{' '.join(command)}` failed with exit status {finished.returncode}")


class RayHead:
    """`ray start --head --block` as a child of this process: a cluster of its own (on a free port,
    joined through RAY_ADDRESS, so another cluster on the machine is neither joined nor stopped),
    which outlives the `vitpool serve` command. `stop` ends that command, and Ray stops the node's
    processes with it: what `ray stop` does, for this cluster only (`ray stop` stops every Ray
    process of the machine, other users' clusters too)."""

    def __init__(self, num_gpus: int, num_cpus: int | None, log_path: Path) -> None:
        command = [
            "ray",
            "start",
            "--head",
            "--block",
            f"--port={_free_port()}",
            f"--num-gpus={num_gpus}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ] + ([f"--num-cpus={num_cpus}"] if num_cpus is not None else [])
        print("$ " + " ".join(command) + f"  (output: {log_path})", flush=True)
        self._log_path = log_path
        with open(log_path, "w") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.address = self._wait_for_address(timeout_s=120.0)

    def _wait_for_address(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(r"ray start --address='([^']+)'", self._log_path.read_text(errors="replace"))
            if found:
                return found.group(1)
            if self._process.poll() is not None:
                break
            time.sleep(0.5)
        self.stop()
        tail = self._log_path.read_text(errors="replace").splitlines()[-15:]
        raise SystemExit("`ray start --head` did not start a cluster:\n" + "\n".join(tail))

    def stop(self) -> None:
        print("stopping the Ray head (its `ray start --block`)", flush=True)
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)  # Ray drains the node, then stops its processes
            try:
                self._process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def serve_command(args: argparse.Namespace, model_dir: str | None) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "vitpool",
        "serve",
        "--name",
        POOL_NAME,
        "--num-actors",
        "1",
        "--autoscale",
        f"1,{args.max_actors}",
        "--device",
        args.device,
        "--dtype",
        "bfloat16" if args.device == "cuda" else "float32",
    ]
    if model_dir is not None:
        command += ["--model", model_dir]
    if (
        args.device == "cpu"
    ):  # one fake GPU each, so that the cluster's GPUs bound the pool as on a GPU machine
        command += ["--gpus-per-actor", "1"]
    return command


# reading the pool while it runs


class Monitor:
    """Reads the pool's membership every `interval_s` from a thread of the main process: the
    controller's view (the handle's own is kept by long polls and has no time stamps), and each
    active actor's busy share since the last reading, as the autoscaler reads it."""

    def __init__(self, pool: EncoderPool, interval_s: float, on_change: Any) -> None:
        self.samples: list[Sample] = []
        self._pool, self._interval_s, self._on_change = pool, interval_s, on_change
        self._seen: dict[int, tuple[float, float]] = {}  # actor -> (uptime, busy seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscale-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        controller = self._pool._controller  # private, as in pool_kill.py: no public membership with indices
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                membership = ray.get(controller.membership.remote(), timeout=10)
                held = ray.get(controller.all_actors.remote(), timeout=10)
            except (ray.exceptions.RayError, TimeoutError) as error:
                print(f"monitor: could not read the pool: {type(error).__name__}: {error}", flush=True)
            else:
                sample = Sample(began, sorted(membership.actors), sorted(held), self._busy(membership.actors))
                previous = self.samples[-1] if self.samples else None
                self.samples.append(sample)
                if previous is None or (previous.active, previous.held) != (sample.active, sample.held):
                    self._on_change(sample)
            self._stop.wait(max(0.0, self._interval_s - (time.monotonic() - began)))

    def _busy(self, actors: dict[int, Any]) -> dict[int, float]:
        refs = {index: handle.stats.remote() for index, handle in actors.items()}
        busy = {}
        for index, ref in refs.items():
            try:
                stats = ray.get(ref, timeout=2 * self._interval_s)
            except (ray.exceptions.RayError, TimeoutError):
                continue
            uptime, busy_seconds = self._seen.get(index, (0.0, 0.0))
            if index in self._seen and stats.uptime_seconds > uptime:
                busy[index] = min(1.0, (stats.busy_seconds - busy_seconds) / (stats.uptime_seconds - uptime))
            self._seen[index] = (stats.uptime_seconds, stats.busy_seconds)
        return busy

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def actor_events(samples: list[Sample], start: float) -> dict[int, dict[str, float | str | None]]:
    """Per actor, seconds from the schedule's start when it was first seen held (starting), active
    (joined), held but no longer active (retiring) and gone; "serve" for what happened before the
    first reading (`vitpool serve` started and joined actor 0)."""
    events: dict[int, dict[str, float | str | None]] = {}
    for number, sample in enumerate(samples):
        t: float | str = "serve" if number == 0 else sample.t - start
        for index in sample.held:
            events.setdefault(index, {"started": t, "joined": None, "retiring": None, "gone": None})
        for index in sample.active:
            if events[index]["joined"] is None:
                events[index]["joined"] = t
        for index, times in events.items():
            if times["joined"] is not None and times["retiring"] is None and index not in sample.active:
                times["retiring"] = t
            if times["gone"] is None and index not in sample.held:
                times["gone"] = t
    return events


# the report


def percentile_ms(values: list[float], fraction: float) -> float | None:
    ordered = sorted(values)
    return (
        1e3 * ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))] if ordered else None
    )


def phase_rows(
    phases: list[Phase], records: list[tuple[float, float, int]], samples: list[Sample], start: float
) -> list[dict]:
    """Per phase: items/s (every caller's returned results over the phase's length), latency,
    calls, failed, wrong, and the seconds and items/s at each actor count within it."""
    done = sorted(records)
    times = [r[0] for r in done]
    returned_times = [r[0] for r in done if r[2] != FAILED]
    rows = []
    for label, phase, (begin, end) in zip(phase_labels(phases), phases, phase_bounds(phases)):
        inside = done[bisect.bisect_left(times, begin) : bisect.bisect_left(times, end)]
        latencies = [r[1] for r in inside if r[2] != FAILED]
        by_count: dict[int, dict[str, float]] = {}
        for sample, following in zip(samples, samples[1:] + [None]):
            a = max(begin, sample.t - start)
            b = min(end, (following.t - start) if following else end)
            if b <= a:
                continue
            slot = by_count.setdefault(len(sample.active), {"seconds": 0.0, "items": 0})
            slot["seconds"] += b - a
            slot["items"] += bisect.bisect_left(returned_times, b) - bisect.bisect_left(returned_times, a)
        for slot in by_count.values():
            slot["items_per_s"] = slot["items"] / slot["seconds"]
        in_phase = [s for s in samples if begin <= s.t - start < end]
        busy = [statistics.mean(s.busy.values()) for s in in_phase if s.busy]
        rows.append(
            {
                "phase": label,
                "kind": phase.kind,
                "seconds": phase.seconds,
                "items_per_s": len(latencies) / phase.seconds,
                "calls": len(inside),
                "p50_ms": percentile_ms(latencies, 0.50),
                "p99_ms": percentile_ms(latencies, 0.99),
                "failed": sum(r[2] == FAILED for r in inside),
                "wrong": sum(r[2] in (INEXACT, WRONG) for r in inside),
                "beyond_tolerance": sum(r[2] == WRONG for r in inside),
                "actors_min": min((len(s.active) for s in in_phase), default=None),
                "actors_max": max((len(s.active) for s in in_phase), default=None),
                "actors_at_end": len(in_phase[-1].active) if in_phase else None,
                "mean_busy": statistics.mean(busy) if busy else None,
                "by_actor_count": {str(count): slot for count, slot in sorted(by_count.items())},
            }
        )
    return rows


def timeline(
    records: list[tuple[float, float, int]], samples: list[Sample], start: float, total_s: float
) -> list[dict]:
    """One row per second of the schedule: calls returned, failed, actors active and held, busy."""
    rows = [
        {"t": second, "returned": 0, "failed": 0, "active": None, "held": None, "busy": None}
        for second in range(math.ceil(total_s) + 1)
    ]
    for t, _, outcome in records:
        if 0 <= t < len(rows):
            rows[int(t)]["failed" if outcome == FAILED else "returned"] += 1
    for sample in samples:
        second = int(sample.t - start)
        if 0 <= second < len(rows):
            rows[second].update(
                active=len(sample.active),
                held=len(sample.held),
                busy={str(k): round(v, 3) for k, v in sample.busy.items()},
            )
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _at(value: float | str | None) -> str:
    return value if isinstance(value, str) else _ms(value)


def print_report(results: dict) -> None:
    print(
        f"\n{results['device_name']} x{results['gpus']}, Ray {results['ray']}; pool autoscaling 1-"
        f"{results['max_actors']} (a reading every {results['autoscale_interval_s']:g} s: "
        f"up after {UP_READINGS} at >= {UP_BUSY:.0%} busy, down after {DOWN_READINGS} "
        f"at <= {DOWN_BUSY:.0%}); {results['callers']} caller processes, 1x224² a call; "
        f"low: {results['low_rate']:g} calls/s in all, "
        f"high: {results['threads']} threads per caller back to back"
    )
    print(
        f"scale-ups {results['scale_ups']}, scale-downs {results['scale_downs']} (pool.stats(): "
        f"{results['pool_stats']['autoscale_ups']} up, {results['pool_stats']['autoscale_downs']} down, "
        f"actor failures {results['pool_stats']['actor_failures']}); calls {results['calls']}, "
        f"failed {results['failed']}, wrong (not bit-equal) {results['wrong']}, "
        f"beyond tolerance {results['beyond_tolerance']}, "
        f"largest relative error {results['largest_relative_error']:.2g}"
    )
    for error in results["errors"]:
        print(f"  error: {error}")
    print(
        f"\nActors, seconds from the schedule's start, as read every {results['arguments']['poll_s']:g} s "
        f"(`vitpool serve` took {results['serve_seconds']:.1f} s)"
    )
    print("| actor | started | joined (takes work) | retiring | gone |")
    print("|---|---|---|---|---|")
    for index, times in results["actor_events"].items():
        print(
            f"| {index} | {_at(times['started'])} | {_at(times['joined'])} | {_at(times['retiring'])} "
            f"| {_at(times['gone'])} |"
        )
    print("\nItems/s within each phase by the number of actors taking work")
    print("| phase | actors | seconds | items/s |")
    print("|---|---|---|---|")
    for row in results["phases"]:
        for count, slot in row["by_actor_count"].items():
            print(f"| {row['phase']} | {count} | {slot['seconds']:.1f} | {slot['items_per_s']:.1f} |")
    print(
        "\n| phase | seconds | actors (min-max, at end) | mean busy | items/s | p50 / p99 ms | calls "
        "| failed | wrong (beyond tol.) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in results["phases"]:
        busy = "-" if row["mean_busy"] is None else f"{row['mean_busy']:.0%}"
        print(
            f"| {row['phase']} | {row['seconds']:g} "
            f"| {row['actors_min']}-{row['actors_max']}, {row['actors_at_end']} "
            f"| {busy} | {row['items_per_s']:.1f} | {_ms(row['p50_ms'])} / {_ms(row['p99_ms'])} "
            f"| {row['calls']} | {row['failed']} | {row['wrong']} ({row['beyond_tolerance']}) |"
        )


# main


def collect(queue: Any, processes: list[Any], timeout_s: float) -> list[Any]:
    """One message from each caller process; stops if one of them died first."""
    import queue as queues

    messages, deadline = [], time.monotonic() + timeout_s
    while len(messages) < len(processes):
        try:
            messages.append(queue.get(timeout=1.0))
        except queues.Empty:
            dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise SystemExit(
                    f"caller processes failed (exit codes {dead}) or timed out; see their output above"
                )
    return messages


def run(args: argparse.Namespace, phases: list[Phase], pool: EncoderPool) -> dict:
    """The callers and the monitor over the schedule; everything but the environment."""
    context = mp.get_context("spawn")
    start_at, go, ready, results = context.Value("d", 0.0), context.Event(), context.Queue(), context.Queue()
    plans = [
        CallerPlan(
            number,
            POOL_NAME,
            tuple(phases),
            args.images,
            args.threads,
            args.low_rate / args.callers,
            args.call_timeout_s or None,
        )
        for number in range(args.callers)
    ]
    processes = [
        context.Process(target=caller_main, args=(plan, start_at, go, ready, results)) for plan in plans
    ]
    start_box: list[float] = []

    def changed(sample: Sample) -> None:
        t = f"{sample.t - start_box[0]:7.1f} s" if start_box else "  before"
        print(f"[{t}] actors taking work {sample.active}, held {sample.held}", flush=True)

    monitor = Monitor(pool, args.poll_s, changed)
    for process in processes:
        process.start()
    try:
        collect(ready, processes, 600.0)  # each connected and computed its references
        start = time.monotonic() + 1.0
        start_box.append(start)
        start_at.value = start
        go.set()
        labels = phase_labels(phases)
        for label, phase, (begin, _) in zip(labels, phases, phase_bounds(phases)):
            time.sleep(max(0.0, start + begin - time.monotonic()))
            print(
                f"[{time.monotonic() - start:7.1f} s] phase {label} ({phase.seconds:g} s) begins", flush=True
            )
        outcomes = collect(results, processes, sum(p.seconds for p in phases) + 900.0)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
        monitor.close()
    records = [record for outcome in outcomes for record in outcome["records"]]
    stats = pool.stats(timeout_s=10)
    events = actor_events(monitor.samples, start)
    first = monitor.samples[0] if monitor.samples else None
    return {
        "phases": phase_rows(phases, records, monitor.samples, start),
        "actor_events": {str(index): times for index, times in sorted(events.items())},
        # joins and leaves the monitor saw after the schedule started, beyond the first actor
        "scale_ups": sum(
            1
            for index, t in events.items()
            if t["joined"] is not None and (first is None or index not in first.active)
        ),
        "scale_downs": sum(1 for t in events.values() if t["retiring"] is not None),
        "pool_stats": {
            "autoscale_ups": stats.autoscale_ups,
            "autoscale_downs": stats.autoscale_downs,
            "actor_failures": stats.actor_failures,
            "actor_restarts": stats.actor_restarts,
            "pool_items": stats.pool_items,
            "departed_actors": stats.departed_actors,
            "standby_takeovers": stats.standby_takeovers,
        },
        "calls": len(records),
        "failed": sum(r[2] == FAILED for r in records),
        "wrong": sum(r[2] in (INEXACT, WRONG) for r in records),  # not bit-equal to the reference
        "beyond_tolerance": sum(r[2] == WRONG for r in records),
        "errors": [error for outcome in outcomes for error in outcome["errors"]][:5],
        "largest_relative_error": max(outcome["largest_error"] for outcome in outcomes),
        "per_caller": [
            {"number": o["number"], "calls": len(o["records"]), "errors": o["error_count"]} for o in outcomes
        ],
        "timeline": timeline(records, monitor.samples, start, sum(p.seconds for p in phases)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: the shipped tiny model on CPU actors, with --fake-gpus fake GPUs in Ray",
    )
    parser.add_argument(
        "--fake-gpus", type=int, default=2, help="with --device cpu: GPUs Ray pretends to have"
    )
    parser.add_argument(
        "--max-actors", type=int, default=None, help="the autoscaler's N (default: one per GPU)"
    )
    parser.add_argument("--callers", type=int, default=None, help="caller processes (default: 2 per GPU)")
    parser.add_argument(
        "--threads", type=int, default=4, help="threads per caller (all busy in a high phase)"
    )
    parser.add_argument(
        "--low-rate",
        type=float,
        default=None,
        help="calls/s of a low phase, all callers together (default: 20 on cuda, 10 on cpu)",
    )
    parser.add_argument("--images", type=int, default=4, help="distinct 224² images per caller")
    parser.add_argument(
        "--phases",
        default=None,
        help="KIND:SECONDS,... with KIND low, high or idle (default: low, high, low, "
        "long enough for the autoscaler's policy to go 1 -> N -> 1)",
    )
    parser.add_argument("--poll-s", type=float, default=1.0, help="how often the pool's membership is read")
    parser.add_argument(
        "--call-timeout-s", type=float, default=300.0, help="a call that takes longer fails (0: none)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # inherited by ray start, serve, stop and the callers; without token authentication, a client
    # that joins by address needs no token file
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no GPU here: run with --device cpu")
        gpus, device_name = torch.cuda.device_count(), torch.cuda.get_device_name()
    else:
        gpus, device_name = (
            args.fake_gpus,
            f"CPU ({os.cpu_count()} cores), {args.fake_gpus} fake GPUs, tiny model",
        )
    args.max_actors = args.max_actors or gpus
    args.callers = args.callers or 2 * gpus
    args.low_rate = args.low_rate or LOW_RATE[args.device]
    interval_s = PoolSettings().autoscale_interval_s  # `vitpool serve` has no flag for it
    phases = (
        parse_phases(args.phases) if args.phases else default_phases(args.max_actors, interval_s, args.device)
    )
    print(
        "schedule: "
        + ", ".join(f"{label} {p.seconds:g} s" for label, p in zip(phase_labels(phases), phases)),
        flush=True,
    )
    model_dir = (
        str(save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-"))) if args.device == "cuda" else None
    )

    cpus = max(os.cpu_count() or 1, args.max_actors + 1) if args.device == "cpu" else None
    head = RayHead(gpus, cpus, Path(tempfile.mkdtemp(prefix="vitpool-bench-")) / "ray_start.log")
    os.environ["RAY_ADDRESS"] = head.address  # this process, serve, stop and the callers join it
    pool = None
    try:
        began = time.monotonic()
        command = serve_command(args, model_dir)
        run_command(command)
        serve_s = time.monotonic() - began
        pool = EncoderPool.connect(POOL_NAME)
        if pool.settings.autoscale_interval_s != interval_s:
            raise SystemExit(f"the pool reads every {pool.settings.autoscale_interval_s} s, not {interval_s}")
        measured = run(args, phases, pool)
        results = {
            "device_name": device_name,
            "device": args.device,
            "gpus": gpus,
            "ray": ray.__version__,
            "torch": torch.__version__,
            "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "max_actors": args.max_actors,
            "callers": args.callers,
            "threads": args.threads,
            "low_rate": args.low_rate,
            "schedule": [asdict(p) for p in phases],
            "autoscale_interval_s": pool.settings.autoscale_interval_s,
            "serve_command": command,
            "serve_seconds": serve_s,
            **measured,
        }
    finally:
        if pool is not None:
            pool.close()
        if ray.is_initialized():
            ray.shutdown()
        run_command([sys.executable, "-m", "vitpool", "stop", "--name", POOL_NAME, "--quiet"], check=False)
        head.stop()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print_report(results)


if __name__ == "__main__":
    main()
