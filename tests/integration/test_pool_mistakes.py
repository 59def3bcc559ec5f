"""A new user's mistakes through a pool on a local Ray cluster (two fake GPUs, CPU actors): one
bad item in a call no longer costs the others their results (`return_exceptions`), an oversized
item is refused in the caller by default, a launch that cannot work fails fast with its own
error type, and a closed or orphaned handle says so without starting Ray."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time

import pytest
import ray
import torch
from conftest import BUDGETS, ROW_WIDTH, assert_same, image, ray_env

from vitpool import (
    CheckpointError,
    ConfigError,
    Embedding,
    EncoderPool,
    Image,
    InvalidItemError,
    PoolUnavailableError,
)
from vitpool.models import SHIPPED_CHECKPOINT

pytestmark = pytest.mark.ray

POOL_NAME = "vitpool-mistakes"


@pytest.fixture(scope="module")
def pool(ray_cluster):
    pool = EncoderPool.launch(
        budgets=BUDGETS, name=POOL_NAME, device="cpu", num_actors=1, startup_timeout_s=120
    )
    yield pool
    pool.shutdown()


def nan_image() -> Image:
    item = image(4, 4)
    item.pixel_values[3, 7] = float("nan")
    return item


def oversized_image(num_tokens: int) -> Image:
    """An image of `num_tokens` tokens whose pixels take no memory (one row, expanded)."""
    return Image(torch.zeros(1, ROW_WIDTH).expand(4 * num_tokens, ROW_WIDTH), (1, 2, 2 * num_tokens))


def pool_actor_names() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def test_one_bad_item_costs_the_others_nothing_with_return_exceptions(pool, reference_encoder):
    generator = torch.Generator().manual_seed(7)
    good = [image(8, 8, generator), image(20, 16, generator)]
    wrong_width = Image(torch.randn(16, 100), (1, 4, 4))
    items = [good[0], nan_image(), wrong_width, good[1], oversized_image(16385)]
    expected = reference_encoder.encode(good)
    before = pool.stats()
    for results in (
        pool.encode(items, return_exceptions=True),
        asyncio.run(pool.encode_async(items, return_exceptions=True)),
    ):
        assert [type(r) for r in results] == [
            Embedding,
            InvalidItemError,
            InvalidItemError,
            Embedding,
            InvalidItemError,
        ]
        assert_same([results[0], results[3]], expected)
        assert [r.index for r in results if isinstance(r, InvalidItemError)] == [1, 2, 4]
        assert "NaN" in str(results[1])  # found on the actor, in a batch shared with good items
        assert "100 features" in str(results[2])  # refused here
        assert "max_item_tokens=16384" in str(results[4])  # the default bound, here
    after = pool.stats()
    assert after.failed_calls == before.failed_calls  # no call failed: every item got its outcome
    assert after.rejected_items - before.rejected_items == 6
    # the default stays: the first bad item raises
    with pytest.raises(InvalidItemError, match="item 1: pixel_values contain NaN"):
        pool.encode([good[0], nan_image()])
    # every item refused in the caller: the call completes without sending anything
    [refused] = pool.encode([wrong_width], return_exceptions=True)
    assert isinstance(refused, InvalidItemError) and refused.index == 0


def test_an_item_over_the_default_bound_is_refused_in_the_caller(pool):
    before = pool.stats()
    for num_tokens in (16385, 100 * 1024):  # just over the bound; 100x the largest default budget
        with pytest.raises(InvalidItemError) as raised:
            pool.encode([image(4, 4), oversized_image(num_tokens)])
        assert raised.value.index == 1
        assert f"{num_tokens} output tokens" in str(raised.value) and "max_item_tokens=16384" in str(
            raised.value
        )
    after = pool.stats()
    assert after.batches == before.batches and after.calls == before.calls  # nothing was sent
    assert after.rejected_items - before.rejected_items == 2


def test_launch_mistakes_fail_in_the_caller_before_any_actor_starts(ray_cluster, tmp_path):
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    cases = [  # (launch arguments, error type, what its message says)
        ({"model": "Qwen/Qwen3-VL-8B-Instruct"}, CheckpointError, "hf download"),  # a Hub id
        ({"model": str(tmp_path / "missing")}, CheckpointError, "no such directory"),
        ({"model": str(tmp_path)}, CheckpointError, "has no config.json"),
        ({"model": str(tmp_path / "llm")}, CheckpointError, "model type 'llama' is not one vitpool serves"),
        (
            {"device": "cuda", "actor_options": {"num_gpus": 0}},
            ConfigError,
            "each encoder actor is given no GPU",
        ),
    ]
    for arguments, error_type, message in cases:
        start = time.monotonic()
        with pytest.raises(error_type, match=message):
            EncoderPool.launch(name="vitpool-mistaken", budgets=BUDGETS, **arguments)
        assert time.monotonic() - start < 5, arguments  # no actor started (one takes longer)
        assert not any(name.startswith("vitpool-mistaken") for name in pool_actor_names())


def test_an_actors_start_error_is_raised_as_its_own_type(ray_cluster, tmp_path):
    """What only an actor can find (CUDA on its node, its weights) comes back as the actor's own
    ConfigError or CheckpointError with its one-line message, not Ray's ActorDiedError text."""
    with pytest.raises(ConfigError) as raised:  # the fake GPU has no CUDA behind it
        EncoderPool.launch(
            name="vitpool-no-cuda", budgets=BUDGETS, device="cuda", num_actors=1, startup_timeout_s=120
        )
    assert type(raised.value) is ConfigError and "CUDA is not available" in str(raised.value)
    assert "\n" not in str(raised.value) and "creation task" not in str(raised.value)
    assert raised.value.__notes__ == ["encoder actor 0 failed to start"]

    shutil.copy(SHIPPED_CHECKPOINT / "config.json", tmp_path / "config.json")
    from safetensors.torch import save_file

    save_file({"not.a.tower.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="weights do not match the tower") as raised:
        EncoderPool.launch(
            model=str(tmp_path),
            name="vitpool-bad-weights",
            budgets=BUDGETS,
            device="cpu",
            num_actors=1,
            actor_options={"num_gpus": 0},
            startup_timeout_s=120,
        )
    assert type(raised.value) is CheckpointError and "\n" not in str(raised.value)

    def gone() -> bool:
        return not any(
            name.startswith(("vitpool-no-cuda", "vitpool-bad-weights")) for name in pool_actor_names()
        )

    deadline = time.monotonic() + 30
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone()  # the failed actors and their controllers are stopped


def test_a_closed_handle_says_so_and_the_pool_serves_on(pool, ray_cluster):
    handle = EncoderPool.connect(POOL_NAME)
    address = ray.get_runtime_context().gcs_address
    handle.close()
    for use in (
        lambda: handle.encode([image(4, 4)]),
        lambda: handle.encode_refs([image(4, 4)]),
        lambda: asyncio.run(handle.encode_async([image(4, 4)])),
        handle.stats,
        lambda: handle.num_actors,
        lambda: handle.scale(1),
        lambda: handle.deliver_to([]),
    ):
        with pytest.raises(PoolUnavailableError, match="this handle was closed by close()"):
            use()
    handle.close()  # closing again does nothing
    assert ray.get_runtime_context().gcs_address == address
    assert pool.encode([image(4, 4)])[0].tokens.shape == (4, 128)  # the pool's other handles go on


def test_a_handle_whose_pool_controller_is_gone_says_so(ray_cluster):
    """The process that launched the pool ended, and Ray stopped the controller it owned (and the
    controller's encoder actors): a handle connected from elsewhere cannot be used, and says why."""
    address = ray.get_runtime_context().gcs_address
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ray_env(),
    )
    try:
        assert owner.stdout.readline().strip() == "ready"
        handle = EncoderPool.connect("vitpool-owned")
        assert handle.encode([image(4, 4)])[0].tokens.shape == (4, 128)
    finally:
        owner.kill()
        owner.wait(timeout=30)
    deadline = time.monotonic() + 60
    while True:  # until this handle has seen the controller go (its long poll fails at once)
        try:
            handle.stats(timeout_s=10)
        except PoolUnavailableError as error:
            assert "its controller is gone" in str(error)
            break
        assert time.monotonic() < deadline, "the handle never saw its pool's controller go"
        time.sleep(0.2)
    for use in (lambda: handle.encode([image(4, 4)]), handle.stats, lambda: handle.scale(2)):
        with pytest.raises(PoolUnavailableError, match="its controller is gone"):
            use()
    handle.shutdown()
    assert ray.get_runtime_context().gcs_address == address


OWNER = """
import sys
import ray
ray.init(address=sys.argv[1])
from vitpool import EncoderPool
pool = EncoderPool.launch(budgets=[16, 64], name="vitpool-owned", device="cpu", num_actors=1,
                          actor_options={"num_gpus": 0}, startup_timeout_s=120)
print("ready", flush=True)
sys.stdin.read()  # until the test kills this process
"""

AFTER_SHUTDOWN = """
import asyncio
import ray, torch
from vitpool import EncoderPool, Image, PoolUnavailableError
pool = EncoderPool.launch(budgets=[16, 64], device="cpu", actor_options={"num_gpus": 0})
item = Image(torch.randn(16, 1536), (1, 4, 4))
pool.shutdown()
assert not ray.is_initialized()
uses = {
    "encode": lambda: pool.encode([item]), "encode_refs": lambda: pool.encode_refs([item]),
    "encode_async": lambda: asyncio.run(pool.encode_async([item])), "stats": pool.stats,
    "num_actors": lambda: pool.num_actors, "scale": lambda: pool.scale(2),
    "deliver_to": lambda: pool.deliver_to([]),
}
for name, use in uses.items():
    try:
        use()
    except PoolUnavailableError as error:
        assert "closed by shutdown()" in str(error), (name, error)
    else:
        raise AssertionError(name + " did not raise")
pool.shutdown()  # again: nothing
assert not ray.is_initialized(), "a Ray instance was started"
print("all refused, no Ray started")
"""


def test_a_handle_used_after_shutdown_raises_and_starts_no_ray():
    done = subprocess.run(
        [sys.executable, "-c", AFTER_SHUTDOWN],
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "all refused, no Ray started" in done.stdout
