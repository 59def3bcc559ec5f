"""How long an encoded item takes to reach the embedding cache under load, and what a caller that
waits for it pays. (Also run against a publisher with two and with four threads, a trial not kept:
`vitpool/actors/cache_publisher.py` says what it gave.)

`cache_trace.py` showed calls that repeat an item another caller is still encoding (the cache
makes them wait for that encode) taking about 3x a call's median, and with the shared cache alone
a p99 of 190 ms for repeats of items whose calls had ended. Both wait on the encoder actor's
publishing (`vitpool.actors.cache_publisher`): this study times it.

The real-size Qwen3-VL-8B vision tower (random bf16 weights), one actor on one GPU, the shared
cache alone (`embedding_cache_local_bytes=0`), `cache_trace.py`'s trace. Probes (the library is not
changed): in the actor, each publication's queueing (from `publish` until its thread takes it) and
its work, in parts (the copy to the host; the insert sent; the rest, mostly `ray.put`); in this
process, each `served` that waited for another caller's item (the wait and the fetch).

    python benchmarks/studies/cache_publish_lag.py [--calls 60] [--clients 8] [--out F]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import ray
import torch
from cache_trace import run_trace, trace
from common import image, save_random_tower, summarize

from vitpool import EncoderPool
from vitpool.pool import embedding_cache


def install_publish_probes(actor) -> bool:
    """Run inside the encoder actor: time each publication's wait in the queue and its work."""
    publisher = actor._publisher
    publisher.lag_samples = []
    send, on_host, cache = publisher._send, publisher._on_host, publisher._cache
    parts = {"to_host": 0.0, "insert": 0.0}

    def timed_on_host(embedding):
        start = time.perf_counter()
        try:
            return on_host(embedding)
        finally:
            parts["to_host"] += time.perf_counter() - start

    def timed_insert(*args):
        start = time.perf_counter()
        try:
            return cache.insert.remote(*args)
        finally:
            parts["insert"] += time.perf_counter() - start

    # the cache actor's handle as the publisher uses it, its insert timed
    timed_cache = types.SimpleNamespace(
        insert=types.SimpleNamespace(remote=timed_insert), abandon=cache.abandon
    )
    publisher._on_host, publisher._cache = timed_on_host, timed_cache

    def timed_send(entries, submitted: float) -> None:
        started = time.perf_counter()
        parts["to_host"] = parts["insert"] = 0.0
        send(entries)
        work = time.perf_counter() - started
        publisher.lag_samples.append(
            (started - submitted, work, len(entries), parts["to_host"], parts["insert"])
        )

    def publish(keys, values) -> None:
        entries = [(key, value) for key, value in zip(keys, values) if key is not None]
        if entries:
            publisher._thread.submit(timed_send, entries, time.perf_counter())

    publisher.publish = publish
    return True


def publish_samples(actor) -> list:
    return list(actor._publisher.lag_samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=60, help="calls per client")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--repeat", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    directory = save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-"))
    pool = EncoderPool.launch(
        model=str(directory),
        num_actors=1,
        dtype="bfloat16",
        embedding_cache_bytes=4 << 30,
        embedding_cache_local_bytes=0,
    )
    waits: list[float] = []
    served = embedding_cache.CacheClient.served

    def timed_served(self, answer, results, want_refs, timeout_s=None):
        start = time.perf_counter()
        try:
            return served(self, answer, results, want_refs, timeout_s)
        finally:
            if answer.waiting:
                waits.append((time.perf_counter() - start) * 1e3)

    embedding_cache.CacheClient.served = timed_served
    try:
        actor = ray.get_actor("vitpool-encoder-0", namespace="vitpool")
        ray.get(actor.__ray_call__.remote(install_publish_probes))
        pool.encode([image(224), image(448)])  # warm-up
        outcome = run_trace(pool, trace(args.clients, args.calls, args.repeat, seed=0))
        time.sleep(1.0)  # the last publications
        samples = ray.get(actor.__ray_call__.remote(publish_samples))
        stats = pool.stats()
    finally:
        embedding_cache.CacheClient.served = served
        pool.shutdown()
    results = {
        "gpu": torch.cuda.get_device_name(),
        "trace": outcome,
        "publications": len(samples),
        "publish_queued": summarize([1e3 * sample[0] for sample in samples]),
        "publish_work": summarize([1e3 * sample[1] for sample in samples]),
        "publish_work_per_item": summarize([1e3 * sample[1] / sample[2] for sample in samples]),
        # the work's parts: the copy to the host, the insert sent, and the rest (mostly `ray.put`)
        "publish_to_host": summarize([1e3 * sample[3] for sample in samples]),
        "publish_insert": summarize([1e3 * sample[4] for sample in samples]),
        "publish_put_and_rest": summarize([1e3 * (sample[1] - sample[3] - sample[4]) for sample in samples]),
        "served_with_a_wait": summarize(waits) if waits else None,
        "cache": stats.cache.summary() if stats.cache is not None else None,
    }
    print(json.dumps(results, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
