"""Each setting's rule stated once: one integer check and one True/False check for every option
and pool setting (`vitpool.encoder_spec.check_int`, `check_bool`), one budget check
(`vitpool.encoder_spec.check_budgets`) and one device rule (`vitpool.encoder_spec.check_device`),
which a pool's settings narrow (no "cuda:N", bounded budgets) rather than state again."""

from __future__ import annotations

import pytest

from vitpool.encoder_spec import (
    MAX_BUDGET_TOKENS,
    EncoderOptions,
    EncoderSpec,
    check_bool,
    check_budgets,
    check_device,
    check_int,
)
from vitpool.errors import ConfigError
from vitpool.pool.settings import PoolSettings


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({}, 0, "n must be a positive integer; got 0"),
        ({}, True, "n must be a positive integer; got True"),  # True == 1 in Python: a mistake here
        ({}, 2.0, "n must be a positive integer; got 2.0"),
        ({}, None, "n must be a positive integer; got None"),
        ({"minimum": 0}, -1, "n must be an integer >= 0; got -1"),
        (
            {"counts": "output tokens", "none": "no bound"},
            0,
            "n must be a positive number of output tokens or None (no bound); got 0",
        ),
        ({"minimum": 0, "counts": "bytes"}, -1, "n must be a number of bytes >= 0; got -1"),
    ],
)
def test_the_integer_check_names_the_setting_and_what_it_takes(kwargs, value, message):
    with pytest.raises(ConfigError) as refused:
        check_int("n", value, **kwargs)
    assert str(refused.value) == message


def test_the_integer_check_takes_what_it_says():
    check_int("n", 1)
    check_int("n", 0, minimum=0)
    check_int("n", None, none="no bound")


def test_the_true_or_false_check():
    check_bool("b", False)
    check_bool("b", None, none="on for GPU actors")
    with pytest.raises(ConfigError, match=r"^b must be True or False; got 1$"):
        check_bool("b", 1)
    with pytest.raises(
        ConfigError, match=r"^b must be True, False or None \(on for GPU actors\); got 'yes'$"
    ):
        check_bool("b", "yes", none="on for GPU actors")


# (a pool setting, a bad value, words): each refused through the one integer or True/False check
POOL_MISTAKES = [
    ("max_batches_in_flight_per_actor", 0, "max_batches_in_flight_per_actor must be a positive integer"),
    ("max_queued_bytes", True, "max_queued_bytes must be a positive number of bytes"),
    ("embedding_cache_bytes", -1, "embedding_cache_bytes must be a number of bytes >= 0"),
    (
        "embedding_cache_local_bytes",
        1.5,
        r"embedding_cache_local_bytes must be a number of bytes >= 0 or None",
    ),
    ("max_actor_restarts", -1, "max_actor_restarts must be an integer >= 0"),
    ("actor_threads", 0, r"actor_threads must be a positive integer or None"),
    ("small_first_tokens", 0, r"small_first_tokens must be a positive number of output tokens or None"),
    ("warm_standby", 1, r"warm_standby must be True, False or None \(on for GPU actors\)"),
    ("overlap_runs", None, "overlap_runs must be True or False"),
    ("standby_graphs", "yes", "standby_graphs must be True or False"),
]


@pytest.mark.parametrize(("name", "value", "words"), POOL_MISTAKES)
def test_pool_settings_use_the_same_checks(name, value, words):
    with pytest.raises(ConfigError, match=words):
        PoolSettings(**{name: value})


# ---- the device -------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [None, "cuda", "cuda:0", "cuda:3", "cpu"])
def test_an_encoder_takes_a_gpu_index(device):
    check_device(device)
    assert EncoderOptions(device=device).device == device
    assert EncoderSpec(device=device).device == device


@pytest.mark.parametrize("device", ["cuda:1", "cuda:0"])
def test_a_pool_refuses_a_gpu_index_saying_why_and_what_to_do(device):
    with pytest.raises(ConfigError) as refused:
        PoolSettings(device=device)
    message = str(refused.value)
    assert f"device {device!r}: a pool places each actor on a GPU of its own" in message
    assert "use device='cuda' (or None)" in message and "num_gpus" in message


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:", "cpu:0", "CUDA", 0, ""])
def test_other_devices_are_refused_by_both(device):
    with pytest.raises(ConfigError, match="is not a torch device vitpool runs on; use 'cuda', 'cuda:N'"):
        EncoderOptions(device=device)
    with pytest.raises(ConfigError, match=r"is not a torch device vitpool runs on; use None \(the actor's"):
        PoolSettings(device=device)


def test_the_pools_device_rule_is_the_encoders_narrowed():
    for device in (None, "cuda", "cpu"):
        check_device(device, in_pool=True)
        assert PoolSettings(device=device).encoder_spec().device == device


# ---- the budgets --------------------------------------------------------------------------------


def test_one_budget_check_for_encoders_pools_and_the_command_line():
    assert check_budgets([64, 16], None) == (64, 16)
    assert check_budgets(None, 8) is None
    # an encoder takes budgets as large as it is asked (it fails at once, in this process)
    assert EncoderOptions(budgets=[MAX_BUDGET_TOKENS + 1]).budgets == (MAX_BUDGET_TOKENS + 1,)
    with pytest.raises(ConfigError, match=r"budgets: 65537 tokens is above the largest budget a pool"):
        PoolSettings(budgets=[MAX_BUDGET_TOKENS + 1])
    with pytest.raises(ConfigError, match="budgets must be a list of token budgets"):
        EncoderOptions(budgets=64)
    with pytest.raises(ConfigError, match="budgets must be a list of token budgets"):
        EncoderOptions(budgets="64,256")


def test_a_pool_checks_its_bounds_against_its_smallest_default_budget():
    with pytest.raises(
        ConfigError, match=r"max_items_per_batch \(65\) exceeds the smallest budget \(64 tokens\)"
    ):
        PoolSettings(max_items_per_batch=65)
    assert EncoderOptions(max_items_per_batch=65).max_items_per_batch == 65  # the encoder's defaults decide
    with pytest.raises(ConfigError, match=r"max_frames_per_batch \(4\) must be >= max_items_per_batch \(8\)"):
        PoolSettings(budgets=[16], max_items_per_batch=8, max_frames_per_batch=4)
    with pytest.raises(ConfigError, match="max_frames_per_batch must be a positive integer or None"):
        PoolSettings(max_frames_per_batch=0)
