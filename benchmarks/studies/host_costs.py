"""The host's costs that a same-node channel call is made of, each alone (no GPU needed).

Median (p99) in microseconds of many repetitions after warm-up:
- copying 1.2 MB (a 224² image's float32 pixels) and 1.6 MB (its bf16 tokens and deepstack
  features) into an mmap'd /dev/shm segment, and out of it into fresh memory;
- a small message's round trip over a Unix socket to another process;
- a hand-off between two threads (queue.SimpleQueue there, a Future back);
- both again with the far side pausing 4 ms before it answers (as an encode would): what waking
  a thread that slept costs, over the pause.

    python benchmarks/studies/host_costs.py [--runs 2000]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import multiprocessing
import os
import queue
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import numpy as np
from common import summarize, time_ms

PAUSE_S = 0.004


def echo(address: str, ready) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(1)
    ready.set()
    connection, _ = listener.accept()
    while data := connection.recv(64):
        if data.startswith(b"p"):
            busy_until = time.perf_counter() + PAUSE_S  # busy, as a thread waiting on a GPU spins
            while time.perf_counter() < busy_until:
                pass
        connection.sendall(data)


def timed_us(function, runs: int, warmup: int = 100) -> dict:
    result = summarize(time_ms(function, runs, warmup, synchronize=False))
    return {"median_us": result["median_ms"] * 1e3, "p99_us": result["p99_ms"] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    results = {}

    descriptor, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.ftruncate(descriptor, 8 << 20)
    segment = mmap.mmap(descriptor, 8 << 20)
    os.close(descriptor)
    os.unlink(path)
    for name, nbytes in (("1.2MB", 196 * 1536 * 4), ("1.6MB", 4 * 49 * 4096 * 2)):
        source = np.random.rand(nbytes // 4).astype(np.float32)
        target = np.frombuffer(segment, dtype=np.float32, count=source.size)
        results[f"copy {name} into segment"] = timed_us(lambda s=source, t=target: np.copyto(t, s), args.runs)
        results[f"copy {name} out to fresh memory"] = timed_us(lambda t=target: t.copy(), args.runs)
        reused = np.empty_like(source)
        results[f"copy {name} out to reused memory"] = timed_us(
            lambda t=target, r=reused: np.copyto(r, t), args.runs
        )
        del target

    address = f"\0vitpool-host-costs-{os.getpid()}"
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    server = context.Process(target=echo, args=(address, ready), daemon=True)
    server.start()
    ready.wait(30)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(address)

    def round_trip(first: bytes = b"x") -> None:
        client.sendall(first + b"x" * 31)
        received = 0
        while received < 32:
            received += len(client.recv(64))

    results["unix socket round trip, 32 B"] = timed_us(round_trip, args.runs)
    pause_runs = max(100, args.runs // 10)
    paused = timed_us(lambda: round_trip(b"p"), pause_runs, warmup=10)
    results["unix socket round trip, far side busy 4 ms, minus the 4 ms"] = _minus_pause(paused)
    client.close()
    server.join(timeout=5)

    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def worker() -> None:
        while (job := jobs.get()) is not None:
            future, pause = job
            if pause:
                time.sleep(PAUSE_S)
            future.set_result(None)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    def hand_off(pause: bool = False) -> None:
        future: concurrent.futures.Future = concurrent.futures.Future()
        jobs.put((future, pause))
        future.result()

    results["thread hand-off there and back"] = timed_us(hand_off, args.runs)
    paused = timed_us(lambda: hand_off(True), pause_runs, warmup=10)
    results["thread hand-off, other thread sleeps 4 ms, minus the 4 ms"] = _minus_pause(paused)
    jobs.put(None)

    print(f"host: {os.cpu_count()} CPUs; median (p99) us of {args.runs} runs")
    for name, row in results.items():
        print(f"| {name} | {row['median_us']:.0f} ({row['p99_us']:.0f}) |")


def _minus_pause(row: dict) -> dict:
    return {key: value - PAUSE_S * 1e6 for key, value in row.items()}


if __name__ == "__main__":
    main()
