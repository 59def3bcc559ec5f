"""The dispatch policy on its own: plain specs and fake actor loads, no Ray, no threads."""

from __future__ import annotations

import pytest

from vitpool.packing import make_budgets
from vitpool.pool.policy import ActorLoad, DispatchPolicy
from vitpool.specs import ItemSpec


def spec(tokens: int, frames: int = 1) -> ItemSpec:
    return ItemSpec(
        "image" if frames == 1 else "video",
        (4 * tokens, 8),
        "float32",
        (frames, 2, 2 * tokens // frames),
        tokens,
        (("sequences", frames),),
    )


@pytest.fixture
def policy() -> DispatchPolicy:
    return DispatchPolicy(tuple(make_budgets([16, 64, 256], None, None)), max_in_flight=2)


@pytest.mark.parametrize(
    "loads, expected",
    [
        # the least outstanding cost wins
        (
            {
                0: ActorLoad(in_flight=1, outstanding_cost=300.0),
                1: ActorLoad(in_flight=1, outstanding_cost=100.0),
            },
            1,
        ),
        # a tie goes to the lowest index
        ({2: ActorLoad(), 1: ActorLoad(), 3: ActorLoad()}, 1),
        # an actor with no free slot is skipped, however idle it looks by cost
        (
            {
                0: ActorLoad(in_flight=2, outstanding_cost=0.0),
                1: ActorLoad(in_flight=1, outstanding_cost=900.0),
            },
            1,
        ),
        # an actor that is leaving takes nothing
        ({0: ActorLoad(accepting=False), 1: ActorLoad(in_flight=1, outstanding_cost=50.0)}, 1),
        # no room anywhere
        ({0: ActorLoad(in_flight=2), 1: ActorLoad(accepting=False)}, None),
        # no actors
        ({}, None),
    ],
)
def test_choose_actor(policy, loads, expected):
    assert policy.choose_actor(loads) == expected


def test_free_slots_and_idle_actors(policy):
    loads = {0: ActorLoad(in_flight=1), 1: ActorLoad(in_flight=0), 2: ActorLoad(accepting=False)}
    assert policy.free_slots(loads) == 1 + 2  # the leaving actor's slots do not count
    assert policy.has_idle_actor(loads)
    loads[1].in_flight = 2
    assert not policy.has_idle_actor(loads)


def test_plan_packs_small_items_together_oldest_batch_first(policy):
    specs = [spec(200), spec(10), spec(12), spec(100), spec(9)]
    batches = policy.plan(specs)
    assert sorted(i for b in batches for i in b.item_indices) == list(range(len(specs)))
    assert [min(b.item_indices) for b in batches] == sorted(min(b.item_indices) for b in batches)
    for batch in batches:
        assert batch.budget is not None and batch.num_tokens <= batch.budget.num_tokens
    assert len(batches) < len(specs)  # some items share a batch


def test_max_tokens_per_run_caps_shared_batches():
    capped = DispatchPolicy(tuple(make_budgets([16, 64, 256], None, None)), 2, max_tokens_per_run=64)
    batches = capped.plan([spec(40), spec(40), spec(40), spec(200)])
    for batch in batches:
        assert len(batch.item_indices) == 1 or batch.num_tokens <= 64
    assert any(b.item_indices == (3,) for b in batches)  # larger than the cap: alone


def test_cost_counts_the_budget_not_the_items(policy):
    [small] = policy.plan([spec(10)])
    [padded] = policy.plan([spec(60)])
    assert small.budget.num_tokens == 16 and padded.budget.num_tokens == 64
    assert policy.cost(padded) > policy.cost(small)
    [video] = policy.plan([spec(240, frames=8)])
    [image] = policy.plan([spec(240)])
    assert policy.cost(image) > policy.cost(video)  # one long sequence: attention's quadratic term


def test_room_bounds_how_much_of_a_queue_is_planned(policy):
    tokens, items = policy.room(free_slots=3)
    assert tokens == 3 * 256 and items == 3 * max(policy.budgets).max_items


def test_ties_go_to_an_order_of_each_dispatchers_own():
    """Callers see only their own batches: with one tie order for all, every caller would send its
    first batches to the same actor of an idle pool."""
    budgets = tuple(make_budgets([16, 64, 256], None, None))
    idle = {index: ActorLoad() for index in range(8)}
    firsts = set()
    for seed in range(40):
        policy = DispatchPolicy(budgets, max_in_flight=2, tie_seed=seed)
        first = policy.choose_actor(idle)
        assert all(policy.choose_actor(idle) == first for _ in range(3))  # one order per dispatcher
        firsts.add(first)
    assert len(firsts) >= 6
    # cost still decides first
    policy = DispatchPolicy(budgets, max_in_flight=2, tie_seed=7)
    busy = {index: ActorLoad(in_flight=1, outstanding_cost=50.0) for index in range(8)}
    assert policy.choose_actor({**busy, 5: ActorLoad()}) == 5


def test_among_idle_actors_the_one_sent_a_batch_least_recently_wins():
    """A caller whose calls come one at a time finds every actor idle each time: the calls go
    round the actors, so an actor that joins (a standby that took over a dead actor's GPU, a
    scale-up) gets work at once instead of never (tests/gpu/test_standby_gpu.py)."""
    budgets = tuple(make_budgets([16, 64, 256], None, None))
    policy = DispatchPolicy(budgets, max_in_flight=2, tie_seed=3)
    loads = {index: ActorLoad() for index in range(3)}
    chosen = []
    for sent in range(1, 7):
        index = policy.choose_actor(loads)
        chosen.append(index)
        loads[index].last_sent = sent  # answered before the next call: idle again
    assert sorted(chosen[:3]) == [0, 1, 2] and chosen[3:] == chosen[:3]
    loads[7] = ActorLoad()  # joins: never sent a batch
    assert policy.choose_actor(loads) == 7
    # cost still decides first
    loads[7] = ActorLoad(in_flight=1, outstanding_cost=10.0)
    assert policy.choose_actor(loads) != 7
