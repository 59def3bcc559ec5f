"""The gateway's pixels are vLLM's: it makes items with the image processor class vLLM makes for the
checkpoint (transformers' torchvision backend: vLLM depends on torchvision), and where torchvision
does not import it says once which processor it uses and how far answers may then differ."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

from vitpool import ConfigError
from vitpool.integrations.vllm import images

ROOT = Path(__file__).parents[2]
VLLM_PYTHON = Path(os.environ.get("VITPOOL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
QWEN3_VL_PROCESSOR = {  # the tiny Qwen3-VL's of tests/vllm (Qwen3-VL's own, but for the pixel range)
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5] * 3,
    "image_std": [0.5] * 3,
    "size": {"shortest_edge": 1024, "longest_edge": 65536},
}
# what vLLM's processor makes for it (AutoProcessor, no backend asked; torchvision imports there)
VLLM_CLASS = "Qwen2VLImageProcessor"


def has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a build for another torch fails with RuntimeError
        return False
    return True


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl"}')
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PROCESSOR))
    return tmp_path


@pytest.fixture
def fresh_backend():
    images.processor_backend.cache_clear()  # it answers once per process
    yield
    images.processor_backend.cache_clear()


def picture(height: int, width: int):
    from PIL import Image as PILImage

    rng = np.random.default_rng(height * 1000 + width)
    return PILImage.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.skipif(
    not has_torchvision(), reason="torchvision does not import here (the warning case is below)"
)
def test_the_gateway_makes_vllms_processor_class_and_its_pixels(checkpoint, fresh_backend):
    from transformers import AutoImageProcessor

    processor = images.image_processor(checkpoint)
    vllms = AutoImageProcessor.from_pretrained(checkpoint)  # as vLLM's AutoProcessor makes it
    assert type(processor).__name__ == type(vllms).__name__ == VLLM_CLASS
    make_item = images.processor_items(checkpoint, "qwen3_vl")
    for height, width in [(50, 77), (37, 61), (64, 96)]:  # resized (shrunk), enlarged, taken as it is
        item = make_item(picture(height, width))
        assert torch.equal(
            item.pixel_values, vllms(images=picture(height, width), return_tensors="pt")["pixel_values"]
        )


def test_without_torchvision_the_pil_processor_is_used_and_said_once(
    checkpoint, fresh_backend, monkeypatch, caplog
):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` raises ImportError
    with caplog.at_level(logging.WARNING, logger=images.__name__):
        first = images.image_processor(checkpoint)
        images.processor_items(checkpoint, "qwen3_vl")
    assert type(first).__name__ == VLLM_CLASS + "Pil"
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "PIL image processor, not the torchvision one vLLM runs" in warnings[0]
    assert (
        images.PIL_PROCESSOR_BOUND in warnings[0]
        and "Install the torchvision built for this torch" in warnings[0]
    )


def test_a_torchvision_that_cannot_load_stops_the_gateway_in_one_line(
    fresh_backend, monkeypatch, tmp_path, capsys
):
    def failing_import(name, *args, **kwargs):
        if name == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real_import(name, *args, **kwargs)

    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", failing_import)
    with pytest.raises(
        ConfigError, match="torchvision .* is installed but does not load beside torch"
    ) as raised:
        images.processor_backend()
    assert "nms does not exist" in str(raised.value) and "uninstall torchvision" in str(raised.value)
    from vitpool.integrations.vllm import gateway_cli

    monkeypatch.setattr(
        "vitpool.pool.EncoderPool.connect", lambda *a, **k: pytest.fail("no pool before the check")
    )
    with pytest.raises(SystemExit, match="^vitpool gateway: torchvision"):
        gateway_cli.main(["--model", str(tmp_path), "--upstream", "http://127.0.0.1:1"])


def test_keys_of_the_two_backends_differ():
    """Their pixels differ after a resize: one's entries must not answer the other's requests."""
    identity = [
        images.model_prefix(ROOT / "nowhere", torch.bfloat16, name) for name in ("torchvision", "pil")
    ]
    assert identity[0] != identity[1]


def test_the_vllm_extra_installs_torchvision():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("torchvision") for requirement in extras["vllm"])


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON}")
def test_vllm_makes_the_torchvision_processor(checkpoint):
    """What the gateway takes for vLLM's choice, asked of vLLM's environment: the processor that
    vLLM's `get_processor` loads (AutoProcessor, whose image processor is AutoImageProcessor's with
    no backend asked) is the torchvision one."""
    script = (
        "import sys; from transformers import AutoImageProcessor; "
        "print(type(AutoImageProcessor.from_pretrained(sys.argv[1])).__name__)"
    )
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", script, str(checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == VLLM_CLASS and images.VLLM_PROCESSOR_BACKEND == "torchvision"
