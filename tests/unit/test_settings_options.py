"""The encoder's options, one object (`vitpool.encoder_spec.EncoderOptions`): declared, documented and
checked in one place, reached by keyword from `GraphEncoder`, `from_pretrained`, `EncoderSpec`
and `PoolSettings`; and the urgent lane's old pool setting, `small_first_stream`, refused with a
message naming `urgent_tokens`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vitpool import GraphEncoder
from vitpool.encoder_spec import EncoderOptions, EncoderSpec
from vitpool.errors import ConfigError
from vitpool.pool import encoder_pool
from vitpool.pool.encoder_pool import EncoderPool
from vitpool.pool.settings import PoolSettings

OPTION_NAMES = [field.name for field in dataclasses.fields(EncoderOptions)]


def test_the_options_are_declared_once():
    # the spec and the pool's settings inherit them: neither writes one out again
    for settings_class in (EncoderSpec, PoolSettings):
        own = set(vars(settings_class).get("__annotations__", {}))
        assert own.isdisjoint(OPTION_NAMES), own & set(OPTION_NAMES)
        assert {field.name for field in dataclasses.fields(settings_class)} >= set(OPTION_NAMES)


def test_the_pools_encoder_spec_carries_every_option_by_name():
    chosen = {
        "budgets": (16, 64),
        "max_items_per_batch": 4,
        "max_frames_per_batch": 8,
        "capacity_limits": {"sequences": 8},
        "device": "cpu",
        "dtype": "float32",
        "attention": "fa2",
        "fused_ops": False,
        "compiled_blocks": True,
        "compile_cache_dir": "/tmp/inductor",
        "urgent_tokens": 16,
        "precision": "bf16",
        "max_item_tokens": 4096,
    }
    assert set(chosen) == set(OPTION_NAMES)  # a new option gets a value here too
    spec = PoolSettings(model="/models/m", **chosen).encoder_spec()
    assert spec == EncoderSpec(model="/models/m", **chosen)
    assert spec.options() == EncoderOptions(**chosen)


# (option, a bad value, words of the ConfigError): each refused by the options object itself, so
# alike from an encoder, a spec and a pool's settings
BAD_OPTIONS = [
    ("budgets", [16, 0], "positive integers"),
    ("budgets", [], "empty"),
    ("max_items_per_batch", 0, ">= 1"),
    ("max_frames_per_batch", 0, "max_frames_per_batch must be a positive integer"),
    ("capacity_limits", {"windows": 0}, r"capacity_limits\['windows'\] must be a positive integer"),
    ("dtype", "int8", "not supported"),
    ("attention", "fa3", "attention 'fa3' is not one of"),
    ("precision", "int8", "precision 'int8' is not one of"),
    ("fused_ops", "yes", "fused_ops must be True or False"),
    ("compiled_blocks", 1, "compiled_blocks must be True or False"),
    ("urgent_tokens", 0, "urgent_tokens must be a positive number"),
    ("urgent_tokens", True, "urgent_tokens must be a positive number"),  # an int to Python, a mistake here
    ("max_item_tokens", 2.5, "max_item_tokens must be a positive number of output tokens"),
]


@pytest.mark.parametrize(("name", "value", "words"), BAD_OPTIONS)
def test_a_bad_option_is_refused_alike_everywhere(tiny_adapter, name, value, words):
    makers = [
        lambda: EncoderOptions(**{name: value}),
        lambda: EncoderSpec(**{name: value}),
        lambda: PoolSettings(**{name: value}),
        lambda: GraphEncoder(tiny_adapter, **{"budgets": [16], "device": "cpu", name: value}),
    ]
    for make in makers:
        with pytest.raises(ConfigError, match=words):
            make()


def test_fp8_with_compiled_blocks_is_refused_before_any_device_is_asked():
    with pytest.raises(ConfigError, match="compiled_blocks=False"):
        PoolSettings(precision="fp8", compiled_blocks=True)


def test_the_encoder_takes_its_options_by_name_or_as_the_object(tiny_adapter):
    by_name = GraphEncoder(tiny_adapter, budgets=[16], device=torch.device("cpu"), dtype=torch.float32)
    assert by_name.options == EncoderOptions(budgets=(16,), device="cpu", dtype="float32")  # plain values
    assert by_name.dtype == torch.float32 and by_name.device == torch.device("cpu")
    options = EncoderOptions(budgets=(16, 32), device="cpu", attention="fa2")
    assert GraphEncoder(tiny_adapter, options).options == options
    # names over the object
    mixed = GraphEncoder(tiny_adapter, options, budgets=[32])
    assert mixed.options.budgets == (32,) and mixed.options.attention == "fa2"
    with pytest.raises(TypeError, match="give budgets and the other options by name"):
        GraphEncoder(tiny_adapter, [16, 64])  # budgets were never positional
    with pytest.raises(TypeError, match="no_such_option"):
        GraphEncoder(tiny_adapter, device="cpu", no_such_option=1)


def test_from_spec_builds_the_encoder_the_pool_describes():
    spec = PoolSettings(
        budgets=(16,), device="cpu", dtype="float32", attention="fa2", max_item_tokens=64
    ).encoder_spec()
    encoder = GraphEncoder.from_spec(spec)
    assert encoder.options == spec.options()
    assert encoder.attention == "fa2" and encoder.max_item_tokens == 64


# ---- the urgent lane's old pool setting, removed -----------------------------------------------


def test_small_first_stream_is_refused_naming_urgent_tokens():
    for kwargs in ({"small_first_stream": True}, {"small_first_stream": False, "urgent_tokens": 64}):
        with pytest.raises(ConfigError, match=r"small_first_stream was removed .*: use urgent_tokens=N"):
            PoolSettings(**kwargs)
    with pytest.raises(ConfigError, match="use urgent_tokens=N"):
        dataclasses.replace(PoolSettings(), small_first_stream=True)  # a copy goes through the same door
    assert "small_first_stream" not in {field.name for field in dataclasses.fields(PoolSettings)}


def test_reading_small_first_stream_names_urgent_tokens():
    settings = PoolSettings(urgent_tokens=256)
    with pytest.raises(AttributeError, match="small_first_stream was removed .*: use urgent_tokens=N"):
        settings.small_first_stream  # noqa: B018 - the read is the test
    with pytest.raises(AttributeError, match="has no attribute 'no_such_setting'"):
        settings.no_such_setting  # noqa: B018
    assert not hasattr(settings, "small_first_stream")


def test_launch_refuses_small_first_stream_before_anything_starts(monkeypatch):
    monkeypatch.setattr(encoder_pool, "launch_pool", lambda *args: pytest.fail("launched"))
    with pytest.raises(ConfigError, match="use urgent_tokens=N"):
        EncoderPool.launch(device="cpu", small_first_stream=True, progress=False)
