"""Small first: small items are dispatched and run ahead of large ones, and large ones still run.

The policy and the combiner's choice of a run are pure, so most of this runs on plain values; the
dispatcher is driven with fake actor links, and the combiner with a run function that blocks.
"""

from __future__ import annotations

import dataclasses
import random
import time
import types

import numpy as np
import pytest
import torch
from conftest import BUDGETS
from test_combining import BlockingRun, run_while_blocked  # the same blocked-run harness

from vitpool.actors.combining import BatchCombiner, _Waiting, finished, small_first_group
from vitpool.items import Embedding
from vitpool.packing import make_budgets
from vitpool.pool.calls import Call, QueuedItem
from vitpool.pool.dispatcher import Dispatcher
from vitpool.pool.policy import ActorLoad, DispatchPolicy
from vitpool.pool.settings import PoolSettings
from vitpool.specs import ItemSpec
from vitpool.transport.link import OK, BatchReceipt, Done

LADDER = tuple(make_budgets([16, 64, 256], None, None))


def spec(tokens: int) -> ItemSpec:
    return ItemSpec("image", (4 * tokens, 8), "float32", (1, 2, 2 * tokens), tokens, (("sequences", 1),))


def small_first(small_tokens: int | None = 32, max_in_flight: int = 2) -> DispatchPolicy:
    return DispatchPolicy(LADDER, max_in_flight, small_tokens=small_tokens)


# the policy


def test_small_calls_items_are_packed_apart_from_other_calls_items():
    specs = [spec(200), spec(10), spec(40), spec(12), spec(8), spec(6)]
    small = [False, True, False, True, True, False]  # item 2 and 5: of a large call, however small
    # Without small first, first-fit packing puts the small items in the large item's gaps.
    assert any(len({small[i] for i in b.item_indices}) == 2 for b in small_first(None).plan(specs, small))
    batches = small_first(32).plan(specs, small)
    assert sorted(i for b in batches for i in b.item_indices) == list(range(len(specs)))
    for batch in batches:
        flags = {small[i] for i in batch.item_indices}
        assert len(flags) == 1  # small calls' items never share a batch with others'
        if flags == {True}:
            assert batch.num_tokens <= 32
    assert [min(b.item_indices) for b in batches] == sorted(
        min(b.item_indices) for b in batches
    )  # oldest first
    assert small_first(32).plan(specs) == small_first(None).plan(specs)  # no flags: as ever


def test_only_batches_of_small_calls_take_the_small_lane():
    policy = small_first(32)
    specs, small = [spec(20), spec(20), spec(10)], [True, False, True]
    batches = policy.plan(specs, small)
    lanes = {tuple(b.item_indices): policy.is_small(b, small) for b in batches}
    assert lanes == {(0, 2): True, (1,): False}  # item 1 is as small, but of a large call
    assert not any(small_first(None).is_small(b, small) for b in batches)


@pytest.mark.parametrize(
    "load, small, expected",
    [
        # both slots for any batch taken: a large batch waits, a small one takes the small lane
        (ActorLoad(in_flight=2), False, None),
        (ActorLoad(in_flight=2), True, 0),
        # the small lane full: a small batch takes a slot of the other lane, like any batch
        (ActorLoad(in_flight=2, small_in_flight=2), True, 0),
        (ActorLoad(in_flight=4, small_in_flight=2), True, None),
        # small batches in their lane take nothing from large ones
        (ActorLoad(in_flight=2, small_in_flight=2), False, 0),
    ],
)
def test_lanes(load, small, expected):
    assert small_first().choose_actor({0: load}, small) == expected


def test_a_small_batch_prefers_an_actor_whose_small_lane_has_room():
    policy = small_first()
    loads = {0: ActorLoad(in_flight=2, small_in_flight=2), 1: ActorLoad(in_flight=1, outstanding_cost=900.0)}
    assert policy.choose_actor(loads, small=True) == 1 and policy.takes_in_small_lane(loads[1], True)
    assert policy.choose_actor(loads, small=False) == 0  # least cost, as ever
    assert not policy.takes_in_small_lane(loads[0], True) and not policy.takes_in_small_lane(loads[1], False)


def test_without_small_first_there_is_one_lane():
    policy = small_first(None)
    assert policy.small_lane_slots == 0 and policy.free_small_slots({0: ActorLoad()}) == 0
    assert policy.choose_actor({0: ActorLoad(in_flight=2)}, small=True) is None
    assert policy.room(1, 0) == small_first(32).room(1, 0)


def test_the_plan_looks_past_large_items_while_the_small_lane_has_room():
    policy = small_first()
    assert policy.room(0, 0)[0] == 0
    assert policy.room(0, 2)[0] == 2 * 256  # two full batches' worth, to find small items behind large
    assert policy.room(1, 2)[0] == 3 * 256


# the dispatcher, with fake actors


class HeldLink:
    """An actor link that holds every batch until `answer_all`, then answers each item with its
    token count."""

    is_local = True

    def __init__(self) -> None:
        self.held: list[tuple] = []
        self.plans: list = []

    def send(self, plan, pixels, on_outcome) -> None:
        self.plans.append(plan)
        self.held.append((plan, on_outcome))

    def exchange(self, plan, pixels, on_outcome):
        return None

    def answer_all(self) -> None:
        held, self.held = self.held, []
        for plan, on_outcome in held:
            values = [Embedding(torch.tensor([[float(s.num_tokens)]])) for s in plan.specs]
            on_outcome(Done(values, BatchReceipt(OK)))

    def close(self) -> None:
        pass


def settings_with(small_first_tokens: int | None, **settings) -> PoolSettings:
    """PoolSettings with `small_first_tokens`, also before PoolSettings declares it."""
    if "small_first_tokens" in PoolSettings.__dataclass_fields__:
        return PoolSettings(small_first_tokens=small_first_tokens, **settings)
    base = PoolSettings(**settings)
    return types.SimpleNamespace(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
        small_first_tokens=small_first_tokens,
    )


def queued(call: Call, sizes: list[int]) -> list[QueuedItem]:
    return [
        QueuedItem(call, i, spec(tokens), np.zeros((4 * tokens, 8), np.float32), 4 * tokens * 8 * 4)
        for i, tokens in enumerate(sizes)
    ]


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


@pytest.mark.parametrize("small_first_tokens", [None, 32])
def test_a_small_call_is_not_held_behind_large_batches_in_flight(small_first_tokens):
    """Two large calls fill the actor's slots; a small call then goes at once with small first,
    and waits for them without it. A third large call waits either way."""
    link = HeldLink()
    budgets = make_budgets(BUDGETS, None, None)
    subject = Dispatcher(
        budgets,
        settings_with(small_first_tokens, batch_window_s=0.0, batch_timeout_s=60),
        on_actor_failed=lambda index: None,
        make_link=lambda index: link,
    )
    subject.set_actors([0], budgets)
    try:
        large = [Call(1) for _ in range(3)]
        subject.submit(large[0], queued(large[0], [200]))
        subject.submit(large[1], queued(large[1], [180]))
        assert wait_for(lambda: len(link.plans) == 2)
        small = Call(2)
        subject.submit(small, queued(small, [8, 12]))
        subject.submit(large[2], queued(large[2], [150]))

        def sent_tokens():
            return sorted(s.num_tokens for plan in link.plans for s in plan.specs)

        if small_first_tokens is None:
            time.sleep(0.1)  # what must not happen is given time to happen
            assert sent_tokens() == [180, 200] and subject.queue_depth == 3
        else:
            # waited for, not slept on: a loaded CI machine may take longer than 0.1 s to send
            assert wait_for(lambda: sent_tokens() == [8, 12, 180, 200] and subject.queue_depth == 1), (
                sent_tokens(),
                subject.queue_depth,
            )
            assert len(link.plans[-1].specs) == 2  # the small call's two items in one batch
        link.answer_all()  # frees the slots: what waited goes now
        assert wait_for(lambda: subject.queue_depth == 0 and len(link.held) >= 1)
        link.answer_all()
        link.answer_all()
        for call in (*large, small):
            assert call.future.result(timeout=5)
    finally:
        subject.close()


# the combiner


@pytest.mark.parametrize(
    "small_tokens, max_tokens, expected",
    [
        # strictly in order: the small batches wait for both large ones
        (None, 200, [["busy"], ["large1"], ["large2", "small1", "small2"]]),
        (None, 260, [["busy"], ["large1"], ["large2", "small1", "small2"]]),
        # small first; the others follow in order where they fit (here, none)
        (64, 200, [["busy"], ["small1", "small2"], ["large1"], ["large2"]]),
        # ... and here the oldest large one fills the small batches' run
        (64, 260, [["busy"], ["small1", "small2", "large1"], ["large2"]]),
    ],
)
def test_a_small_batch_queued_behind_large_ones_runs_first(small_tokens, max_tokens, expected):
    run = BlockingRun()
    combiner = BatchCombiner(finished(run), max_tokens=max_tokens, small_tokens=small_tokens)
    names, tokens = ["busy", "large1", "large2", "small1", "small2"], [10, 200, 150, 10, 40]
    outcomes = run_while_blocked(combiner, run, [([i], n, None) for i, n in enumerate(tokens)])
    assert outcomes == [[10 * i] for i in range(len(names))]  # each gets its own
    assert [[names[i] for i in items] for items, _ in run.runs] == expected


def waiting(name: str, tokens: int) -> _Waiting:
    return _Waiting([name], tokens, None)


def test_a_large_batch_is_passed_over_at_most_max_passes_times():
    """Small batches keep coming, two per run, and the large batch does not fit beside them: it
    still leads a run once it has been passed over `max_passes` times, and then the run goes in
    order (the small ones right behind it that fit go with it)."""
    for max_passes in (1, 4):
        queue = [waiting("large", 90)]
        runs = []
        for number in range(10):
            queue += [waiting(f"small{number}a", 8), waiting(f"small{number}b", 8)]
            group = small_first_group(queue, max_tokens=100, small_tokens=16, max_passes=max_passes)
            queue = [w for w in queue if w not in group]
            runs.append([w.items[0] for w in group])
            if "large" in runs[-1]:
                break
        assert len(runs) == max_passes + 1
        assert runs[-1] == ["large", f"small{max_passes}a"]  # in order, as far as 100 tokens go
        assert all(len(run) == 2 and "large" not in run for run in runs[:-1])  # small runs before
    # Without the bound, it would wait as long as small batches come (too large to fill a run beside one).
    queue = [waiting("large", 95)]
    for number in range(10):
        queue += [waiting(f"small{number}", 8)]
        group = small_first_group(queue, max_tokens=100, small_tokens=16, max_passes=10**6)
        queue = [w for w in queue if w not in group]
    assert [w.items[0] for w in queue] == ["large"]


def test_a_small_batch_larger_than_a_run_runs_alone():
    """A run's token cap below the small bound (a small pool's budgets): a small batch over the
    cap still runs, alone, as any batch over the cap does."""
    queue = [waiting("large", 90), waiting("small", 12), waiting("tiny", 4)]
    group = small_first_group(queue, max_tokens=8, small_tokens=16, max_passes=4)
    assert [w.items[0] for w in group] == ["small"]


def test_small_first_cuts_small_batches_waits_in_a_simulated_stream():
    """A discrete-event model of one actor: one run at a time, a run's time its tokens plus a
    fixed cost, Poisson arrivals of a mix of batch sizes at about 70% load. Against strict order,
    small first cuts the small batches' worst and mean wait, lets no batch be passed over more
    than `max_passes` times, and costs little more device time."""

    def simulate(small_tokens: int | None) -> tuple[dict[str, list[float]], float, int]:
        rng = random.Random(3)
        arrivals, now = [], 0.0
        for _ in range(3000):
            now += rng.expovariate(1 / 9.0)
            arrivals.append((now, rng.choice([32, 64, 200, 600, 900, 1000])))
        combiner_waiting: list[_Waiting] = []
        waits: dict[str, list[float]] = {"small": [], "large": []}
        clock, busy, most_passes, position = 0.0, 0.0, 0, 0
        while position < len(arrivals) or combiner_waiting:
            while position < len(arrivals) and arrivals[position][0] <= clock:
                batch = waiting(str(position), arrivals[position][1])
                batch.arrived = arrivals[position][0]
                combiner_waiting.append(batch)
                position += 1
            if not combiner_waiting:
                clock = arrivals[position][0]
                continue
            if small_tokens is None:
                group, tokens = [combiner_waiting[0]], combiner_waiting[0].tokens
                for w in combiner_waiting[1:]:
                    if tokens + w.tokens > 1024:
                        break
                    group.append(w)
                    tokens += w.tokens
            else:
                group = small_first_group(combiner_waiting, 1024, small_tokens, max_passes=4)
            most_passes = max([most_passes] + [w.passes for w in group])
            combiner_waiting = [w for w in combiner_waiting if w not in group]
            for w in group:
                waits["small" if w.tokens <= 64 else "large"].append(clock - w.arrived)
            busy += 2.0 + 0.0135 * sum(w.tokens for w in group)
            clock += 2.0 + 0.0135 * sum(w.tokens for w in group)
        return waits, busy, most_passes

    fifo, fifo_busy, _ = simulate(None)
    mine, my_busy, most_passes = simulate(64)
    assert max(mine["small"]) < 0.5 * max(fifo["small"])
    assert np.mean(mine["small"]) < 0.5 * np.mean(fifo["small"])
    assert most_passes <= 4
    assert my_busy < 1.05 * fifo_busy  # small runs of their own cost their fixed cost, little more
    assert np.percentile(mine["large"], 99) < 1.5 * np.percentile(fifo["large"], 99)  # large pay a little


def test_the_urgent_lane_settings_are_checked_and_reach_the_encoder(tiny_adapter):
    from conftest import make_encoder

    from vitpool.errors import ConfigError

    assert PoolSettings(urgent_tokens=128).encoder_spec().urgent_tokens == 128
    assert PoolSettings().encoder_spec().urgent_tokens is None  # off by default, for now
    with pytest.raises(ConfigError, match="urgent_tokens"):
        PoolSettings(urgent_tokens=0)
    # its pool setting in 0.1.0, removed since: refused, naming what replaced it
    with pytest.raises(ConfigError, match="small_first_stream was removed .*: use urgent_tokens=N"):
        PoolSettings(small_first_stream=True)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ConfigError, match="urgent_tokens"):
            make_encoder(tiny_adapter, [16, 64], urgent_tokens=bad)


def test_on_a_cpu_an_urgent_batch_runs_as_any_batch(tiny_adapter):
    """The urgent lane is a GPU's (a second stream); on a CPU the encoder has none, and a batch
    sent to it runs in the one lane, with the same outputs."""
    from conftest import assert_same, image, make_encoder, plan_batch, video

    encoder = make_encoder(tiny_adapter, [16, 64], urgent_tokens=16)
    assert not encoder.has_urgent_lane and encoder.urgent_budgets == frozenset()
    items = [image(2, 2), video(2, 2, 2)]
    plan, pixels = plan_batch(items, encoder.adapter.item_rules, encoder.budgets)
    [outcomes] = encoder.start_plans(
        [(plan, [torch.from_numpy(p) for p in pixels])], "cpu", urgent=True
    ).result()
    assert_same(outcomes, encoder.encode(items))
