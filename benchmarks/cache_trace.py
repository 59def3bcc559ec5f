"""The embedding cache (issue 30): a multi-turn trace where half the items repeat, with the cache
off, on with the shared cache alone (`embedding_cache_local_bytes=0`) and on with each handle's own
tier (the default when on), in one run; what a key costs next to an encode; what a lookup adds to
a call.

The real-size Qwen3-VL-8B vision tower (random bf16 weights, saved once) on one GPU, one actor.

- key cost: `item_key` of one 224² image's pixels (the processor's float32 rows) against the same
  image encoded in-process (`GraphEncoder.encode`, synchronised), both on this machine;
- trace: `--clients` threads each send `--calls` calls in turn (closed loop), each call one or
  two images of 224² or 448²; an image repeats one sent earlier with probability `--repeat`
  (the same trace, seeded, for both pools). Items/s over the whole trace and each call's latency,
  also by kind of call: with a repeat of an item whose first call was still in flight (with the
  cache, it waits for that encode), with a fresh item, or of repeats of finished calls only;
- one call: sequential 1×224² calls of fresh images (every one a miss) and of one image again
  (every one a hit: from the shared cache without a tier, else from the tier), to show what the
  lookup adds and what a hit costs. The trace's clients are threads of one process, so with a tier
  a repeat is mostly served by it.

    python benchmarks/cache_trace.py [--calls 100] [--clients 8] [--repeat 0.5] [--out cache.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import threading
import time
from pathlib import Path

import torch
from common import image, save_random_tower, summarize, time_ms

from vitpool import EncoderPool, GraphEncoder
from vitpool.items import prepare_item
from vitpool.pool.cache_keys import item_key, model_identity

SIDES = (224, 448)


def trace(clients: int, calls: int, repeat: float, seed: int) -> list[list[list]]:
    """Per client, its calls, each a list of images; repeats are earlier images of any client."""
    rng = random.Random(seed)
    sent: list = []
    per_client: list[list[list]] = [[] for _ in range(clients)]
    for turn in range(calls):
        for client in range(clients):
            items = []
            for _ in range(rng.choice((1, 2))):
                if sent and rng.random() < repeat:
                    items.append(rng.choice(sent[-256:]))
                else:
                    items.append(image(rng.choice(SIDES)))
                    sent.append(items[-1])
            per_client[client].append(items)
    return per_client


def run_trace(pool: EncoderPool, calls: list[list[list]]) -> dict:
    timed: list[tuple[float, float, list]] = []  # per call: start, end, its items
    lock = threading.Lock()
    barrier = threading.Barrier(len(calls) + 1)

    def client(mine: list[list]) -> None:
        barrier.wait()
        for items in mine:
            start = time.perf_counter()
            pool.encode(items)
            end = time.perf_counter()
            with lock:
                timed.append((start, end, items))

    threads = [threading.Thread(target=client, args=(mine,)) for mine in calls]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    num_items = sum(len(items) for mine in calls for items in mine)
    latencies = [(end - begin) * 1e3 for begin, end, _ in timed]
    return {
        "items_per_s": num_items / elapsed,
        "items": num_items,
        "latency": summarize(latencies),
        "latency_by_kind": {
            kind: summarize(values) for kind, values in calls_by_kind(timed).items() if values
        },
    }


def calls_by_kind(timed: list[tuple[float, float, list]]) -> dict[str, list[float]]:
    """Each call's latency (ms) by what its items were, as this run's timing makes them: "repeat of
    one in flight" if an item's first call (by start) had not ended when this one began (with the
    cache, the call waits for another caller's encode), else "fresh" if an item is new (a miss),
    else "repeats of finished calls" (hits)."""
    first_call: dict[int, tuple[float, float]] = {}
    for begin, end, items in sorted(timed, key=lambda call: call[0]):
        for item in items:
            first_call.setdefault(id(item), (begin, end))
    kinds: dict[str, list[float]] = {
        "repeat of one in flight": [],
        "fresh": [],
        "repeats of finished calls": [],
    }
    for begin, end, items in timed:
        firsts = [first_call[id(item)] for item in items]
        if any(first[0] < begin < first[1] for first in firsts):
            kind = "repeat of one in flight"
        elif any(first[0] == begin for first in firsts):
            kind = "fresh"
        else:
            kind = "repeats of finished calls"
        kinds[kind].append((end - begin) * 1e3)
    return kinds


def one_call(pool: EncoderPool, runs: int, warmup: int) -> dict:
    fresh = iter([[image(224)] for _ in range(runs + warmup)])
    same = [image(224)]
    return {
        "fresh_1x224": summarize(time_ms(lambda: pool.encode(next(fresh)), runs, warmup, synchronize=False)),
        "same_1x224": summarize(time_ms(lambda: pool.encode(same), runs, warmup, synchronize=False)),
    }


def key_cost(encoder: GraphEncoder, runs: int) -> dict:
    item = image(224)
    prepared = prepare_item(0, item, encoder.adapter.item_rules)
    identity = model_identity(None, "bfloat16")
    return {
        "key_1x224": summarize(
            time_ms(lambda: item_key(identity, prepared.parts), runs, 20, synchronize=False)
        ),
        "encode_1x224_in_process": summarize(time_ms(lambda: encoder.encode([item]), runs, 20)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=100, help="calls per client")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--repeat", type=float, default=0.5)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--cache-bytes", type=int, default=4 << 30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    gpu = torch.cuda.get_device_name()
    directory = save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-"))
    results: dict = {"gpu": gpu, "args": {k: str(v) for k, v in vars(args).items()}}

    encoder = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    results.update(key_cost(encoder, args.runs))
    del encoder
    torch.cuda.empty_cache()
    print(json.dumps(results, indent=1), flush=True)

    calls = trace(args.clients, args.calls, args.repeat, seed=0)
    settings = {
        "cache off": {"embedding_cache_bytes": 0},
        "cache on, shared only": {
            "embedding_cache_bytes": args.cache_bytes,
            "embedding_cache_local_bytes": 0,
        },
        "cache on, with a tier": {"embedding_cache_bytes": args.cache_bytes},
    }
    for number, (label, setting) in enumerate(settings.items()):
        pool = EncoderPool.launch(
            model=str(directory),
            num_actors=1,
            dtype="bfloat16",
            name=f"cache-{number}",
            **setting,
        )
        try:
            pool.encode([image(224), image(448)])  # warm-up
            results[label] = {"one_call": one_call(pool, args.runs, 20), "trace": run_trace(pool, calls)}
            stats = pool.stats()
            results[label]["stats"] = stats.summary()
        finally:
            pool.shutdown()
        print(label, json.dumps(results[label], indent=1), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
