"""One actor killed during a stream of calls: call latency before, during and after, items lost,
and the time until the replacement takes work.

Two actors of the real-size Qwen3-VL-8B tower (random bf16 weights) share the GPU(s); several
threads call back to back with 1x224² images and check every result against the in-process
encoder: a result is wrong past a relative error of 1e-2 (bf16), and one not bit-equal is counted
apart (an actor runs callers' batches combined, and a GEMM over more rows may round otherwise).
After `--kill-at` seconds the process of actor 0 is killed (SIGKILL). "During" runs
from the kill until the replacement actor is in the pool; "after" is the rest.

With `--standby ahead` (the pool's default on GPUs) the kill waits until the node's warm standby has
built its encoder and captured its graphs beside an actor (`standby_graphs`), and it takes over
at once; `--standby imports` waits for a standby that has only imported the engine and read the
checkpoint, which loads and captures on the dead actor's GPU (`standby_graphs=False`); `--standby
off` starts a fresh actor process instead (the baseline). "Taking work" is the first item the
replacement has encoded, read from the pool's stats every 50 ms.

    python benchmarks/pool_kill.py [--seconds 40] [--kill-at 10] [--threads 4] \
        [--standby ahead|imports|off] [--out pool_kill.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch
from common import image, save_random_tower, summarize

from vitpool import EncoderPool, GraphEncoder

WRONG_ABOVE = 1e-2  # relative error of a result against the in-process encoder's


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--kill-at", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument(
        "--standby",
        default="ahead",
        choices=("ahead", "imports", "off"),
        help="warm standbys that build ahead, that only import, or none",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    gpu = torch.cuda.get_device_name()
    directory = str(save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-")))
    encoder = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    gpus = torch.cuda.device_count()
    pool = EncoderPool.launch(
        model=directory,
        num_actors=2,
        dtype="bfloat16",
        actor_options={"num_gpus": min(1.0, gpus / 2)},
        warm_standby=args.standby != "off",
        standby_graphs=args.standby == "ahead",
    )
    standby_states = []
    if args.standby != "off":  # the kill is measured against a standby that is ready
        while not (standbys := ray.get(pool._controller.standbys.remote())):
            time.sleep(0.2)
        standby_states = [
            vars(state) for state in ray.get([h.standby_state.remote() for h in standbys.values()])
        ]
        print(f"warm standbys ready: {standby_states}", flush=True)
    items = [[image(224)] for _ in range(args.threads)]
    expected = [encoder.encode(call, output_device="cpu")[0].tokens for call in items]
    for call in items:  # warm-up
        pool.encode(call)

    records: list[tuple[float, float]] = []  # (start, latency s)
    wrong, inexact, worst, errors = [0], [0], [0.0], []
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + args.seconds

    def caller(number: int) -> None:
        while time.monotonic() < deadline:
            began = time.monotonic()
            try:
                (result,) = pool.encode(items[number], timeout_s=300)
            except Exception as error:  # noqa: BLE001 - counted and reported
                errors.append(repr(error))
                continue
            took = time.monotonic() - began
            with lock:
                records.append((began - start, took))
                if not torch.equal(result.tokens, expected[number]):
                    inexact[0] += 1
                    want = expected[number].float()
                    error = ((result.tokens.float() - want).norm() / want.norm()).item()
                    worst[0] = max(worst[0], error)
                    wrong[0] += not error <= WRONG_ABOVE

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(args.threads)]
    for thread in threads:
        thread.start()
    time.sleep(args.kill_at)
    membership = ray.get(pool._controller.membership.remote())
    victim = min(membership.infos)
    in_flight = pool._dispatcher.in_flight().get(victim, 0)
    os.kill(membership.infos[victim].pid, signal.SIGKILL)
    killed_at = time.monotonic() - start
    recovered_at = worked_at = None
    while time.monotonic() < deadline:
        infos = ray.get(pool._controller.membership.remote()).infos
        if len(infos) == 2 and victim not in infos:
            recovered_at = time.monotonic() - start
            break
        time.sleep(0.05)
    newcomers = set(infos) - set(membership.infos) if recovered_at is not None else set()
    while newcomers and time.monotonic() < deadline:
        if any(a.items > 0 for a in pool.stats(timeout_s=10).actors if a.actor_index in newcomers):
            worked_at = time.monotonic() - start
            break
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    stats = pool.stats()
    pool.shutdown()

    end_of_during = recovered_at if recovered_at is not None else args.seconds
    phases = {
        "before": [t for s, t in records if s < killed_at],
        "during": [t for s, t in records if killed_at <= s < end_of_during],
        "after": [t for s, t in records if s >= end_of_during],
    }
    results = {
        "gpu": gpu,
        "gpus": gpus,
        "ray": ray.__version__,
        "threads": args.threads,
        "killed_at_s": killed_at,
        "replacement_ready_s": recovered_at,
        "recovery_s": None if recovered_at is None else recovered_at - killed_at,
        "kill_to_work_s": None if worked_at is None else worked_at - killed_at,
        "standby_states": standby_states,
        "batches_in_flight_on_victim_from_this_process": in_flight,
        "calls": len(records),
        "calls_failed": len(errors),
        "results_wrong": wrong[0],
        "results_not_bit_equal": inexact[0],
        "worst_relative_error": worst[0],
        "items_sent_again": stats.requeued_items,
        "actor_restarts": stats.actor_restarts,
        "standby": args.standby,
        "standby_takeovers": stats.standby_takeovers,
        "phases": {
            name: {"calls": len(v), **summarize([x * 1e3 for x in v])} if v else {"calls": 0}
            for name, v in phases.items()
        },
        "errors": errors[:5],
    }
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(
        f"\nGPU: {gpu} x{gpus}; 2 actors, warm standby {args.standby}; {args.threads} threads calling 1x224² "
        f"back to back for {args.seconds:.0f} s"
    )
    print(
        f"killed actor {victim} at {killed_at:.1f} s with {in_flight} batches in flight from this process; "
        f"replacement ready at {recovered_at if recovered_at is None else round(recovered_at, 2)} s, "
        f"taking work {results['kill_to_work_s']} s after the kill"
    )
    print(
        f"calls {len(records)}, failed {len(errors)}, wrong results {wrong[0]} (not bit-equal {inexact[0]}, "
        f"worst relative error {worst[0]:.1e}), item sends repeated "
        f"{stats.requeued_items}, restarts {stats.actor_restarts} "
        f"({stats.standby_takeovers} by a warm standby)"
    )
    print("| phase | calls | median ms | p99 ms |")
    print("|---|---|---|---|")
    for name, row in results["phases"].items():
        if row["calls"]:
            print(f"| {name} | {row['calls']} | {row['median_ms']:.2f} | {row['p99_ms']:.2f} |")


if __name__ == "__main__":
    main()
