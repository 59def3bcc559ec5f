"""Helpers of the tests against a real vLLM: free ports, JSON over HTTP, a vLLM server in a
subprocess, a gateway served from a thread of the test process."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).parents[2]
VLLM_PYTHON = Path(os.environ.get("VITPOOL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post_json(url: str, body: dict, timeout_s: float = 120.0) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def get_json(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.load(response)


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` of the tiny model, as an encoder-cache consumer."""

    def __init__(self, model: Path, ec_config: dict, log: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--max-model-len",
            "1024",
            "--dtype",
            "float32",
            "--limit-mm-per-prompt",
            json.dumps({"image": 4, "video": 0}),
            "--max-num-seqs",
            "8",
            "--ec-transfer-config",
            json.dumps(ec_config),
        ]
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115 - the server writes to it until stop()
        self.process = subprocess.Popen(
            command,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **env},
        )

    def wait_ready(self, timeout_s: float = 400.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited ({self.process.returncode}):\n{self.log.read_text()[-4000:]}"
                )
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(1.0)
        raise TimeoutError(f"vLLM did not start in {timeout_s} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log_file.close()


class RunningGateway:
    """A gateway served on its own event loop in a thread of this process."""

    def __init__(self, gateway) -> None:
        from aiohttp import web

        self.gateway = gateway
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(gateway.app())
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
