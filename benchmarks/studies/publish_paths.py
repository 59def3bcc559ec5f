"""Ways to put a request's pool results where vLLM's processes can read them, against `pool.encode`.

The real-size Qwen3-VL-8B vision tower (random bf16 weights), a pool of one actor on one GPU,
8 × 448² images a call (784 patches, 196 tokens each; an Embedding of tokens and three deepstack
layers is 6.4 MB in bf16, 51 MB a call). Alternating in one run, per call (ms):

- encode: `pool.encode(items)` (results through the same-node channel), the baseline;
- encode + put each: then one `ray.put` per Embedding, in turn (the gateway's store path);
- encode + put threads: the puts on a thread each;
- encode + put one: one `ray.put` of the call's list;
- encode_refs: `pool.encode_refs(items)`, results left in the object store by the actor's call.

    python benchmarks/studies/publish_paths.py [--runs 30] [--warmup 5] [--images 8] [--out F]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import ray
import torch
from common import image, save_random_tower, summarize

from vitpool import EncoderPool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    gpu = torch.cuda.get_device_name()
    directory = save_random_tower(tempfile.mkdtemp(prefix="vitpool-publish-"))
    pool = EncoderPool.launch(model=str(directory), num_actors=1, dtype="bfloat16", device="cuda")
    threads = ThreadPoolExecutor(args.images)

    def encode(items):
        return pool.encode(items)

    def put_each(items):
        return [ray.put(e) for e in pool.encode(items)]

    def put_threads(items):
        return list(threads.map(ray.put, pool.encode(items)))

    def put_one(items):
        return ray.put(pool.encode(items))

    def refs(items):
        return pool.encode_refs(items)

    ways = {
        "encode": encode,
        "encode + put each": put_each,
        "encode + put threads": put_threads,
        "encode + put one": put_one,
        "encode_refs": refs,
    }
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for run in range(args.warmup + args.runs):
        for name, way in ways.items():
            items = [image(448) for _ in range(args.images)]
            start = time.perf_counter()
            kept = way(items)
            elapsed = (time.perf_counter() - start) * 1e3
            del kept
            if run >= args.warmup:
                samples[name].append(elapsed)
    result = {
        "gpu": gpu,
        "images": args.images,
        "side": 448,
        "runs": args.runs,
        "ms": {name: summarize(values) for name, values in samples.items()},
    }
    print(json.dumps(result, indent=1))
    for name, values in result["ms"].items():
        print(f"{gpu}: {name:24s} median {values['median_ms']:7.2f} ms  p99 {values['p99_ms']:7.2f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    pool.shutdown()


if __name__ == "__main__":
    main()
