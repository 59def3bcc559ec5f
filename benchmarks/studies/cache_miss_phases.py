"""What a missed lookup in the embedding cache adds to a call, in parts.

The real-size Qwen3-VL-8B vision tower (random bf16 weights), one actor on one GPU, a pool with the
cache on and no tier of the caller's own (`embedding_cache_local_bytes=0`). Sequential 1×224²
calls of fresh images, alternating in one run (median, p99 in ms):

- miss: `pool.encode` (key, lookup, encode with the key in the plan, the actor publishes);
- lookup alone: the key and the cache's answer, then the claim given up;
- encode, no cache: the same pool's call path without the cache (nothing looked up or published);
- encode, right after a miss: as "no cache", right after an untimed miss, so that it meets the
  actor's publishing of that miss as the next call of a stream of misses does.

    python benchmarks/studies/cache_miss_phases.py [--runs 100] [--out F]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
from common import image, save_random_tower, summarize

from vitpool import EncoderPool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    directory = save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-"))
    pool = EncoderPool.launch(
        model=str(directory),
        num_actors=1,
        dtype="bfloat16",
        name="cache-miss-phases",
        embedding_cache_bytes=4 << 30,
        embedding_cache_local_bytes=0,
    )
    cache = pool._cache
    samples: dict[str, list[float]] = {
        "miss": [],
        "lookup alone": [],
        "encode, no cache": [],
        "encode, right after a miss": [],
    }

    def miss() -> None:
        pool.encode([image(224)])

    def lookup_alone() -> None:
        cache.abandon(cache.lookup(pool._checked([image(224)], False)))

    def encode_no_cache() -> None:
        pool._encode([image(224)], None, False, None)

    try:
        pool.encode([image(224), image(448)])  # warm-up
        for turn in range(args.warmup + args.runs):
            for label, call in (
                ("miss", miss),
                ("lookup alone", lookup_alone),
                ("encode, no cache", encode_no_cache),
                (None, miss),  # untimed: its actor publishes right after its reply ...
                ("encode, right after a miss", encode_no_cache),  # ... where this call meets it
            ):
                start = time.perf_counter()
                call()
                if turn >= args.warmup and label is not None:
                    samples[label].append((time.perf_counter() - start) * 1e3)
        results = {
            "gpu": torch.cuda.get_device_name(),
            "args": {k: str(v) for k, v in vars(args).items()},
            **{label: summarize(values) for label, values in samples.items()},
            "stats": pool.stats().summary(),
        }
    finally:
        pool.shutdown()
    print(json.dumps(results, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
