"""The README's main command runs and prints one line per item."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import ray_env, ray_head

ROOT = Path(__file__).resolve().parents[2]
RAY_ENV = ray_env()  # no cluster runs where these look (tests/conftest.py): each starts its own
# Ray's temp directory of a cluster started as the README's service section has the user start one
OTHER_CLUSTER_ROOT = Path(os.environ["RAY_TMPDIR"]) / "other"


@pytest.fixture(scope="module")
def other_cluster_env():
    """The environment of a process on a machine where `ray start --head` runs a cluster (one
    CPU, no GPU): ray.init() without an address would join it."""
    with ray_head(OTHER_CLUSTER_ROOT, "--num-cpus=1", "--num-gpus=0"):
        yield ray_env(OTHER_CLUSTER_ROOT)


def run_example(name: str, *args: str, env: dict | None = None) -> list[str]:
    """Run examples/<name> and return its stdout's lines; a failure shows the end of its stderr.

    A failed run is run once more, with a warning that carries its stderr: each run starts a Ray
    cluster of its own, and one run of `tp_llm.py` failed once in a fresh-clone CI run while it
    passed on its own and in five runs beside a busy CPU (its stderr was not kept then)."""
    for attempt in (1, 2):
        result = subprocess.run(
            [sys.executable, str(ROOT / "examples" / name), *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            check=False,
        )
        if result.returncode == 0:
            return result.stdout.strip().splitlines()
        if attempt == 1:
            warnings.warn(
                f"{name} exited with {result.returncode}; running it again:\n{result.stderr[-4000:]}",
                stacklevel=2,
            )
    raise AssertionError(f"{name} exited with {result.returncode} twice:\n{result.stderr[-4000:]}")


def test_encode_example_runs():
    lines = run_example("encode.py", "--device", "cpu")
    assert [line.split()[0] for line in lines[:4]] == ["Image", "Image", "Video", "Image"]
    assert "tokens (196, 128)" in lines[2]  # 4 x 14 x 14 patches / 4
    assert lines[-1].startswith("graph items 0, eager items 4")


def test_quickstart_runs_a_pool_and_stops_it():
    lines = run_example("quickstart.py", "--threads", "3", env=RAY_ENV)
    item_lines = [line for line in lines if line.startswith("caller ")]
    assert len(item_lines) == 9  # 3 callers x 3 items
    assert sum("Video grid (4, 14, 14): tokens (196, 128)" in line for line in item_lines) == 3
    assert "9 items" in next(line for line in lines if line.startswith("pool 'quickstart'"))


def test_tp_llm_example_delivers_one_encode_to_both_ranks(other_cluster_env):
    # beside a running cluster: on the CPU the example starts its own (fake GPUs), joining none
    lines = run_example("tp_llm.py", "--new-tokens", "6", env=other_cluster_env)
    assert "delivering through gloo from encoder actor 0" in lines  # Ray Direct Transport between CPU actors
    assert any(line.startswith("both ranks received identical embeddings") for line in lines)
    generated = next(line for line in lines if line.startswith("both ranks generated the same 6 tokens"))
    assert len(generated.split(":")[1].strip("[] ").split(",")) == 6
