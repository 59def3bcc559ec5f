"""The dispatcher in one process, with fake actor links standing for actors: a silent actor's batch
times out and goes elsewhere, an actor known dead at send time does not deadlock it, a full queue
makes callers wait (or time out), and the plan an actor gets is the dispatcher's packing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conftest import BUDGETS

from vitpool.errors import PoolUnavailableError
from vitpool.items import Embedding
from vitpool.packing import make_budgets
from vitpool.pool.calls import Call, QueuedItem
from vitpool.pool.dispatcher import Dispatcher
from vitpool.pool.settings import PoolSettings
from vitpool.specs import BatchPlan, ItemSpec
from vitpool.transport.link import OK, ActorGone, BatchReceipt, Done, Refused


class FakeLink:
    """An actor link that answers each batch after `delay_s` (never, if None) with each item's
    token count as a 1x1 'embedding', so results show which item they belong to."""

    is_local = True

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self.batches = 0
        self.plans: list[BatchPlan] = []

    def send(self, plan, pixels, on_outcome) -> None:
        self.batches += 1
        self.plans.append(plan)
        assert len(pixels) == len(plan.specs)
        if self.delay_s is None:
            return

        def answer() -> None:
            time.sleep(self.delay_s)
            values = [Embedding(torch.tensor([[float(spec.num_tokens)]])) for spec in plan.specs]
            on_outcome(Done(values, BatchReceipt(OK)))

        threading.Thread(target=answer, daemon=True).start()

    def exchange(self, plan, pixels, on_outcome):
        return None

    def close(self) -> None:
        pass


class DeadLink(FakeLink):
    """A link to an actor already known dead: the outcome comes at once, in the sending thread,
    as Ray's does when it fails a call before its completion callback is added."""

    is_local = False

    def __init__(self) -> None:
        super().__init__(None)

    def send(self, plan, pixels, on_outcome) -> None:
        self.batches += 1
        on_outcome(ActorGone("the actor died"))


def queued(call: Call, sizes: list[int]) -> list[QueuedItem]:
    return [
        QueuedItem(
            call,
            i,
            ItemSpec("image", (4 * tokens, 8), "float32", (1, 2, 2 * tokens), tokens, (("sequences", 1),)),
            np.zeros((4 * tokens, 8), np.float32),
            4 * tokens * 8 * 4,
        )
        for i, tokens in enumerate(sizes)
    ]


def dispatcher(links: dict[int, FakeLink], failed: list[int], **settings) -> Dispatcher:
    budgets = make_budgets(BUDGETS, None, None)
    result = Dispatcher(
        budgets,
        PoolSettings(**settings),
        on_actor_failed=failed.append,
        make_link=links.__getitem__,
        ties_in_own_order=False,
    )  # the tests name which actor goes first
    result.set_actors(list(links), budgets)
    return result


def test_a_silent_actors_batch_times_out_and_goes_to_another():
    channels = {0: FakeLink(delay_s=None), 1: FakeLink(delay_s=0.01)}
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
    """Ray may fail a call to a dead actor before the link adds the completion callback, which then
    runs in the sending thread with the dispatcher's lock held; it used to deadlock there."""
    dead, failed = DeadLink(), []
    subject = dispatcher({0: dead, 1: FakeLink(delay_s=0.01)}, failed, batch_window_s=0.0)  # actor 0 first
    try:
        call = Call(2)
        submitting = threading.Thread(target=subject.submit, args=(call, queued(call, [3, 5])), daemon=True)
        submitting.start()
        submitting.join(timeout=10)
        assert not submitting.is_alive(), "submit deadlocked"
        results = call.future.result(timeout=10)
        assert [float(r.tokens) for r in results] == [3, 5]
        assert dead.batches >= 1 and failed == [0]
        assert subject.counters.requeued_items >= 1 and subject.counters.failed_calls == 0
    finally:
        if not submitting.is_alive():  # closing a deadlocked dispatcher would hang the test run
            subject.close()


def test_a_full_queue_makes_callers_wait_then_time_out():
    channels = {0: FakeLink(delay_s=None)}  # takes batches and never answers
    # one lane: these 4-token calls would be small and go in the small lane's slots
    subject = dispatcher(
        channels,
        [],
        max_queued_items=4,
        max_batches_in_flight_per_actor=1,
        batch_timeout_s=60,
        batch_window_s=0.0,
        small_first_tokens=None,
    )
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
        assert subject.queue_depth == 4 and subject.peak_queued[0] == 4
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
        assert not unblocked.wait(0.2)  # still blocked after a while
        subject.cancel(waiting, TimeoutError("caller gave up"))  # its items leave the queue
        thread.join(timeout=5)
        assert unblocked.is_set()
    finally:
        subject.close()


def test_the_plan_the_actor_gets_is_the_dispatchers_packing():
    """One batch plan end to end: the link gets the specs the caller computed, in a budget that
    holds them, and small items of concurrent calls share a batch."""
    link = FakeLink(delay_s=0.05)
    subject = dispatcher({0: link}, [], batch_window_s=0.05, max_batches_in_flight_per_actor=1)
    try:
        calls = [Call(2) for _ in range(3)]
        for n, call in enumerate(calls):
            subject.submit(call, queued(call, [2 + n, 3]))
        for n, call in enumerate(calls):
            assert [float(r.tokens) for r in call.future.result(timeout=10)] == [2 + n, 3]
        sent = [spec for plan in link.plans for spec in plan.specs]
        assert sorted(spec.num_tokens for spec in sent) == [2, 3, 3, 3, 3, 4]
        for plan in link.plans:
            assert plan.budget is not None and plan.num_tokens <= plan.budget.num_tokens
            assert len(plan.specs) <= plan.budget.max_items
        # the first call went alone to the idle actor; the two that waited behind it shared one batch
        assert len(link.plans) == 2 and len(link.plans[1].specs) == 4
    finally:
        subject.close()


class InlineLink(FakeLink):
    """A link whose batches the calling thread carries (`exchange`): `finish` answers in that
    thread, or reports the actor gone."""

    def __init__(self, gone: bool = False) -> None:
        super().__init__(delay_s=0.0)
        self.gone = gone
        self.finished_in: list[str] = []

    def exchange(self, plan, pixels, on_outcome):
        link = self

        class Exchange:
            def send(self) -> None:
                link.batches += 1
                link.plans.append(plan)

            def finish(self) -> None:
                link.finished_in.append(threading.current_thread().name)
                if link.gone:
                    on_outcome(ActorGone("the connection dropped and the actor is dead"))
                    return
                values = [Embedding(torch.tensor([[float(spec.num_tokens)]])) for spec in plan.specs]
                on_outcome(Done(values, BatchReceipt(OK), through_channel=True))

        return Exchange()


def test_a_caller_carries_its_own_batch_inline():
    link = InlineLink()
    subject = dispatcher({0: link}, [], batch_window_s=0.0)
    try:
        call = Call(2)
        subject.submit(call, queued(call, [3, 5]), inline=True)
        assert call.done  # answered before submit returned: this thread carried the batch
        assert [float(r.tokens) for r in call.future.result(timeout=0)] == [3, 5]
        assert link.finished_in == [threading.current_thread().name]
        assert subject.counters.channel_batches == 1
    finally:
        subject.close()


def test_an_inline_batch_whose_actor_is_gone_goes_to_another():
    failed: list[int] = []
    gone, alive = InlineLink(gone=True), FakeLink(delay_s=0.01)
    subject = dispatcher({0: gone, 1: alive}, failed, batch_window_s=0.0)
    try:
        call = Call(2)
        subject.submit(call, queued(call, [3, 5]), inline=True)
        assert [float(r.tokens) for r in call.future.result(timeout=10)] == [3, 5]
        assert failed == [0] and gone.batches >= 1 and alive.batches >= 1
        assert subject.counters.requeued_items >= 1 and subject.counters.failed_calls == 0
    finally:
        subject.close()


def test_a_batch_that_comes_back_after_close_fails_its_call():
    """Nothing dispatches after close: an item that would be sent again fails instead of waiting."""
    link = FakeLink(delay_s=None)
    subject = dispatcher({0: link}, [], batch_window_s=0.0)
    call = Call(1)
    subject.submit(call, queued(call, [4]))
    [flight] = list(subject._flights)
    subject.close()
    subject._on_outcome(flight, Refused("leaving"))
    with pytest.raises(PoolUnavailableError, match="closed"):
        call.future.result(timeout=5)


def test_calls_one_at_a_time_go_round_the_actors_and_reach_one_that_joins():
    links = {0: FakeLink(delay_s=0.0), 1: FakeLink(delay_s=0.0)}
    failed: list[int] = []
    subject = dispatcher(links, failed, batch_window_s=0.0)
    try:
        for n in range(6):
            call = Call(1)
            subject.submit(call, queued(call, [3 + n]))
            assert [float(r.tokens) for r in call.future.result(timeout=10)] == [3 + n]
        assert links[0].batches == 3 and links[1].batches == 3
        links[2] = FakeLink(delay_s=0.0)  # e.g. a standby took over a dead actor's GPU
        subject.set_actors(list(links), make_budgets(BUDGETS, None, None))
        call = Call(1)
        subject.submit(call, queued(call, [4]))
        call.future.result(timeout=10)
        assert links[2].batches == 1
    finally:
        subject.close()
