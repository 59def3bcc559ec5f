"""The README's "vitpool as vLLM's encoder", followed as a user would, with the gateway from an
environment of its own (e.g. a fresh `pip install -e ".[vllm]" torch==2.13.0`): vLLM with the
connector, the gateway launching its pool, one dtype on both sides; then images vLLM resizes and
images it does not, each through the gateway and straight to vLLM (its own tower), and the largest
logprob difference of each kind against the bound the README states for the gateway's processor.

    python tests/vllm/readme_walk.py --gateway-python /tmp/fresh/bin/python
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_fixtures import build_tiny_model
from vllm_requests import answer, chat, largest_difference, png
from vllm_servers import VllmServer, free_port

BOUNDS = {"torchvision": 1e-4, "pil": 5e-3}  # README, "The same pixels"; images not resized: 1e-4


def resized_png(seed: int, height: int, width: int) -> bytes:
    """A random picture whose sides are not multiples of the merged token: the processors resize it."""
    import io

    import numpy as np
    from PIL import Image as PILImage

    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    PILImage.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def start_gateway(python: str, model: Path, upstream: str, address: str, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [
            python,
            "-m",
            "vitpool.integrations.vllm.gateway",
            "--model",
            str(model),
            "--upstream",
            upstream,
            "--launch-actors",
            "1",
            "--pool",
            "walk",
            "--address",
            address,
            "--publish",
            "store",
            "--dtype",
            "float32",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the gateway exited")
        try:
            urllib.request.urlopen(url + "/vitpool/stats", timeout=2)
            return process, url
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.5)
    process.kill()
    raise TimeoutError("the gateway did not start in 300 s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gateway-python", default=sys.executable)
    args = parser.parse_args()
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    work = Path(tempfile.mkdtemp(prefix="vitpool-walk-"))
    model = build_tiny_model("qwen3_vl", work / "model")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    server = VllmServer(
        model,
        {
            "ec_connector": "VitpoolECConnector",
            "ec_role": "ec_consumer",
            "ec_connector_module_path": "vitpool.integrations.vllm.connector",
            "ec_connector_extra_config": {"pool": "walk", "ray_address": address},
        },
        work / "vllm.log",
        {"RAY_AUTH_MODE": "disabled"},
    )
    gateway = None
    try:
        server.wait_ready()
        with open(work / "gateway.log", "w") as log:
            gateway, url = start_gateway(args.gateway_python, model, server.url, address, log)
            differences: dict[str, list[float]] = {"not resized": [], "resized": []}
            for seed in range(4):
                for kind, picture in (
                    ("not resized", png(seed, 64, 96)),
                    ("resized", resized_png(seed, 50 + 7 * seed, 83 + 5 * seed)),
                ):
                    body = chat([picture])
                    differences[kind].append(
                        largest_difference(answer(url, body, model), answer(server.url, body, model))
                    )
        processor = "pil" if "PIL image processor" in (work / "gateway.log").read_text() else "torchvision"
        stats = urllib.request.urlopen(url + "/vitpool/stats", timeout=10).read().decode()
        print(f"gateway processor: {processor}; gateway stats: {stats}")
        ok = True
        for kind, values in differences.items():
            bound = 1e-4 if kind == "not resized" else BOUNDS[processor]
            ok &= max(values) <= bound
            print(
                f"{kind}: largest logprob difference {max(values):.2e} over {len(values)} images "
                f"(README's bound {bound:g})"
            )
        return 0 if ok else 1
    finally:
        if gateway is not None:
            gateway.kill()
        server.stop()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
