"""The dispatcher in one process, with fake same-node channels standing for actors: a silent
actor's batch times out and goes elsewhere, a full queue makes callers wait (or time out), and
the actor splits a batch that runs out of GPU memory."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest
import ray
import torch
from conftest import BUDGETS, image

from vitpool.actors import OK, BatchReceipt, EncoderActor
from vitpool.actors.local_channel import ChannelReply
from vitpool.items import Embedding
from vitpool.packing import ItemCost, make_budgets
from vitpool.pool.calls import Call, QueuedItem
from vitpool.pool.dispatcher import Dispatcher
from vitpool.pool.settings import PoolSettings


class FakeChannel:
    """Answers each batch after `delay_s` (never, if None) with each item's token count as a
    1x1 'embedding', so results show which item they belong to."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self.batches = 0

    def submit(self, items, on_reply) -> None:
        self.batches += 1
        if self.delay_s is None:
            return

        def answer() -> None:
            time.sleep(self.delay_s)
            values = [Embedding(torch.tensor([[float(tokens)]])) for _, _, tokens in items]
            on_reply(ChannelReply(values, BatchReceipt(OK)))

        threading.Thread(target=answer, daemon=True).start()

    def close(self) -> None:
        pass


class DeadActorHandle:
    """A Ray actor handle whose calls have already failed when they return, as Ray's do for an
    actor it knows is dead: the completion callback runs at once, in the sending thread."""

    def __init__(self) -> None:
        self.calls = 0
        self.encode_batch = self

    def options(self, num_returns: int):
        self._num_returns = num_returns
        return self

    def remote(self, metadata, *pixels):
        self.calls += 1
        failed: concurrent.futures.Future = concurrent.futures.Future()
        failed.set_exception(ray.exceptions.RayActorError())
        return [_DoneRef(failed) for _ in range(self._num_returns)]


class _DoneRef:
    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def future(self) -> concurrent.futures.Future:
        return self._future


def queued(call: Call, sizes: list[int]) -> list[QueuedItem]:
    return [
        QueuedItem(call, i, ItemCost(tokens, 1), False, (1, 2, 2 * tokens), "float32",
                   np.zeros((4 * tokens, 8), np.float32), 4 * tokens * 8 * 4)
        for i, tokens in enumerate(sizes)
    ]


def dispatcher(channels: dict[int, FakeChannel], failed: list[int], **settings) -> Dispatcher:
    budgets = make_budgets(BUDGETS, None, None)
    result = Dispatcher(budgets, PoolSettings(**settings), on_actor_failed=failed.append,
                        make_channel=lambda index: channels[index])
    result.set_actors({index: object() for index in channels}, budgets)
    return result


def test_a_silent_actors_batch_times_out_and_goes_to_another():
    channels = {0: FakeChannel(delay_s=None), 1: FakeChannel(delay_s=0.01)}
    failed: list[int] = []
    subject = dispatcher(channels, failed, batch_timeout_s=0.3, batch_window_s=0.0)
    try:
        calls = []
        for n in range(4):
            call = Call(2)
            subject.submit(call, queued(call, [3 + n, 5]))
            calls.append(call)
        for n, call in enumerate(calls):
            results = call.future.result(timeout=10)
            assert [float(r.tokens) for r in results] == [3 + n, 5]  # each call its own results, in order
        assert failed == [0]
        assert channels[0].batches >= 1
        assert subject.counters.timed_out_batches == channels[0].batches
        assert subject.counters.requeued_items > 0 and subject.counters.failed_calls == 0
    finally:
        subject.close()


def test_a_call_that_failed_before_its_callback_was_added_goes_to_another_actor():
    """Ray may fail a call to a dead actor before `_send` adds the completion callback, which then
    runs in the sending thread with the dispatcher's lock held; it used to deadlock there."""
    dead, failed = DeadActorHandle(), []
    budgets = make_budgets(BUDGETS, None, None)
    subject = Dispatcher(budgets, PoolSettings(batch_window_s=0.0), on_actor_failed=failed.append,
                         make_channel=lambda index: FakeChannel(delay_s=0.01) if index == 1 else None)
    subject.set_actors({0: dead, 1: object()}, budgets)  # actor 0 goes through Ray, and first
    try:
        call = Call(2)
        submitting = threading.Thread(target=subject.submit, args=(call, queued(call, [3, 5])), daemon=True)
        submitting.start()
        submitting.join(timeout=10)
        assert not submitting.is_alive(), "submit deadlocked"
        results = call.future.result(timeout=10)
        assert [float(r.tokens) for r in results] == [3, 5]
        assert dead.calls >= 1 and failed == [0]
        assert subject.counters.requeued_items >= 1 and subject.counters.failed_calls == 0
    finally:
        if not submitting.is_alive():  # closing a deadlocked dispatcher would hang the test run
            subject.close()


def test_a_full_queue_makes_callers_wait_then_time_out():
    channels = {0: FakeChannel(delay_s=None)}  # takes batches and never answers
    subject = dispatcher(channels, [], max_queued_items=4, max_batches_in_flight_per_actor=1,
                         batch_timeout_s=60, batch_window_s=0.0)
    try:
        first = Call(1)
        subject.submit(first, queued(first, [4]))  # in flight
        waiting = Call(4)
        subject.submit(waiting, queued(waiting, [4, 4, 4, 4]))  # fills the queue
        assert subject.queue_depth == 4
        late = Call(1)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="queue stayed full"):
            subject.submit(late, queued(late, [4]), timeout_s=0.2)
        assert 0.2 <= time.monotonic() - start < 2
        assert subject.queue_depth == 4 and subject.counters.peak_queued_items == 4
        with pytest.raises(ValueError, match="can never fit"):
            subject.submit(Call(5), queued(Call(5), [1] * 5))
        # room frees when the waiting call gives up: a blocked caller goes on
        unblocked = threading.Event()

        def blocked_caller() -> None:
            call = Call(1)
            subject.submit(call, queued(call, [4]), timeout_s=10)
            unblocked.set()

        thread = threading.Thread(target=blocked_caller)
        thread.start()
        time.sleep(0.2)
        assert not unblocked.is_set()
        subject.cancel(waiting, TimeoutError("caller gave up"))  # its items leave the queue
        thread.join(timeout=5)
        assert unblocked.is_set()
    finally:
        subject.close()


def test_the_actor_splits_a_batch_that_runs_out_of_gpu_memory(monkeypatch):
    actor = EncoderActor(0, None, BUDGETS, None, None, "float32", "cpu", num_threads=1, serve_channel=False)
    items = [image(4, 4 + 2 * n, torch.Generator().manual_seed(n)) for n in range(5)]
    expected = actor.encoder.encode(items)
    real = actor.encoder.encode_each

    def encode_each(batch, output_device=None):
        if len(batch) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(batch, output_device=output_device)

    monkeypatch.setattr(actor.encoder, "encode_each", encode_each)
    metadata = [(False, tuple(i.grid_thw), "float32") for i in items]
    values, receipt = actor.run_batch(metadata, [i.pixel_values.numpy() for i in items])
    assert receipt.status == OK and receipt.item_errors == {}
    for got, want in zip(values, expected, strict=True):  # alone, each runs in a smaller budget
        torch.testing.assert_close(got.tokens, want.tokens, rtol=1e-5, atol=1e-5)
    assert actor.stats().oom_splits == 4  # 5 -> 2 + 3 -> 1 + 1 + 1 + 2 -> 1 + 1
