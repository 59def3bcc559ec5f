"""The dispatcher's bounded queue on its own."""

from __future__ import annotations

import threading

import numpy as np

from vitpool.pool.calls import Call, QueuedItem
from vitpool.pool.item_queue import ItemQueue
from vitpool.specs import ItemSpec


def items(call: Call, tokens: list[int], nbytes: int = 100) -> list[QueuedItem]:
    return [
        QueuedItem(call, i, ItemSpec("image", (4 * n, 8), "float32", (1, 2, 2 * n), n), np.zeros(1), nbytes)
        for i, n in enumerate(tokens)
    ]


def queue(max_items: int = 4, max_bytes: int = 1000) -> ItemQueue:
    return ItemQueue(max_items, max_bytes, threading.Condition())


def test_bounds_and_peaks():
    subject = queue()
    assert subject.has_room(4, 400) and not subject.has_room(5, 100) and not subject.has_room(1, 1001)
    assert not subject.can_ever_hold(5, 10) and subject.can_ever_hold(4, 1000)
    subject.push(items(Call(3), [1, 2, 3]))
    assert len(subject) == 3 and subject.nbytes == 300 and not subject.has_room(2, 100)
    subject.push(items(Call(2), [5, 6]), front=True)  # items sent again: accepted, past the bound
    assert len(subject) == 5 and subject.oldest().spec.num_tokens == 5
    assert (subject.peak_items, subject.peak_bytes) == (5, 500)


def test_take_is_oldest_first_within_the_room_and_drops_finished_calls():
    room = threading.Condition()  # the dispatcher's lock: held around every call
    subject = ItemQueue(10, 1000, room)
    done, live = Call(2), Call(3)
    with room:
        subject.push(items(done, [7, 7]))
        subject.push(items(live, [4, 4, 4]))
        done.fail(TimeoutError("caller gave up"))
        taken = subject.take(token_room=8, item_room=10)  # the finished call's items leave on the way
        assert [(item.call, item.spec.num_tokens) for item in taken] == [(live, 4), (live, 4)]
        assert len(subject) == 1 and subject.nbytes == 100
        assert [item.spec.num_tokens for item in subject.take(token_room=1, item_room=10)] == [
            4
        ]  # the first goes


def test_room_is_signalled_when_items_leave():
    room = threading.Condition()
    subject = ItemQueue(2, 1000, room)
    call = Call(2)
    subject.push(items(call, [1, 1]))
    woken = threading.Event()

    def waiter() -> None:
        with room:
            room.wait_for(lambda: subject.has_room(1, 100), timeout=5)
            woken.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    call.fail(TimeoutError("caller gave up"))
    with room:
        subject.drop_finished_calls()
    thread.join(timeout=5)
    assert woken.is_set() and len(subject) == 0 and subject.nbytes == 0
