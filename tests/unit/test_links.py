"""The links to an encoder actor (`vitpool.transport`), with fake Ray handles and no cluster:
each outcome of a Ray call, an outcome that comes inside `send`, the same-node channel's
outcomes, and the fall-back from a broken channel to Ray."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import ray.exceptions
import torch

from vitpool.items import Embedding
from vitpool.specs import BatchPlan, ItemSpec, OutputLayout
from vitpool.transport.channel import ChannelInfo, ChannelServer, RemoteBatchError, channel_supported
from vitpool.transport.channel_link import ChannelLink
from vitpool.transport.link import OK, RETIRED, ActorGone, BatchFailed, BatchReceipt, Done, Refused
from vitpool.transport.links import make_link
from vitpool.transport.ray_link import RayLink

LAYOUT = OutputLayout(((8,), (2, 4)), "float32")
needs_channel = pytest.mark.skipif(not channel_supported(), reason="the same-node channel needs Linux")


# fake Ray: encode_batch.options(num_returns=n).remote(plan, *pixels) -> n refs with .future()


class FakeRef:
    def __init__(self, future: Future) -> None:
        self._future = future

    def future(self) -> Future:
        return self._future


class FakeMethod:
    def __init__(self, handle: FakeHandle) -> None:
        self._handle = handle
        self._num_returns = 1

    def options(self, num_returns: int) -> FakeMethod:
        self._num_returns = num_returns
        return self

    def remote(self, plan: BatchPlan, *pixels: Any) -> list[FakeRef]:
        handle = self._handle
        handle.calls.append((plan, list(pixels), self._num_returns))
        if handle.raise_on_call is not None:
            raise handle.raise_on_call
        futures = [Future() for _ in range(self._num_returns)]
        if handle.answer_at_once is not None:  # the call was over before anyone watched it
            settle(futures[-1], handle.answer_at_once)
        handle.futures.append(futures)
        return [FakeRef(future) for future in futures]


class FakeHandle:
    def __init__(self, answer_at_once: Any = None, raise_on_call: Exception | None = None) -> None:
        self.calls: list[tuple[BatchPlan, list, int]] = []
        self.futures: list[list[Future]] = []
        self.answer_at_once = answer_at_once
        self.raise_on_call = raise_on_call
        self.encode_batch = FakeMethod(self)


def settle(future: Future, answer: Any) -> None:
    if isinstance(answer, BaseException):
        future.set_exception(answer)
    else:
        future.set_result(answer)


class Outcomes:
    """An outcome callback that remembers what it got, and in which thread."""

    def __init__(self) -> None:
        self.got: list[Any] = []
        self.threads: list[int] = []
        self.arrived = threading.Event()

    def __call__(self, outcome: Any) -> None:
        self.got.append(outcome)
        self.threads.append(threading.get_ident())
        self.arrived.set()

    def one(self, timeout_s: float = 10.0) -> Any:
        assert self.arrived.wait(timeout_s), "no outcome came"
        assert len(self.got) == 1, self.got
        return self.got[0]


def make_batch(num_items: int = 2, seed: int = 0) -> tuple[BatchPlan, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    pixels = [rng.standard_normal((4 * (n + 1), 3, 2, 2)).astype(np.float32) for n in range(num_items)]
    specs = tuple(ItemSpec("image", array.shape, "float32", (), array.shape[0]) for array in pixels)
    return BatchPlan(None, specs), pixels


# the Ray call


def test_a_ray_call_passes_the_plan_and_pixels_and_gives_the_value_refs():
    handle, outcomes = FakeHandle(), Outcomes()
    plan, pixels = make_batch(3)
    pixels[1] = FakeRef(Future())  # a reference already in the object store goes as it is
    link = RayLink(handle, "encoder actor 0")
    link.send(plan, pixels, outcomes)
    ((sent_plan, sent_pixels, num_returns),) = handle.calls
    assert sent_plan is plan and sent_pixels == pixels and num_returns == 4
    assert outcomes.got == []  # nothing until the receipt is there
    receipt = BatchReceipt(OK, {2: "bad item"}, 0.01)
    handle.futures[0][-1].set_result(receipt)
    outcome = outcomes.one()
    assert isinstance(outcome, Done) and outcome.receipt == receipt
    assert [ref.future() for ref in outcome.values] == handle.futures[0][:-1]
    assert not link.is_local and link.exchange(plan, pixels, outcomes) is None


@pytest.mark.parametrize(
    "answer, kind, words",
    [
        (BatchReceipt(RETIRED), Refused, "leaving the pool"),
        (ray.exceptions.RayActorError(), ActorGone, "encoder actor 0 is gone"),
        (ray.exceptions.ActorDiedError(), ActorGone, "is gone"),
        (ray.exceptions.ActorUnavailableError("unreachable", None), ActorGone, "unreachable"),
        (RuntimeError("the batch broke"), BatchFailed, "the batch broke"),  # any other error fails the batch
        (ray.exceptions.RayTaskError("encode_batch", "traceback", ValueError("bad")), BatchFailed, ""),
        ("not a receipt", BatchFailed, "not a receipt"),
        (BatchReceipt("unheard of"), BatchFailed, "unheard of"),
    ],
    ids=[
        "retired",
        "actor-error",
        "actor-died",
        "actor-unavailable",
        "error",
        "task-error",
        "not-a-receipt",
        "unknown-status",
    ],
)
def test_each_ray_outcome(answer, kind, words):
    handle, outcomes = FakeHandle(), Outcomes()
    RayLink(handle, "encoder actor 0").send(*make_batch(), outcomes)
    settle(handle.futures[0][-1], answer)
    outcome = outcomes.one()
    assert isinstance(outcome, kind)
    assert words in str(getattr(outcome, "reason", None) or getattr(outcome, "error", ""))
    if isinstance(answer, Exception) and kind is BatchFailed:
        assert outcome.error is answer


def test_an_outcome_known_at_once_comes_inside_send():
    """Ray runs the done-callback inside add_done_callback when the call is already over (its
    actor was known dead): the outcome then comes in the sender's thread, before send returns."""
    handle, outcomes = FakeHandle(answer_at_once=ray.exceptions.RayActorError()), Outcomes()
    seen_during_send: list[int] = []

    def on_outcome(outcome: Any) -> None:
        seen_during_send.append(len(handle.calls))
        outcomes(outcome)

    RayLink(handle).send(*make_batch(), on_outcome)
    assert isinstance(outcomes.got[0], ActorGone)  # already there when send returned
    assert outcomes.threads == [threading.get_ident()] and seen_during_send == [1]


@pytest.mark.parametrize(
    "error, kind", [(ray.exceptions.RayActorError(), ActorGone), (TypeError("cannot serialize"), BatchFailed)]
)
def test_a_call_that_cannot_be_made_is_an_outcome_not_an_exception(error, kind):
    outcomes = Outcomes()
    RayLink(FakeHandle(raise_on_call=error)).send(*make_batch(), outcomes)
    assert isinstance(outcomes.one(), kind)


# the same-node channel, with Ray behind it


def run_batch(plan: BatchPlan, pixels: list[np.ndarray], output_device: str | None):
    """A fake encoder: each output row is the item's first pixel value; a NaN fails the item."""
    values, errors = [], {}
    for position, (spec, array) in enumerate(zip(plan.specs, pixels)):
        if np.isnan(array).any():
            values.append(None)
            errors[position] = "NaN pixels"
            continue
        first = float(array.reshape(-1)[0])
        values.append(
            Embedding.from_outputs([torch.full(shape, first) for shape in LAYOUT.shapes(spec.num_tokens)])
        )
    return values, BatchReceipt(OK, errors)


@pytest.fixture
def server():
    state = {"retiring": False, "broken": False}

    def serve(plan, pixels, output_device):
        if state["broken"]:
            raise RuntimeError("the encoder broke")
        if state["retiring"]:
            return [None] * len(plan.specs), BatchReceipt(RETIRED)
        return run_batch(plan, pixels, output_device)

    server = ChannelServer(serve, "links", None, 0.0, LAYOUT)
    server.state = state
    yield server
    server.close()


def assert_embeddings(values: list[Any], pixels: list[np.ndarray]) -> None:
    for value, array in zip(values, pixels, strict=True):
        assert isinstance(value, Embedding)
        assert [tuple(t.shape) for t in value.outputs] == LAYOUT.shapes(array.shape[0])
        assert all(torch.all(t == float(array.reshape(-1)[0])) for t in value.outputs)


@needs_channel
def test_a_channel_batch_is_done_with_embeddings(server):
    handle, outcomes = FakeHandle(), Outcomes()
    link = make_link(handle, server.info, 10.0, 0.0, "encoder actor 0")
    try:
        assert isinstance(link, ChannelLink) and link.is_local
        plan, pixels = make_batch(3)
        link.send(plan, pixels, outcomes)
        outcome = outcomes.one()
        assert isinstance(outcome, Done) and outcome.receipt.status == OK
        assert_embeddings(outcome.values, pixels)
        assert outcomes.threads[0] != threading.get_ident()  # from the connection's thread
        assert handle.calls == []  # Ray was not used
    finally:
        link.close()


@needs_channel
def test_an_inline_exchange_calls_back_in_the_carrying_thread(server):
    handle, outcomes = FakeHandle(), Outcomes()
    link = make_link(handle, server.info, 10.0, 0.0)
    try:
        plan, pixels = make_batch(2, seed=1)
        pixels[1][0, 0, 0, 0] = np.nan
        exchange = link.exchange(plan, pixels, outcomes)
        assert outcomes.got == []  # no I/O yet
        exchange.send()
        exchange.finish()
        outcome = outcomes.got[0]
        assert outcomes.threads == [threading.get_ident()]
        assert isinstance(outcome, Done) and outcome.receipt.item_errors == {1: "NaN pixels"}
        assert outcome.values[1] is None
        assert_embeddings(outcome.values[:1], pixels[:1])
    finally:
        link.close()


@needs_channel
@pytest.mark.parametrize("state, kind", [("retiring", Refused), ("broken", BatchFailed)])
def test_a_channel_batch_refused_or_failed(server, state, kind):
    server.state[state] = True
    handle, outcomes = FakeHandle(), Outcomes()
    link = make_link(handle, server.info, 10.0, 0.0)
    try:
        link.send(*make_batch(), outcomes)
        outcome = outcomes.one()
        assert isinstance(outcome, kind)
        if kind is BatchFailed:
            assert isinstance(outcome.error, RemoteBatchError) and "the encoder broke" in str(outcome.error)
        assert handle.calls == [] and link.is_local  # the channel is fine: nothing went through Ray
    finally:
        link.close()


@needs_channel
def test_references_go_through_ray_while_the_channel_is_up(server):
    handle, outcomes = FakeHandle(), Outcomes()
    link = make_link(handle, server.info, 10.0, 0.0)
    try:
        plan, pixels = make_batch()
        pixels[0] = FakeRef(Future())
        assert link.exchange(plan, pixels, outcomes) is None
        link.send(plan, pixels, outcomes)
        assert len(handle.calls) == 1 and link.is_local
    finally:
        link.close()


class BreakingServer:
    """A socket that takes each request and hangs up without answering (an actor whose channel
    broke, or that died mid-batch)."""

    def __init__(self) -> None:
        self.address = f"\0vitpool-test-breaking-{uuid.uuid4().hex}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(8)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with connection:
                connection.recv(1 << 16)

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()


@needs_channel
@pytest.mark.parametrize("how", ["hangs-up", "nothing-listens"])
@pytest.mark.parametrize("path", ["send", "exchange"])
def test_a_broken_channel_sends_this_and_later_batches_through_ray(caplog, how, path):
    breaking = BreakingServer()
    if how == "nothing-listens":
        breaking.close()
    handle, outcomes = FakeHandle(), Outcomes()
    link = make_link(handle, ChannelInfo(breaking.address, LAYOUT), 10.0, 0.0, "encoder actor 5")
    try:
        plan, pixels = make_batch()
        if path == "send":
            link.send(plan, pixels, outcomes)
        else:
            exchange = link.exchange(plan, pixels, outcomes)
            exchange.send()
            exchange.finish()
        for _ in range(100):  # the connection's thread resends it
            if handle.calls:
                break
            threading.Event().wait(0.05)
        ((sent_plan, sent_pixels, _),) = handle.calls  # the same batch, once, through Ray
        assert sent_plan is plan and sent_pixels == pixels
        assert outcomes.got == []  # not a failure: the Ray call decides
        handle.futures[0][-1].set_result(BatchReceipt(OK))
        assert isinstance(outcomes.one(), Done)

        assert not link.is_local
        assert link.exchange(plan, pixels, outcomes) is None
        link.send(plan, pixels, Outcomes())  # later batches go straight to Ray
        assert len(handle.calls) == 2
        warnings = [
            r for r in caplog.records if r.levelno == logging.WARNING and "through Ray" in r.getMessage()
        ]
        assert len(warnings) == 1 and "encoder actor 5" in warnings[0].getMessage()
    finally:
        link.close()
        breaking.close()


@needs_channel
def test_a_closed_link_sends_through_ray_without_a_warning(server, caplog):
    handle = FakeHandle()
    link = make_link(handle, server.info, 10.0, 0.0)
    link.close()
    link.send(*make_batch(), Outcomes())
    assert len(handle.calls) == 1 and not link.is_local
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_without_a_channel_the_link_is_a_ray_call():
    assert isinstance(make_link(FakeHandle(), None, 10.0, 0.0), RayLink)
