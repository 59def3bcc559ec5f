"""The settings of the vLLM gateway and the Dynamo backend, each defined once: a pool the gateway
launches takes `vitpool serve`'s flags (made from `PoolSettings`' fields), refused where it
connects to a running pool; what the gateway and the backend share (the pool's name, the LLM's
dtype, the timeout) is one table (`images.FRONT_SETTINGS`), the gateway's flags and the backend's
VITPOOL_ variables."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from vitpool.errors import ConfigError
from vitpool.integrations.vllm import images
from vitpool.pool import EncoderPool
from vitpool.pool.settings import PoolSettings, setting_flag


def gateway_main(args: list[str], monkeypatch) -> dict:
    """The gateway's main as far as its pool: what EncoderPool.launch got (stops there)."""
    from vitpool.integrations.vllm import gateway_cli

    launched: dict = {}

    def launch(cls, model, **options):
        launched.update(options, model=model)
        raise ConnectionError("stop here")

    monkeypatch.setattr(EncoderPool, "launch", classmethod(launch))
    monkeypatch.setattr(images, "processor_backend", lambda: "pil")
    monkeypatch.setattr(gateway_cli, "processor_backend", lambda: "pil")
    with pytest.raises(SystemExit, match="stop here"):
        gateway_cli.main(["--model", "/models/m", "--upstream", "http://127.0.0.1:1", *args])
    return launched


def test_a_launched_pool_takes_the_serve_flags(monkeypatch):
    launched = gateway_main(
        [
            "--launch-actors",
            "2",
            "--budgets",
            "16,64",
            "--device",
            "cpu",
            "--warm-standby",
            "off",
            "--small-first-tokens",
            "none",
            "--dtype",
            "float32",
        ],
        monkeypatch,
    )
    assert launched == {
        "model": "/models/m",
        "num_actors": 2,
        "name": "vitpool",
        "address": None,
        "dtype": "float32",  # the LLM's, the pool's too
        "budgets": [16, 64],
        "device": "cpu",
        "warm_standby": False,
        "small_first_tokens": None,
    }
    settings = {k: v for k, v in launched.items() if k not in ("num_actors", "name", "address")}
    PoolSettings(**settings)  # what the pool takes


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--budgets", "16,16"], "argument --budgets: budgets has duplicates"),  # the pool's own check
        (["--device", "cuda:1"], "argument --device: invalid choice: 'cuda:1'"),
        (
            ["--small-first-stream", "on"],
            "--small-first-stream was removed after vitpool 0.1.0: use --urgent-tokens",
        ),
        (
            ["--budgets", "16,64"],
            "--budgets: pool settings are for a pool the gateway launches (--launch-actors N)",
        ),
        (["--detached", "on"], "unrecognized arguments: --detached"),  # the gateway's pool stops with it
    ],
)
def test_bad_or_misplaced_setting_flags_are_refused_before_any_pool(flags, words, monkeypatch, capsys):
    from vitpool.integrations.vllm import gateway_cli

    monkeypatch.setattr(EncoderPool, "launch", classmethod(lambda *a, **k: pytest.fail("launched")))
    monkeypatch.setattr(EncoderPool, "connect", classmethod(lambda *a, **k: pytest.fail("connected")))
    with pytest.raises(SystemExit) as exit_info:
        gateway_cli.main(["--model", "/models/m", "--upstream", "http://127.0.0.1:1", *flags])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_the_gateways_own_flags_are_the_shared_settings():
    assert [setting_flag(name) for name in images.FRONT_SETTINGS] == ["--pool", "--dtype", "--timeout"]


def test_the_dynamo_backend_reads_the_same_settings_under_one_prefix(monkeypatch):
    interface = types.ModuleType("dynamo.vllm.multimodal_utils.custom_encoder")  # ai-dynamo's, where absent
    interface.Preprocessed = interface.Qwen3VLImageEncoding = object
    interface.VisionEncoderBackend = type("VisionEncoderBackend", (), {})
    monkeypatch.setitem(sys.modules, interface.__name__, interface)
    monkeypatch.delitem(sys.modules, "vitpool.integrations.dynamo", raising=False)
    from vitpool.integrations import dynamo

    for name in ("VITPOOL_POOL", "VITPOOL_DTYPE", "VITPOOL_TIMEOUT_S", "VITPOOL_ALLOWED_LOCAL_MEDIA_PATH"):
        monkeypatch.delenv(name, raising=False)
    backend = dynamo.VitpoolEncoderBackend(pool=object())
    assert (backend.dtype, backend.timeout_s, backend.allowed_local_path) == (torch.bfloat16, 60.0, None)
    assert images.front_setting("pool") == "vitpool"
    monkeypatch.setenv("VITPOOL_POOL", "svc")
    monkeypatch.setenv("VITPOOL_DTYPE", "float32")
    monkeypatch.setenv("VITPOOL_TIMEOUT_S", "5")
    monkeypatch.setenv("VITPOOL_ALLOWED_LOCAL_MEDIA_PATH", "/data")
    backend = dynamo.VitpoolEncoderBackend(pool=object())
    assert (backend.dtype, backend.timeout_s, backend.allowed_local_path) == (torch.float32, 5.0, "/data")
    assert images.front_setting("pool") == "svc"
    monkeypatch.setenv("VITPOOL_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="VITPOOL_TIMEOUT_S='soon': give a number"):
        dynamo.VitpoolEncoderBackend(pool=object())
