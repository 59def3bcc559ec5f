"""What vitpool's vLLM gateway adds to an encode, and whether concurrent requests share runs.

The real-size Qwen3-VL-8B vision tower (random bf16 weights) in a pool of one actor on one GPU;
the gateway in this process (its own event loop on a thread), publishing into the pool's store
(`--publish store`, default) or files (`--publish files`, under /dev/shm); vLLM replaced by a
stand-in that answers at once, so "forward" is the gateway's own relaying. Every request carries
distinct PNG images (no entry is reused). Same run, alternating:

- gateway: POST /v1/chat/completions with 8 × 448² images, the client's view (ms), and the
  gateway's phases for the request (receive, process, encode, publish, forward);
- pool.encode: the same 8 images already processed (items), `pool.encode(items)`, and one copy of
  its results on this host (`clone`, the floor of any publishing that copies the bytes once);

then 16 concurrent requests of 1–4 images each, several rounds: items per batch on the actor,
against the items per request.

    python benchmarks/gateway_cost.py [--runs 30] [--warmup 5] [--publish store] [--format png]
        [--max-bytes B] [--out F]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import logging
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import ray
import torch
from common import save_random_tower, summarize

from vitpool import EncoderPool, Image

SIDE = 448


FORMAT = "png"


def pngs(count: int, seed: int, side: int = SIDE) -> list[bytes]:
    """Distinct pictures: uniform noise as PNG (the most bytes a picture of this size carries), or
    with --format jpeg a photo-like one (smooth gradients and mild noise) as JPEG, quality 90."""
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        buffer = io.BytesIO()
        if FORMAT == "png":
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            PILImage.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
        else:
            ramp = np.linspace(0, 1, side)
            base = np.stack(
                [np.outer(ramp, ramp), np.outer(ramp[::-1], ramp), np.outer(ramp, ramp[::-1])], -1
            )
            pixels = np.clip(base * rng.uniform(120, 255, 3) + rng.normal(0, 6, (side, side, 3)), 0, 255)
            PILImage.fromarray(pixels.astype(np.uint8)).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def make_item(picture) -> Image:
    out = PROCESSOR(images=picture, return_tensors="pt")
    return Image(out["pixel_values"], out["image_grid_thw"][0])


PROCESSOR = None


def chat_body(images: list[bytes]) -> bytes:
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()}}
        for d in images
    ]
    parts.append({"type": "text", "text": "describe"})
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 1}
    ).encode()


def serve(app, port_holder: list[int]) -> asyncio.AbstractEventLoop:
    from aiohttp import web

    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port_holder.append(site._server.sockets[0].getsockname()[1])
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(30)
    return loop


def stand_in_vllm():
    from aiohttp import web

    async def completions(request):
        await request.read()
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    app = web.Application(client_max_size=256 << 20)
    app.router.add_post("/v1/chat/completions", completions)
    return app


def post(url: str, body: bytes) -> float:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
        assert response.status == 200
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    global PROCESSOR, FORMAT
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--publish", choices=("store", "files"), default="store")
    parser.add_argument("--concurrent-rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="the shipped tiny tower (a CPU smoke run)")
    parser.add_argument("--format", choices=("png", "jpeg"), default="png")
    parser.add_argument(
        "--max-bytes",
        type=float,
        default=32 << 30,
        help="the publisher's bound: past it entries are evicted and their memory reused "
        "(default 32 GiB: a run never reaches it, so every entry takes fresh memory)",
    )
    args = parser.parse_args()
    FORMAT = args.format
    logging.basicConfig(level=logging.WARNING)
    from transformers import Qwen2VLImageProcessorPil

    from vitpool.integrations.vllm.gateway import Gateway
    from vitpool.integrations.vllm.publisher import FilePublisher
    from vitpool.integrations.vllm.store import StorePublisher

    PROCESSOR = Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if args.tiny:
        from vitpool.models.loading import SHIPPED_CHECKPOINT as directory
    else:
        directory = save_random_tower(tempfile.mkdtemp(prefix="vitpool-gateway-"))
    on_gpu = torch.cuda.is_available()
    pool = EncoderPool.launch(
        model=str(directory),
        num_actors=1,
        dtype="bfloat16" if on_gpu else "float32",
        device="cuda" if on_gpu else "cpu",
    )
    max_bytes = int(args.max_bytes)
    publisher = (
        StorePublisher(pool.name, max_bytes=max_bytes, min_age_s=0.0)
        if args.publish == "store"
        else FilePublisher(tempfile.mkdtemp(prefix="ec-", dir="/dev/shm"), max_bytes=max_bytes, min_age_s=0.0)
    )
    scratch = [publisher.root] if args.publish == "files" else []
    if not args.tiny:
        scratch.append(Path(directory))
    upstream_port: list[int] = []
    serve(stand_in_vllm(), upstream_port)
    gateway = Gateway(
        pool,
        publisher,
        directory,
        f"http://127.0.0.1:{upstream_port[0]}",
        dtype=torch.bfloat16,
        make_item=make_item,
    )
    gateway_port: list[int] = []
    serve(gateway.app(), gateway_port)
    url = f"http://127.0.0.1:{gateway_port[0]}/v1/chat/completions"

    from PIL import Image as PILImage

    total = args.runs + args.warmup
    requests = [pngs(args.images, seed) for seed in range(total)]
    bodies = [chat_body(images) for images in requests]
    item_sets = [
        [make_item(PILImage.open(io.BytesIO(d)).convert("RGB")) for d in images] for images in requests
    ]
    print(
        f"{gpu}: {args.images} x {SIDE}² per request, publish={args.publish}, {args.format}, "
        f"body {len(bodies[0]) / 1e6:.1f} MB",
        flush=True,
    )

    gateway_ms, encode_ms, process_ms, copy_ms = [], [], [], []
    phases = {name: [] for name in ("receive", "process", "encode", "publish", "forward")}
    for run in range(total):
        before = dict(vars(gateway.stats.phases))
        elapsed = post(url, bodies[run])
        after = vars(gateway.stats.phases)
        start = time.perf_counter()
        results = pool.encode(item_sets[run])
        encoded = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        copies = [tensor.clone() for result in results for tensor in result.outputs]
        copied = (time.perf_counter() - start) * 1e3
        del copies, results
        start = time.perf_counter()
        [make_item(PILImage.open(io.BytesIO(d)).convert("RGB")) for d in requests[run]]
        processed = (time.perf_counter() - start) * 1e3
        if run >= args.warmup:
            gateway_ms.append(elapsed)
            encode_ms.append(encoded)
            process_ms.append(processed)
            copy_ms.append(copied)
            for name, values in phases.items():
                values.append((after[name] - before[name]) * 1e3)
    assert gateway.stats.fallbacks == 0, gateway.stats

    # 16 concurrent requests of 1-4 images: do images of different requests share the actor's runs?
    rng = np.random.default_rng(1)
    rounds = []
    for round_index in range(args.concurrent_rounds):
        counts = [int(c) for c in rng.integers(1, 5, 16)]
        batch_bodies = [chat_body(pngs(c, 1000 * (round_index + 1) + i)) for i, c in enumerate(counts)]
        stats_before = pool.stats()
        threads = [threading.Thread(target=post, args=(url, body)) for body in batch_bodies]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = (time.perf_counter() - start) * 1e3
        stats_after = pool.stats()
        batches = sum(a.batches for a in stats_after.actors) - sum(a.batches for a in stats_before.actors)
        items = sum(a.items for a in stats_after.actors) - sum(a.items for a in stats_before.actors)
        rounds.append(
            {
                "requests": 16,
                "images": sum(counts),
                "batches": batches,
                "items": items,
                "items_per_batch": items / max(batches, 1),
                "wall_ms": elapsed,
            }
        )

    result = {
        "gpu": gpu,
        "images_per_request": args.images,
        "side": SIDE,
        "publish": args.publish,
        "format": args.format,
        "max_bytes": max_bytes,
        "runs": args.runs,
        "gateway_ms": summarize(gateway_ms),
        "pool_encode_ms": summarize(encode_ms),
        "process_in_process_ms": summarize(process_ms),
        "one_copy_of_the_embeddings_ms": summarize(copy_ms),
        "gateway_phases_ms": {name: summarize(values) for name, values in phases.items()},
        "publish_and_forward_over_encode": statistics.median(
            [(p + f) / e for p, f, e in zip(phases["publish"], phases["forward"], encode_ms)]
        ),
        "concurrent_rounds": rounds,
        "gateway_stats": json.loads(json.dumps(vars(gateway.stats), default=vars)),
    }
    print(json.dumps(result, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    pool.shutdown()
    ray.shutdown()
    for path in scratch:  # up to GBs of entries in /dev/shm, and the tower's weights
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
