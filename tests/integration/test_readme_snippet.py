"""The README's processor-to-pool snippet runs as written: a PIL image through Qwen3-VL's image
processor into `vitpool.Image`, encoded by a local pool on the shipped tiny model."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("PIL")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from conftest import ray_env
from test_processor_items import readme_snippet

ROOT = Path(__file__).resolve().parents[2]
RAY_ENV = ray_env()  # a fresh local cluster: no address, and no cluster started elsewhere is seen


@pytest.mark.ray
def test_readme_snippet_encodes_a_pil_image_in_a_pool():
    result = subprocess.run(
        [sys.executable, "-c", readme_snippet()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=RAY_ENV,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "(300, 128) 2"


@pytest.mark.ray
def test_the_readme_first_encode_runs_as_written():
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- first encode -->", 1)[1].lstrip("\n")
    assert block.startswith("```python\n")
    code = block.removeprefix("```python\n").split("\n```", 1)[0]
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=RAY_ENV,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "(64, 128)"
