"""Shared fixtures: the shipped tiny tower, its Hugging Face reference, and item builders."""

from __future__ import annotations

import copy
import logging
import os
import threading
import time

import pytest
import torch

from vitpool import GraphEncoder, Image, Video
from vitpool.models import Qwen3VLAdapter, load_adapter

ROW_WIDTH = 3 * 2 * 16 * 16  # channels * temporal patch * patch * patch of the Qwen3-VL family


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level(logging.INFO, logger="vitpool")


@pytest.fixture(scope="session")
def tiny_adapter() -> Qwen3VLAdapter:
    return load_adapter(None, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def reference_tower(tiny_adapter):
    """The same weights, run by Hugging Face's own code path (SDPA, item by item)."""
    tower = copy.deepcopy(tiny_adapter.tower)
    tower.config._attn_implementation = "sdpa"
    return tower


def make_encoder(adapter, budgets, **kwargs) -> GraphEncoder:
    return GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32, **kwargs)


def image(h: int, w: int, generator: torch.Generator | None = None) -> Image:
    return Image(torch.randn(h * w, ROW_WIDTH, generator=generator), (1, h, w))


def video(t: int, h: int, w: int, generator: torch.Generator | None = None) -> Video:
    return Video(torch.randn(t * h * w, ROW_WIDTH, generator=generator), (t, h, w))


def reference_outputs(tower, item) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Hugging Face's forward on one item (computes its own metadata from grid_thw)."""
    weight = next(tower.parameters())
    with torch.no_grad():
        pixels = torch.as_tensor(item.pixel_values).to(weight.device, weight.dtype)
        output = tower(pixels, grid_thw=torch.tensor([item.grid_thw], device=weight.device))
    return output.pooler_output, list(output.deepstack_features)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float().cpu(), expected.float().cpu()
    return float(torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected))


# pools on a local Ray cluster (tests/test_pool.py, tests/test_faults.py)

BUDGETS = [16, 64, 256]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster with two fake GPUs, per test module."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 turns on token auth for new local clusters
    # address="local": a cluster started with `ray start` on this machine is not this module's
    ray.init(address="local", num_gpus=2, num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def reference_encoder() -> GraphEncoder:
    """The same shipped weights, in this process: what every pool result must equal."""
    return GraphEncoder.from_pretrained(None, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def mixed_items(seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [
        image(8, 8, generator),
        video(2, 4, 6, generator),
        image(20, 16, generator),  # 80 tokens: needs the 256-token budget
        image(2, 2, generator),
        image(40, 36, generator),  # 360 tokens: larger than every budget, runs eager
    ]


class CheckedStream:
    """Threads calling a pool back to back, one per call in `calls`, each checking every result
    against `reference_encoder`; used as a context manager (threads stop and join on exit)."""

    def __init__(self, pool, reference_encoder, calls: list[list], join_timeout_s: float = 180) -> None:
        self.pool, self.stop = pool, threading.Event()
        self.failures: list[str] = []
        self.completed = 0
        self._join_timeout_s = join_timeout_s
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(items, reference_encoder)) for items in calls]

    def _run(self, items, reference_encoder) -> None:
        expected = reference_encoder.encode(items)
        while not self.stop.is_set():
            try:
                assert_same(self.pool.encode(items, timeout_s=120), expected)
            except Exception as error:  # noqa: BLE001 - collected and reported
                self.failures.append(repr(error))
                return
            with self._lock:
                self.completed += 1

    def __enter__(self) -> CheckedStream:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=self._join_timeout_s)


def wait_for(condition, timeout_s: float, what: str, pool=None) -> None:
    """Poll `condition` until it holds; after `timeout_s`, fail naming `what` (with `pool`'s
    summary, if given)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            state = pool.stats(timeout_s=10).summary() if pool is not None else ""
            raise AssertionError(f"timed out waiting for {what}\n{state}")
        time.sleep(0.1)


def assert_same(results, expected) -> None:
    assert len(results) == len(expected)
    for got, want in zip(results, expected):
        assert got.tokens.shape == want.tokens.shape
        torch.testing.assert_close(got.tokens, want.tokens, rtol=1e-5, atol=1e-5)
        assert len(got.deepstack) == len(want.deepstack) == 2
        for got_feature, want_feature in zip(got.deepstack, want.deepstack):
            torch.testing.assert_close(got_feature, want_feature, rtol=1e-5, atol=1e-5)


def plan_batch(items, rules, budgets):
    """A batch as a pool's caller plans it: the items' specs in the smallest budget that holds
    them all (None: run eager), and their pixels as the arrays that travel."""
    from vitpool.items import prepare_items
    from vitpool.packing import smallest_fitting
    from vitpool.specs import BatchPlan
    from vitpool.transport.wire import to_array

    prepared = prepare_items(items, rules)
    needs: dict[str, int] = {}
    for item in prepared:
        for name, amount in item.spec.needs:
            needs[name] = needs.get(name, 0) + amount
    num_tokens = sum(item.spec.num_tokens for item in prepared)
    budget = smallest_fitting(budgets, len(prepared), num_tokens, tuple(sorted(needs.items())))
    return BatchPlan(budget, tuple(item.spec for item in prepared)), [to_array(item.pixels) for item in prepared]


def assert_answers_close(got: list, wanted: list, max_relative_error: float) -> None:
    """`send_concurrently`'s answers all OK, without item errors, every output finite and within
    `max_relative_error` of the wanted Embedding's."""
    from vitpool.transport.link import OK

    for (values, receipt), want in zip(got, wanted, strict=True):
        assert receipt.status == OK and receipt.item_errors == {}
        for value, expected in zip(values, want, strict=True):
            for got_tensor, want_tensor in zip(value.outputs, expected.outputs, strict=True):
                assert torch.isfinite(got_tensor).all() and relative_error(got_tensor, want_tensor) <= max_relative_error


def send_concurrently(actor, batches: list[list], timeout_s: float = 60.0) -> list:
    """Each batch planned as its caller would and sent to the in-process actor from its own
    thread, all released at once; per batch, what `run_batch` returned (values, receipt)."""
    got: list = [None] * len(batches)
    barrier = threading.Barrier(len(batches))

    def send(index: int) -> None:
        plan, pixels = plan_batch(batches[index], actor.encoder.adapter.item_rules, actor.encoder.budgets)
        barrier.wait()
        got[index] = actor.run_batch(plan, pixels)

    threads = [threading.Thread(target=send, args=(n,)) for n in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), "a batch sent to the actor did not come back"
    return got
