"""Latency of one call through the pool against the same encode in-process, same weights, same run.

The real-size Qwen3-VL-8B vision tower (random bf16 weights, saved once so that the pool's actor
and this process load the same ones) on one GPU. Both paths start from the processor's output
(float32 pixels on the host):
- in-process: GraphEncoder.encode, results on the GPU, synchronised (the issue's baseline);
- in-process to host: the same with output_device="cpu" (results where the pool returns them);
- pool: EncoderPool.encode with one actor, results on the caller's host as Embeddings; the
  actor is on the caller's node, so batches take the same-node channel (shared memory);
- pool through Ray: the same with same_node_channel=False (pixels and embeddings in Ray's object
  store), a second pool whose actor shares the GPU;
- pool, no polling: the channel with channel_spin_s=0 (callers and actor sleep until the
  message comes; the default polls briefly), a third pool on the same GPU.
Runs alternate between the paths so that drift hits all of them alike (or, with --block N,
blocks of N runs alternate).

    python benchmarks/pool_latency.py [--runs 100] [--warmup 20] [--out pool_latency.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import ray
import torch
from common import image, once_ms, save_random_tower, summarize, video

from vitpool import EncoderPool, GraphEncoder

WORKLOADS = {
    "1x224": lambda: [image(224)],
    "4x224": lambda: [image(224) for _ in range(4)],
    "1x448": lambda: [image(448)],
    "video 8x224": lambda: [video(8, 224)],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="consecutive runs per path before the next path (1: alternate run by run). Every switch "
        "between paths also switches the GPU between processes' contexts",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    gpu = torch.cuda.get_device_name()

    directory = save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-"))
    encoder = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    share = {"num_gpus": 0.3}
    pool = EncoderPool.launch(model=str(directory), num_actors=1, dtype="bfloat16", actor_options=share)
    pool_ray = EncoderPool.launch(
        model=str(directory),
        num_actors=1,
        dtype="bfloat16",
        actor_options=share,
        name="vitpool-ray",
        same_node_channel=False,
    )
    pool_sleeping = EncoderPool.launch(
        model=str(directory),
        num_actors=1,
        dtype="bfloat16",
        actor_options=share,
        name="vitpool-sleeping",
        channel_spin_s=0.0,
    )
    paths = {
        "in_process": lambda items: encoder.encode(items),
        "in_process_to_host": lambda items: encoder.encode(items, output_device="cpu"),
        "pool": lambda items: pool.encode(items),
        "pool_through_ray": lambda items: pool_ray.encode(items),
        "pool_no_polling": lambda items: pool_sleeping.encode(items),
    }
    results = {
        "gpu": gpu,
        "torch": torch.__version__,
        "ray": ray.__version__,
        "runs": args.runs,
        "block": args.block,
        "workloads": {},
    }
    for name, build in WORKLOADS.items():
        items = build()
        local, pooled = encoder.encode(items), pool.encode(items)
        max_error = max(
            float((p.tokens.float() - l.tokens.float().cpu()).abs().max()) for p, l in zip(pooled, local)
        )
        samples = {path: [] for path in paths}
        for _ in range(args.warmup):
            for function in paths.values():
                once_ms(lambda function=function, items=items: function(items))
        for _ in range(args.runs // args.block):
            for path, function in paths.items():
                for _ in range(args.block):
                    samples[path].append(once_ms(lambda function=function, items=items: function(items)))
        row = {path: summarize(values) for path, values in samples.items()}
        pixels = [it.pixel_values.numpy() for it in items]
        row["ray_put_pixels"] = summarize(
            [once_ms(lambda pixels=pixels: [ray.put(p) for p in pixels]) for _ in range(args.runs)]
        )
        row["max_abs_diff_pool_through_ray_vs_in_process"] = max(
            float((p.tokens.float() - l.tokens.float().cpu()).abs().max())
            for p, l in zip(pool_ray.encode(items), local)
        )
        row["ratio_pool_vs_in_process"] = row["pool"]["median_ms"] / row["in_process"]["median_ms"]
        row["ratio_pool_vs_in_process_to_host"] = (
            row["pool"]["median_ms"] / row["in_process_to_host"]["median_ms"]
        )
        row["max_abs_diff_pool_vs_in_process"] = max_error
        results["workloads"][name] = row
    actor = ray.get_actor("vitpool-encoder-0", namespace="vitpool")
    results["empty_actor_call"] = summarize(
        [once_ms(lambda: ray.get(actor.info.remote())) for _ in range(args.runs)]
    )
    stats = pool.stats()
    results["pool_stats"] = stats.summary()
    results["pool_through_ray_stats"] = pool_ray.stats().summary()
    pool_ray.shutdown()
    pool_sleeping.shutdown()
    pool.shutdown()

    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(
        f"\nGPU: {gpu}, torch {torch.__version__}, Ray {ray.__version__}; "
        f"{args.runs} runs after {args.warmup} warm-up, in blocks of {args.block}"
    )
    print(f"small actor call round trip: {results['empty_actor_call']['median_ms']:.2f} ms median")
    print(
        "| workload | in-process median (p99) ms | in-process to host | pool median (p99) ms "
        "| pool / in-process | pool / to host | pool through Ray | Ray / in-process | pool, no polling "
        "| no polling / in-process | max |diff| |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, row in results["workloads"].items():
        print(
            f"| {name} | {row['in_process']['median_ms']:.2f} ({row['in_process']['p99_ms']:.2f}) "
            f"| {row['in_process_to_host']['median_ms']:.2f} ({row['in_process_to_host']['p99_ms']:.2f}) "
            f"| {row['pool']['median_ms']:.2f} ({row['pool']['p99_ms']:.2f}) "
            f"| {row['ratio_pool_vs_in_process']:.2f} | {row['ratio_pool_vs_in_process_to_host']:.2f} "
            f"| {row['pool_through_ray']['median_ms']:.2f} ({row['pool_through_ray']['p99_ms']:.2f}) "
            f"| {row['pool_through_ray']['median_ms'] / row['in_process']['median_ms']:.2f} "
            f"| {row['pool_no_polling']['median_ms']:.2f} ({row['pool_no_polling']['p99_ms']:.2f}) "
            f"| {row['pool_no_polling']['median_ms'] / row['in_process']['median_ms']:.2f} "
            f"| {row['max_abs_diff_pool_vs_in_process']:.1e} |"
        )
    print(stats.summary())


if __name__ == "__main__":
    main()
