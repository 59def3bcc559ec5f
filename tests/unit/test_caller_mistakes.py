"""What a new user's mistakes get from the pool's caller side, without a cluster: each item's own
outcome with `return_exceptions`, a default bound on an item's size, messages that say whether an
item or the call is too large for the queue, launch's checks before any actor starts, actors'
start errors raised as their own types, and counts in messages that agree with their nouns."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from conftest import ROW_WIDTH
from test_caller_imports import engine_modules_loaded_by
from test_dispatcher import FakeLink, dispatcher, queued

import vitpool
from vitpool.actors.reports import ActorStats
from vitpool.errors import (
    CheckpointError,
    ConfigError,
    EncodeError,
    InvalidItemError,
    PoolUnavailableError,
    counted,
)
from vitpool.items import Embedding, Image
from vitpool.pool import cluster
from vitpool.pool.calls import Call
from vitpool.pool.item_checks import checked_item, each_checked
from vitpool.pool.preflight import check_device, check_family, checked_model_directory
from vitpool.pool.settings import DEFAULT_MAX_ITEM_TOKENS, PoolSettings
from vitpool.pool.start_errors import start_error, start_failure
from vitpool.pool.stats import PoolStats
from vitpool.transport.link import OK, BatchFailed, BatchReceipt, Done

SHIPPED = Path(vitpool.__file__).parent / "models" / "checkpoints" / "tiny-qwen3-vl"


class AnsweringLink(FakeLink):
    """Answers each batch at once (from another thread) with `outcome(plan)`."""

    def __init__(self, outcome) -> None:
        super().__init__(delay_s=0.0)
        self.outcome = outcome

    def send(self, plan, pixels, on_outcome) -> None:
        self.batches += 1
        self.plans.append(plan)
        threading.Thread(target=lambda: on_outcome(self.outcome(plan)), daemon=True).start()


def values(plan) -> list:
    return [Embedding(torch.tensor([[float(spec.num_tokens)]])) for spec in plan.specs]


# ---- return_exceptions: each item's own outcome ----


def test_with_return_exceptions_a_bad_item_fills_its_own_slot_and_the_others_are_kept():
    """The actor finds the second item's pixels not finite: its slot holds the InvalidItemError
    naming its index in the call; the call's other results are there."""

    def nan_in_second(plan):
        errors = {
            p: "pixel_values contain NaN or infinite values"
            for p, s in enumerate(plan.specs)
            if s.num_tokens == 5
        }
        return Done(
            [None if p in errors else v for p, v in enumerate(values(plan))], BatchReceipt(OK, errors)
        )

    subject = dispatcher({0: AnsweringLink(nan_in_second)}, [], batch_window_s=0.0)
    try:
        each = Call(3, return_exceptions=True)
        subject.submit(each, queued(each, [3, 5, 7]))
        results = each.future.result(timeout=10)
        assert float(results[0].tokens) == 3 and float(results[2].tokens) == 7
        assert isinstance(results[1], InvalidItemError) and results[1].index == 1 and "NaN" in str(results[1])
        # the default is unchanged: the same call without return_exceptions raises the item's error
        strict = Call(3)
        subject.submit(strict, queued(strict, [3, 5, 7]))
        with pytest.raises(InvalidItemError, match="item 1: pixel_values contain NaN"):
            strict.future.result(timeout=10)
        assert subject.counters.failed_calls == 1 and subject.counters.rejected_items == 2
    finally:
        subject.close()


def test_with_return_exceptions_a_failed_batch_gives_each_item_its_own_error():
    subject = dispatcher(
        {0: AnsweringLink(lambda plan: BatchFailed(RuntimeError("CUDA error")))}, [], batch_window_s=0.0
    )
    try:
        each = Call(2, return_exceptions=True)
        subject.submit(each, queued(each, [3, 4]))
        results = each.future.result(timeout=10)
        assert [type(r) for r in results] == [EncodeError, EncodeError]
        assert [str(r).split(":")[0] for r in results] == ["item 0", "item 1"]
        assert "CUDA error" in str(results[1]) and isinstance(results[1].__cause__, RuntimeError)
        assert subject.counters.failed_calls == 0 and subject.counters.failed_batches == 1
    finally:
        subject.close()


def test_with_return_exceptions_an_item_left_without_an_actor_gets_pool_unavailable():
    """One item in flight, one queued behind it, when the pool goes: the queued one's slot says
    why; the one in flight still gets its result."""
    link = FakeLink(delay_s=None)  # keeps its batches until the test answers
    subject = dispatcher({0: link}, [], batch_window_s=0.0, max_batches_in_flight_per_actor=1)
    each = Call(2, return_exceptions=True)
    subject.submit(each, queued(each, [200, 200]))  # two batches: 256 tokens hold one of these
    [flight] = list(subject._flights)
    assert subject.queue_depth == 1
    subject.close("the pool's controller is gone")
    subject._on_outcome(flight, Done(values(link.plans[0]), BatchReceipt(OK)))
    results = each.future.result(timeout=5)
    assert float(results[0].tokens) == 200
    assert isinstance(results[1], PoolUnavailableError)
    assert str(results[1]) == "item 1: the pool's controller is gone"


# ---- the bound on an item's size, and the queue's ----


def test_the_default_bound_on_an_item_is_the_processors_largest_image(tiny_adapter):
    rules = tiny_adapter.item_rules
    assert PoolSettings().max_item_tokens == DEFAULT_MAX_ITEM_TOKENS == 16384

    def image_of(num_tokens: int) -> Image:
        # 4 patch rows a token; the expanded tensor has the shape without the memory
        return Image(torch.zeros(1, ROW_WIDTH).expand(4 * num_tokens, ROW_WIDTH), (1, 2, 2 * num_tokens))

    assert checked_item(0, image_of(16384), rules, DEFAULT_MAX_ITEM_TOKENS).spec.num_tokens == 16384
    for num_tokens in (16385, 100 * 1024):  # just over; 100x the largest default budget
        with pytest.raises(InvalidItemError) as raised:
            checked_item(3, image_of(num_tokens), rules, DEFAULT_MAX_ITEM_TOKENS)
        assert raised.value.index == 3
        assert f"{num_tokens} output tokens" in str(raised.value) and "max_item_tokens=16384" in str(
            raised.value
        )
    assert checked_item(0, image_of(100 * 1024), rules, None).spec.num_tokens == 100 * 1024  # None: no bound
    PoolSettings(max_item_tokens=None)
    with pytest.raises(ConfigError, match="max_item_tokens"):
        PoolSettings(max_item_tokens=0)


def test_each_checked_keeps_the_good_items_beside_the_bad(tiny_adapter):
    good = Image(torch.randn(16, ROW_WIDTH), (1, 4, 4))
    outcomes = each_checked(
        [good, Image(torch.randn(16, 100), (1, 4, 4)), "not an item", good],
        tiny_adapter.item_rules,
        max_item_tokens=16,
        max_queued_bytes=1 << 20,
    )
    assert [type(o).__name__ for o in outcomes] == [
        "PreparedItem",
        "InvalidItemError",
        "InvalidItemError",
        "PreparedItem",
    ]
    assert [o.index for o in outcomes if isinstance(o, InvalidItemError)] == [1, 2]
    with pytest.raises(InvalidItemError, match="item 0: its pixels take 98304 bytes.*max_queued_bytes=1000"):
        checked_item(0, good, tiny_adapter.item_rules, None, max_queued_bytes=1000)


def test_a_call_too_large_for_the_queue_as_a_whole_says_split_it():
    """An item over the queue's bytes is refused where items are checked (the test above); what
    reaches the dispatcher and cannot fit is the call as a whole."""
    subject = dispatcher({0: FakeLink(delay_s=None)}, [], max_queued_items=4, max_queued_bytes=4096)
    try:
        call = Call(5)
        with pytest.raises(
            ValueError, match="a call of 5 items .* each item fits on its own: split the call"
        ) as raised:
            subject.submit(call, queued(call, [1] * 5))
        assert not isinstance(raised.value, InvalidItemError)
        call = Call(3)
        with pytest.raises(ValueError, match="a call of 3 items and 6144 pixel bytes"):
            subject.submit(call, queued(call, [16, 16, 16]))  # 2048 bytes each: 6144 over 4096
    finally:
        subject.close()


# ---- launch: what the caller checks before any actor starts ----


def test_a_model_that_is_not_a_local_checkpoint_is_refused_in_the_caller(tmp_path):
    cases = {  # model -> what the CheckpointError says
        "Qwen/Qwen3-VL-8B-Instruct": "hf download Qwen/Qwen3-VL-8B-Instruct",  # a Hub id
        str(tmp_path / "missing"): "no such directory",  # a wrong path
        str(SHIPPED / "config.json"): "is a file",  # the config, not its directory
        str(tmp_path): "has no config.json",
    }
    for model, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            checked_model_directory(model)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read"):
        checked_model_directory(str(tmp_path))


def test_a_path_missing_here_is_left_to_the_actors_of_a_cluster_the_pool_joins(tmp_path, caplog):
    """A driver beside a cluster need not hold the checkpoints its nodes hold: an absolute path
    passes with a warning; a Hub id or a relative path is still refused."""
    missing = str(tmp_path / "on-the-nodes")
    with caplog.at_level("WARNING"):
        assert checked_model_directory(missing, joins_a_cluster=True) == missing
    assert "not on this machine" in caplog.text
    with pytest.raises(CheckpointError, match="hf download"):
        checked_model_directory("Qwen/Qwen3-VL-8B-Instruct", joins_a_cluster=True)
    with pytest.raises(CheckpointError, match="no such directory"):
        checked_model_directory(missing)


def test_a_checkpoint_of_a_family_vitpool_does_not_serve_is_refused(tmp_path):
    def config_of(config: dict) -> str:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return checked_model_directory(str(tmp_path))

    check_family(checked_model_directory(str(SHIPPED)), None)  # a tower-only save
    check_family(config_of({"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}), None)  # a full model
    check_family(config_of({"model_type": "glm46v", "vision_config": {"model_type": "glm4v_vision"}}), None)
    for omni, tower in (
        ("qwen2_5_omni", "qwen2_5_omni_vision_encoder"),
        ("qwen3_omni_moe", "qwen3_omni_moe_vision_encoder"),
    ):
        # an Omni model's tower sits in its thinker's config
        check_family(
            config_of({"model_type": omni, "thinker_config": {"vision_config": {"model_type": tower}}}), None
        )
    for config in (
        {"model_type": "llama"},
        {"model_type": "blip-2", "vision_config": {"model_type": "blip_2_vision_model"}},
    ):
        with pytest.raises(CheckpointError, match="is not one vitpool serves; supported vision model types"):
            check_family(config_of(config), None)
    # a family registered where the encoder runs is the actors' to judge
    check_family(config_of({"model_type": "toy_tiles"}), "toy_family")


def test_a_relative_model_path_reaches_the_actors_absolute(tmp_path, monkeypatch):
    (tmp_path / "tower").mkdir()
    (tmp_path / "tower" / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_vision"}))
    monkeypatch.chdir(tmp_path)
    assert checked_model_directory("tower") == str(tmp_path / "tower")


def test_device_cuda_for_actors_without_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="the Ray cluster has no GPU: run on CPUs with device='cpu'"):
        check_device("cuda", {"num_gpus": 0}, cluster_gpus=0.0)
    with pytest.raises(ConfigError, match="each encoder actor is given no GPU"):
        check_device("cuda", {"num_gpus": 0}, cluster_gpus=2.0)
    check_device("cuda", {"num_gpus": 0.5}, cluster_gpus=1.0)
    check_device(None, {"num_gpus": 0}, cluster_gpus=0.0)  # None: the actor's GPU if it has one, else its CPU


def test_launchs_checks_import_no_engine():
    code = (
        "from vitpool.pool.preflight import check_family, checked_model_directory\n"
        f"check_family(checked_model_directory({str(SHIPPED)!r}), None)\n"
    )
    assert engine_modules_loaded_by(code) == []


# ---- an actor's start error, as the caller gets it ----


class FakeTaskError(Exception):
    """What Ray raises for an exception in an actor's method: it carries the exception as `cause`."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray::EncoderActor.info() (pid=1)\n  File ...\n{type(cause).__name__}: {cause}")
        self.cause = cause


def test_an_actors_own_start_error_is_raised_as_its_type_with_its_one_line():
    error = start_failure(
        [(0, start_error(FakeTaskError(CheckpointError("/m: weights do not match the tower"))))], 1
    )
    assert type(error) is CheckpointError and str(error) == "/m: weights do not match the tower"
    assert error.__notes__ == ["encoder actor 0 failed to start"]
    error = start_failure(
        [(1, start_error(FakeTaskError(ConfigError("device 'cuda': no CUDA")))), (2, ValueError())], 2
    )
    assert type(error) is ConfigError and error.__notes__ == [
        "2 of 2 encoder actors failed to start (the first, actor 1)"
    ]
    other = RuntimeError("out of host memory\nmore lines of a traceback")
    error = start_failure([(0, start_error(FakeTaskError(other)))], 1)
    assert type(error) is vitpool.VitpoolError and error.__cause__ is other
    assert str(error) == "encoder actor 0 failed to start: RuntimeError: out of host memory"


# ---- counts in messages ----


def test_counts_agree_with_their_nouns(monkeypatch):
    assert [counted(1, "actor"), counted(2, "actor"), counted(0, "batch"), counted(1, "GPU")] == [
        "1 actor",
        "2 actors",
        "0 batches",
        "1 GPU",
    ]
    summary = PoolStats(
        "p",
        1,
        [ActorStats(batches=1, items=1, runs=1, combined_batches=1)],
        calls=1,
        items=1,
        batches=1,
        queue_depth=1,
    ).summary()
    assert "1 encoder actor taking work; since launch 1 item in 1 batch," in summary
    assert "this process: 1 call, 1 item in 1 batch (" in summary and "queue 1 item (" in summary
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"GPU": 1.0, "CPU": 4.0})
    with pytest.raises(
        ConfigError, match=r"^1 encoder actor with num_gpus=2 needs 2 GPUs; the cluster has 1\."
    ):
        cluster.check_capacity({"num_gpus": 2, "num_cpus": 1}, 1)
    with pytest.raises(ConfigError, match=r"^2 encoder actors with num_gpus=1 need 2 GPUs;"):
        cluster.check_capacity({"num_gpus": 1, "num_cpus": 1}, 2)
    placement = cluster.Placement(None, (0,))
    with pytest.raises(
        ConfigError, match="2 encoder actors, but the placement group has 1 bundle to hold them"
    ):
        cluster.check_bundles(placement, 2)


def test_a_cluster_without_a_gpu_says_so_and_how_to_run_on_the_cpu(monkeypatch):
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 4.0})
    with pytest.raises(ConfigError) as raised:
        cluster.check_capacity({"num_gpus": 1, "num_cpus": 1}, 1)
    message = str(raised.value)
    assert "the Ray cluster has no GPU" in message and "device='cpu'" in message
    assert "fractional" not in message and "need 1 GPUs" not in message
