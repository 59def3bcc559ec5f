"""How soon a freshly started vLLM gateway answers its first chat request (issue 54), without vLLM.

A local Ray cluster with a CPU pool of a tiny random Qwen3-VL (one actor, warm) and its store, and a
stand-in for vLLM's OpenAI server that answers at once; then, run after run, a gateway process
(`python -m vitpool.integrations.vllm.gateway --publish store`, as tests/vllm starts it) is started
against them and sent one chat request with an image it has not seen, as soon as its port takes
connections (polled every 20 ms). Per start: seconds from `Popen` to the answer, and to the
gateway's "gateway ready" log line; the answer must be the stand-in's and the gateway's counters
must show the image encoded by the pool (not left to vLLM). Trees alternate run by run, so that
they share the machine's state: this checkout ("after") and, with --before, another checkout of
vitpool (`git worktree add /tmp/gw_before <commit>`), run from its own directory.

    python benchmarks/studies/gateway_start.py [--runs 7] [--before /tmp/gw_before] [--model DIR]
        [--out results.json]

Run it with the python whose packages the gateway is measured under (tests/vllm's: `.venv-vllm`,
which has torchvision, so the gateway runs the torchvision image processor as vLLM does).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("gateway_start")

ROOT = Path(__file__).resolve().parents[2]
POOL = "gateway-start"
STAND_IN_ANSWER = {"id": "stand-in", "choices": [{"message": {"role": "assistant", "content": "ok"}}]}
READY_LINE = re.compile(r"gateway ready (\d+\.\d+) s after its process started")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def png_url(seed: int, side: int = 64) -> str:
    """A random picture the processor takes as it is (sides a multiple of Qwen3-VL's 32 pixels)."""
    from PIL import Image as PILImage

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PILImage.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_body(seed: int) -> bytes:
    image = {"type": "image_url", "image_url": {"url": png_url(seed)}}
    content = [image, {"type": "text", "text": "describe"}]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def start_stand_in() -> str:
    """vLLM's OpenAI server stood in for on a thread of this process: every request answered at once."""
    import asyncio

    from aiohttp import web

    port = free_port()
    started = threading.Event()

    async def answer(_request: web.Request) -> web.Response:
        return web.json_response(STAND_IN_ANSWER)

    async def serve() -> None:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        started.set()
        await asyncio.Event().wait()

    threading.Thread(target=lambda: asyncio.run(serve()), daemon=True, name="stand-in-vllm").start()
    started.wait(30)
    return f"http://127.0.0.1:{port}"


def post(url: str, body: bytes, timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def one_start(tree: Path, model: Path, upstream: str, address: str, seed: int, log: Path) -> dict[str, float]:
    """Start a gateway from `tree`, send it one chat request as soon as it listens, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    environment = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "vitpool.integrations.vllm.gateway", "--model", str(model)]
    command += ["--upstream", upstream, "--pool", POOL, "--address", address, "--publish", "store"]
    command += ["--dtype", "float32", "--port", str(port)]
    body = chat_body(seed)
    with open(log, "w") as out:
        popen = time.monotonic()
        process = subprocess.Popen(command, cwd=tree, stdout=out, stderr=subprocess.STDOUT, env=environment)
        try:
            deadline = popen + 120
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the gateway exited ({process.returncode}); see {log}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer in 120 s; see {log}")
                try:
                    answer = post(url + "/v1/chat/completions", body, timeout_s=60)
                    break
                except (urllib.error.URLError, ConnectionError) as error:
                    if isinstance(error, urllib.error.HTTPError):
                        raise
                    time.sleep(0.02)
            answered = time.monotonic() - popen
            with urllib.request.urlopen(url + "/vitpool/stats", timeout=10) as response:
                stats = json.loads(response.read())["gateway"]
        finally:
            process.kill()  # the gateway this run started, by its own handle
            process.wait(30)
    if answer != STAND_IN_ANSWER:
        raise AssertionError(f"the gateway relayed {answer!r}, not the stand-in's answer")
    if (stats["encoded"], stats["fallbacks"]) != (1, 0):
        raise AssertionError(f"the image was not encoded by the pool: {stats}")
    ready = READY_LINE.search(log.read_text())
    return {"answered_s": answered, "ready_s": float(ready.group(1)) if ready else float("nan")}


def tiny_model(directory: Path) -> Path:
    builder = ROOT / "tests" / "vllm" / "tiny_models.py"
    command = [sys.executable, str(builder), "qwen3_vl", str(directory)]
    subprocess.run(command, check=True, capture_output=True)
    return directory


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=7, help="fresh gateway processes per tree")
    parser.add_argument("--before", type=Path, help="another vitpool checkout, measured alternately")
    parser.add_argument("--model", type=Path, help="a Qwen3-VL checkpoint (default: a tiny random one)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 turns on token auth for new local clusters
    import ray

    from vitpool import EncoderPool

    work = Path(tempfile.mkdtemp(prefix="gateway-start-"))
    model = args.model or tiny_model(work / "tiny-qwen3-vl")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    pool = EncoderPool.launch(model=str(model), name=POOL, num_actors=1, device="cpu", budgets=[16, 64, 256])
    upstream = start_stand_in()
    trees = {"after": ROOT} | ({"before": args.before.resolve()} if args.before else {})
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        # one start of each tree first, not counted: the store's actor and the OS's file cache warm
        for index, (name, tree) in enumerate(trees.items()):
            one_start(tree, model, upstream, address, 10_000 + index, work / f"{name}-warm.log")
        for run in range(args.runs):
            order = list(trees.items()) if run % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                seed = run * len(trees) + list(trees).index(name)  # a fresh image each start
                figure = one_start(tree, model, upstream, address, seed, work / f"{name}-{run}.log")
                figures[name].append(figure)
                logger.info("run %d %-6s answered %.2f s, ready %.2f s", run, name, *figure.values())
    finally:
        pool.shutdown()
        ray.shutdown()
    cores = os.cpu_count()
    for name, runs in figures.items():
        logger.info(
            "%-6s (%d starts, %s cores): Popen -> first answer %s; Popen -> 'gateway ready' %s",
            name,
            len(runs),
            cores,
            summary([run["answered_s"] for run in runs]),
            summary([run["ready_s"] for run in runs]),
        )
    if args.out:
        record = {"cores": cores, "python": sys.executable, "figures": figures}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
