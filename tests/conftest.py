"""Shared fixtures: the shipped tiny tower, its Hugging Face reference, and item builders."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from vitpool import GraphEncoder, Image, Video
from vitpool.families.qwen3_vl.adapter import Qwen3VLAdapter
from vitpool.models import load_adapter

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; requires-python is >=3.10

ROW_WIDTH = 3 * 2 * 16 * 16  # channels * temporal patch * patch * patch of the Qwen3-VL family
RAY_TEMP_ROOT = pytest.StashKey[tuple[str, dict[str, str | None]]]()


def pytest_configure(config):
    """Ray's temp directory private to this run, set before any test module reads os.environ (some
    build their subprocesses' environment at import). A cluster started on this machine with
    `ray start` (any user's) writes its address into Ray's default temp directory, where
    `ray.init()` and vitpool's launch and connect would find and join it; in a private one they
    find only the clusters this run started, and so do the processes the tests start. No
    RAY_ADDRESS either: each test chooses its cluster."""
    # short, in /tmp: Ray's socket paths (<root>/ray/session_<date>_<pid>/sockets/...) must fit 107 bytes
    root = tempfile.mkdtemp(prefix="vpray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    previous = {name: os.environ.get(name) for name in ("RAY_TMPDIR", "RAY_ADDRESS")}
    config.stash[RAY_TEMP_ROOT] = root, previous
    os.environ["RAY_TMPDIR"] = root
    os.environ.pop("RAY_ADDRESS", None)


def pytest_unconfigure(config):
    root, previous = config.stash[RAY_TEMP_ROOT]
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(root, ignore_errors=True)


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


# One item encoded in two batches may land in two budgets whose graphs run different attention
# kernels (packed cuDNN where it won its race, FA2 where FA2 did): the same values up to bf16
# rounding. Another item's rows, or stale ones, would be off by the order of the values themselves.
SAME_ITEM_TOLERANCE = 1e-2


def assert_same_item(got: torch.Tensor, alone: torch.Tensor) -> None:
    """An item's tokens from a shared batch against the same item encoded alone."""
    assert got.shape == alone.shape and torch.isfinite(got).all()
    assert relative_error(got, alone) <= SAME_ITEM_TOLERANCE


def assert_close_to_reference(reference, items, embeddings, tolerance: float = 1e-2) -> None:
    """GPU encodes (bf16) against Hugging Face's forward on each item: tokens and deepstack
    features finite and within `tolerance` relative error."""
    for item, embedding in zip(items, embeddings, strict=True):
        tokens, deepstack = reference_outputs(reference, item)
        assert embedding.tokens.dtype == torch.bfloat16 and embedding.tokens.is_cuda
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, tokens) <= tolerance
        for got, expected in zip(embedding.deepstack, deepstack, strict=True):
            assert torch.isfinite(got).all()
            assert relative_error(got, expected) <= tolerance


# Ray clusters the tests start, and only those (pytest_configure keeps them apart from any other
# cluster on the machine); pools on a local Ray cluster (test_pool.py, test_faults.py, ...)

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


def ray_env(ray_temp_root: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment for a process that starts or finds Ray: no token auth (Ray 2.60 turns it on
    for new clusters), no RAY_ADDRESS, and Ray's temp directory `ray_temp_root` (default: this
    run's private one), where a process without an address looks for a running cluster."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    if ray_temp_root is not None:
        env["RAY_TMPDIR"] = str(ray_temp_root)
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def ray_head(
    ray_temp_root: Path, *options: str, timeout_s: float = 180, environment: dict[str, str] | None = None
) -> Iterator[int]:
    """A one-node cluster started by `ray start --head --block` (as a user would) on a free port,
    with Ray's temp directory `ray_temp_root`: yields the port once the head's address file names it.
    `environment`: variables set for the head beside `ray_env`'s (RAY_AUTH_MODE=token, say).

    The head runs in a process group of its own. On exit, also when it did not come up or a test
    failed, its process group and every process whose command line names its temp directory are
    killed, by pid: never `ray stop`, which stops every cluster of this user on the machine."""
    ray_temp_root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    address_file = ray_temp_root / "ray" / "ray_current_cluster"
    log = ray_temp_root / "head.log"
    with log.open("wb") as output:
        head = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "start",
                "--head",
                f"--port={port}",
                *options,
                "--disable-usage-stats",
                "--include-dashboard=false",
                "--block",
            ],
            env={**ray_env(ray_temp_root), **(environment or {})},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout_s
        while not (address_file.exists() and address_file.read_text().strip().endswith(f":{port}")):
            assert head.poll() is None, (
                f"ray start --head exited with {head.returncode}:\n{log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"ray start --head did not come up in {timeout_s:.0f} s"
            time.sleep(0.5)
        yield port
    finally:
        _stop_ray_head(head, ray_temp_root)
        if address_file.exists() and address_file.read_text().strip().endswith(f":{port}"):
            address_file.unlink()


def _stop_ray_head(head: subprocess.Popen, ray_temp_root: Path) -> None:
    head.send_signal(signal.SIGTERM)  # `ray start --block` stops its cluster's processes
    try:
        head.wait(timeout=30)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)  # what of its group outlived it (the group is the head's own)
    # workers run in groups of their own and stop with their raylet; anything else naming the
    # temp directory (GCS, raylet, agents of a session of it) is this head's or a cluster started there
    for pid in _pids_naming(f"{ray_temp_root}/ray/"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _pids_naming(text: str) -> list[int]:
    """Pids of the processes whose command line contains `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


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
        self._threads = [
            threading.Thread(target=self._run, args=(items, reference_encoder)) for items in calls
        ]

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

    def __enter__(self) -> Self:
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
    return BatchPlan(budget, tuple(item.spec for item in prepared)), [
        to_array(item.pixels) for item in prepared
    ]


def assert_answers_close(got: list, wanted: list, max_relative_error: float) -> None:
    """`send_concurrently`'s answers all OK, without item errors, every output finite and within
    `max_relative_error` of the wanted Embedding's."""
    from vitpool.transport.link import OK

    for (values, receipt), want in zip(got, wanted, strict=True):
        assert receipt.status == OK and receipt.item_errors == {}
        for value, expected in zip(values, want, strict=True):
            for got_tensor, want_tensor in zip(value.outputs, expected.outputs, strict=True):
                assert (
                    torch.isfinite(got_tensor).all()
                    and relative_error(got_tensor, want_tensor) <= max_relative_error
                )


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
