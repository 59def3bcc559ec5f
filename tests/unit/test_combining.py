"""The actor's batch combiner: batches that wait run together, oldest first, each gets its own."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch
from conftest import BUDGETS, assert_same, image, plan_batch, send_concurrently, video

from vitpool import EncodeError, Image, InvalidItemError
from vitpool.actors.combining import BatchCombiner, finished
from vitpool.actors.encoder_actor import EncoderActor
from vitpool.encoder_spec import ActorSpec, EncoderSpec
from vitpool.specs import BatchPlan
from vitpool.transport.link import OK, RETIRED


def cpu_actor(**settings) -> EncoderActor:
    spec = ActorSpec(
        EncoderSpec(budgets=tuple(BUDGETS), dtype="float32", device="cpu"), serve_channel=False, **settings
    )
    return EncoderActor(0, spec)


class BlockingRun:
    """A run function whose first run waits until released, so that others queue behind it.
    Each item's outcome is the item times ten; every run's items and key are recorded."""

    def __init__(self) -> None:
        self.runs: list[tuple[list[int], object]] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, items: list[int], key: object) -> list[int]:
        self.runs.append((list(items), key))
        if len(self.runs) == 1:
            self.started.set()
            assert self.release.wait(10)
        if -1 in items:
            raise RuntimeError("bad batch")
        return [10 * item for item in items]


def run_while_blocked(
    combiner: BatchCombiner, run: BlockingRun, batches: list[tuple[list[int], int, object]]
) -> list:
    """Start batch 0, queue the rest in order behind it, release; each batch's outcome or error."""
    outcomes: list = [None] * len(batches)

    def call(index: int) -> None:
        items, tokens, key = batches[index]
        try:
            outcomes[index] = combiner(items, tokens, key)
        except RuntimeError as error:
            outcomes[index] = error

    threads = [threading.Thread(target=call, args=(0,))]
    threads[0].start()
    assert run.started.wait(10)
    for index in range(1, len(batches)):
        threads.append(threading.Thread(target=call, args=(index,)))
        threads[-1].start()
        deadline = time.monotonic() + 10
        while len(combiner._waiting) < index and time.monotonic() < deadline:  # queued in this order
            time.sleep(0.001)
        assert len(combiner._waiting) == index
    run.release.set()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()
    return outcomes


def test_an_idle_combiner_runs_a_batch_at_once_in_the_callers_thread():
    seen_threads = []
    combiner = BatchCombiner(
        finished(lambda items, key: seen_threads.append(threading.get_ident()) or [i + 1 for i in items]), 100
    )
    assert combiner([1, 2, 3], 3) == [2, 3, 4]
    assert seen_threads == [threading.get_ident()]
    assert combiner.counters.runs == 1 and combiner.counters.combined_batches == 0


def test_batches_that_wait_run_together_in_order_and_each_gets_its_own():
    run = BlockingRun()
    combiner = BatchCombiner(finished(run), max_tokens=100)
    batches = [([0], 5, None), ([1, 2], 10, None), ([3], 5, None), ([4, 5, 6], 15, None)]
    outcomes = run_while_blocked(combiner, run, batches)
    assert outcomes == [[0], [10, 20], [30], [40, 50, 60]]
    assert [items for items, _ in run.runs] == [[0], [1, 2, 3, 4, 5, 6]]
    assert combiner.counters.runs == 2 and combiner.counters.combined_batches == 3


def test_a_run_takes_waiting_batches_only_up_to_the_token_limit_and_never_skips_one():
    run = BlockingRun()
    combiner = BatchCombiner(finished(run), max_tokens=20)
    # 10 + 10 fit; 15 does not fit beside them and starts the next run; 30 is over the limit alone.
    batches = [
        ([0], 1, None),
        ([1], 10, None),
        ([2], 10, None),
        ([3], 15, None),
        ([4], 30, None),
        ([5], 1, None),
    ]
    outcomes = run_while_blocked(combiner, run, batches)
    assert outcomes == [[0], [10], [20], [30], [40], [50]]
    assert [items for items, _ in run.runs] == [[0], [1, 2], [3], [4], [5]]


def test_batches_with_different_keys_do_not_share_a_run():
    run = BlockingRun()
    combiner = BatchCombiner(finished(run), max_tokens=100)
    batches = [([0], 1, "cpu"), ([1], 1, "cpu"), ([2], 1, None), ([3], 1, None), ([4], 1, "cpu")]
    outcomes = run_while_blocked(combiner, run, batches)
    assert outcomes == [[0], [10], [20], [30], [40]]
    assert run.runs == [([0], "cpu"), ([1], "cpu"), ([2, 3], None), ([4], "cpu")]


def test_an_error_reaches_every_batch_of_its_run_and_no_other():
    run = BlockingRun()
    combiner = BatchCombiner(finished(run), max_tokens=3)
    batches = [([0], 1, None), ([1], 1, None), ([-1], 1, None), ([2], 2, None)]
    outcomes = run_while_blocked(combiner, run, batches)
    assert outcomes[0] == [0] and outcomes[3] == [20]
    assert isinstance(outcomes[1], RuntimeError) and isinstance(outcomes[2], RuntimeError)
    assert combiner([7], 1) == [70]  # still usable


@pytest.mark.parametrize("overlap_runs", [True, False])
def test_concurrent_actor_batches_equal_the_encoders_own_results(overlap_runs):
    """Sixteen threads send batches to one in-process actor at once: batches combine, and each
    thread gets exactly its own items' embeddings, whether runs overlap or not."""
    actor = cpu_actor(overlap_runs=overlap_runs)
    generator = torch.Generator().manual_seed(7)
    batches = [[image(2 * h, 2 * w, generator) for h, w in ((1, 1 + n % 3), (2, 1))] for n in range(16)]
    wanted = [actor.encoder.encode(batch) for batch in batches]
    got = send_concurrently(actor, batches)
    for (values, receipt), want in zip(got, wanted, strict=True):
        assert receipt.status == OK and receipt.item_errors == {}
        assert_same(values, want)
    stats = actor.stats()
    assert stats.batches == 16 and stats.runs <= 16
    assert stats.runs + stats.combined_batches >= 16  # every batch ran alone or combined


@pytest.mark.parametrize("max_tokens", [1, 1000])
def test_an_oversized_batch_still_runs_alone(max_tokens):
    combiner = BatchCombiner(finished(lambda items, key: [i * 2 for i in items]), max_tokens)
    assert combiner([1, 2], 500) == [2, 4]


def test_many_threads_get_their_own_outcomes_and_runs_never_overlap():
    """A stress test of the hand-over between leading threads: runs are checked for overlap, and
    every call for its own outcomes."""
    active, overlaps = [0], [0]
    lock = threading.Lock()

    def run(items: list[int], key: object) -> list[int]:
        with lock:
            active[0] += 1
            overlaps[0] += active[0] > 1
        time.sleep(0.0005 * (len(items) % 3))
        with lock:
            active[0] -= 1
        return [item + 1 for item in items]

    combiner = BatchCombiner(finished(run), max_tokens=6)
    failures: list[str] = []

    def caller(number: int) -> None:
        for call in range(60):
            items = [number * 1000 + call * 10 + k for k in range(1 + (number + call) % 3)]
            if combiner(items, len(items)) != [item + 1 for item in items]:
                failures.append(f"caller {number} call {call}")

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures and overlaps[0] == 0
    assert combiner.counters.combined_batches > 0  # eight threads did make batches wait together


@pytest.fixture(scope="module")
def actor():
    return cpu_actor()


def test_a_planned_batch_through_ray_s_method_equals_the_encoder(actor, reference_encoder):
    items = [image(4, 6), video(2, 4, 4), image(40, 36)]  # the last is larger than every budget: eager
    plan, pixels = plan_batch(items[:2], actor.encoder.adapter.item_rules, actor.encoder.budgets)
    *values, receipt = actor.encode_batch(plan, *pixels)
    assert receipt.status == OK and receipt.item_errors == {}
    assert_same(values, reference_encoder.encode(items[:2]))
    oversized, oversized_pixels = plan_batch(
        items[2:], actor.encoder.adapter.item_rules, actor.encoder.budgets
    )
    assert oversized.budget is None
    *values, receipt = actor.encode_batch(oversized, *oversized_pixels)
    assert_same(values, reference_encoder.encode(items[2:]))


def test_bf16_pixels_travel_as_int16_and_a_bad_item_fails_alone(actor, reference_encoder):
    good = image(4, 4, torch.Generator().manual_seed(1))
    bad = image(2, 2)
    bad.pixel_values[1, 5] = float("nan")
    items = [Image(good.pixel_values.bfloat16(), good.grid_thw), bad]
    plan, pixels = plan_batch(items, actor.encoder.adapter.item_rules, actor.encoder.budgets)
    assert plan.specs[0].pixel_dtype == "bfloat16" and pixels[0].dtype.name == "int16"
    values, receipt = actor.run_batch(plan, pixels)
    assert values[1] is None and "NaN" in receipt.item_errors[1] and list(receipt.item_errors) == [1]
    want = reference_encoder.encode([Image(good.pixel_values.bfloat16().float(), good.grid_thw)])
    assert_same(values[:1], want)


# (how the plan is broken, words of the batch's ValueError)
BROKEN_PLANS = {
    "pixels unlike the spec": (lambda plan, pixels: (plan, [pixels[0][:-4]]), "its spec says"),
    "one array missing": (lambda plan, pixels: (plan, []), "a batch plan of 1 item came with 0 pixel arrays"),
    # 16 rows that claim a 2x2 grid and one token: the next item's rows would be read as this one's
    "a spec that lies about its grid": (
        lambda plan, pixels: (
            BatchPlan(plan.budget, (replace(plan.specs[0], layout=(1, 2, 2), num_tokens=1),)),
            pixels,
        ),
        "not what the model's rules make of it",
    ),
    "a layout of the wrong length": (
        lambda plan, pixels: (BatchPlan(plan.budget, (replace(plan.specs[0], layout=(1, 4)),)), pixels),
        "not what the model's rules make of it",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN_PLANS))
def test_a_plan_that_does_not_match_fails_the_batch(actor, name):
    breaks, words = BROKEN_PLANS[name]
    plan, pixels = plan_batch([image(4, 4)], actor.encoder.adapter.item_rules, actor.encoder.budgets)
    runs_before = actor.stats().runs
    with pytest.raises(ValueError, match=words):
        actor.run_batch(*breaks(plan, pixels))
    assert actor.stats().runs == runs_before  # refused before it could share a run with other batches
    values, receipt = actor.run_batch(plan, pixels)  # still serves
    assert receipt.status == OK and values[0] is not None


def test_concatenated_outputs_for_ranks(actor, reference_encoder):
    items = [image(4, 6), video(2, 4, 4), image(2, 2)]
    plan, pixels = plan_batch(items, actor.encoder.adapter.item_rules, actor.encoder.budgets)
    arrays = actor.encode_concatenated_arrays(list(plan.specs), *pixels)
    want = reference_encoder.encode(items)
    assert len(arrays) == len(actor.info().output_layout.row_shapes) == 3
    for k, array in enumerate(arrays):
        torch.testing.assert_close(
            torch.from_numpy(array), torch.cat([w.outputs[k] for w in want]), rtol=1e-5, atol=1e-5
        )
    bad = image(2, 2)
    bad.pixel_values[0, 0] = float("inf")
    bad_plan, bad_pixels = plan_batch(
        [image(2, 2), bad], actor.encoder.adapter.item_rules, actor.encoder.budgets
    )
    with pytest.raises(InvalidItemError, match="item 1"):
        actor.concatenated_outputs(list(bad_plan.specs), bad_pixels, output_device="cpu")


def test_info_carries_what_callers_need(actor):
    info = actor.info()
    assert info.item_rules == actor.encoder.adapter.item_rules
    assert info.budgets == actor.encoder.budgets
    assert info.output_layout.row_shapes == ((128,), (128,), (128,)) and info.output_layout.dtype == "float32"
    assert info.dtype_name == "float32" and info.channel is None


def test_a_retiring_actor_refuses_batches():
    actor = cpu_actor()
    plan, pixels = plan_batch([image(2, 2)], actor.encoder.adapter.item_rules, actor.encoder.budgets)
    assert actor.retire(timeout_s=1.0)
    values, receipt = actor.run_batch(plan, pixels)
    assert receipt.status == RETIRED and values == [None]
    with pytest.raises(EncodeError, match="retiring"):
        actor.concatenated_outputs(list(plan.specs), pixels, output_device="cpu")


def test_out_of_memory_splits_batches_then_items(monkeypatch, reference_encoder):
    """A run that runs out of GPU memory with more than two items is split by the encoder until
    it fits; every batch is still answered, and errors keep their positions."""
    actor = cpu_actor()
    runner = actor.encoder._runners[""]
    real = runner.launch

    def launch(batches, to_host, between=None):
        if sum(len(members) for _, members in batches) > 2:
            raise torch.cuda.OutOfMemoryError("out of memory")
        return real(batches, to_host, between)

    monkeypatch.setattr(runner, "launch", launch)
    bad = image(2, 2)
    bad.pixel_values[0, 0] = float("nan")
    items = [image(2, 2), image(2, 4), image(4, 2), bad]
    plan, pixels = plan_batch(items, actor.encoder.adapter.item_rules, actor.encoder.budgets)
    values, receipt = actor.run_batch(plan, pixels)
    assert list(receipt.item_errors) == [3]
    assert_same(values[:3], reference_encoder.encode(items[:3]))  # plan_batch keeps the items' order
    assert actor.stats().oom_splits == 1  # four items: one split into two halves of two


def test_an_item_that_alone_runs_out_of_memory_fails_alone_and_the_actor_stays_up(
    monkeypatch, reference_encoder
):
    """The encoder's halving reaches single items: the one whose run the allocator refuses gets
    its own error naming it, its batch-mates are encoded, and the next batch runs as before."""
    actor = cpu_actor()
    runner = actor.encoder._runners[""]
    real = runner.launch
    large = image(4, 4)  # 4 tokens: the only item of more than 2

    def launch(batches, to_host, between=None):
        if any(member.spec.num_tokens > 2 for _, members in batches for member in members):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(batches, to_host, between)

    monkeypatch.setattr(runner, "launch", launch)
    items = [image(2, 2), large, image(2, 4)]
    plan, pixels = plan_batch(items, actor.encoder.adapter.item_rules, actor.encoder.budgets)
    values, receipt = actor.run_batch(plan, pixels)
    assert list(receipt.item_errors) == [1] and "memory" in receipt.item_errors[1]
    assert_same([values[0], values[2]], reference_encoder.encode([items[0], items[2]]))
    assert actor.stats().oom_splits >= 2  # the batch, then the half that held the large item
    monkeypatch.setattr(runner, "launch", real)
    plan, pixels = plan_batch([large], actor.encoder.adapter.item_rules, actor.encoder.budgets)
    values, receipt = actor.run_batch(plan, pixels)
    assert not receipt.item_errors
    assert_same(values, reference_encoder.encode([large]))


def test_run_plans_combines_waiting_plans_into_one_replay(reference_encoder):
    actor = cpu_actor()
    encoder = actor.encoder
    rules, budgets = encoder.adapter.item_rules, encoder.budgets
    batches = [[image(4, 4)], [image(2, 6), video(2, 2, 2)], [image(8, 8)]]  # 4 + 3 + 2 + 16 tokens
    groups = []
    for items in batches:
        plan, pixels = plan_batch(items, rules, budgets)
        groups.append((plan, [torch.from_numpy(p) for p in pixels]))
    outcomes = encoder.run_plans(groups, "cpu")
    assert encoder.stats().replays_per_budget == {64: 1}  # 25 tokens: one replay of the 64-token budget
    for items, got in zip(batches, outcomes):
        assert_same(got, reference_encoder.encode(items))


class StartedRuns:
    """A start function that records when each run is started and collected; the first start
    waits until released, so that the other batches queue behind it. A run holding item -1 fails
    when collected."""

    def __init__(self) -> None:
        self.events: list[tuple[str, list[int]]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.runs: list = []  # as BlockingRun's, for run_while_blocked

    def __call__(self, items: list[int], key: object):
        self.events.append(("start", list(items)))
        self.runs.append((list(items), key))
        if len(self.events) == 1:
            self.started.set()
            assert self.release.wait(10)

        def collect() -> list[int]:
            self.events.append(("collect", list(items)))
            if -1 in items:
                raise RuntimeError("bad batch")
            return [10 * item for item in items]

        return collect


def test_the_next_run_starts_before_the_last_is_collected():
    """The leading thread queues the next run on the device before it waits for the run in
    flight, and a run left in flight by a leader that is done is collected by the next one."""
    start = StartedRuns()
    combiner = BatchCombiner(start, max_tokens=1)
    outcomes = run_while_blocked(combiner, start, [([0], 1, None), ([1], 1, None), ([2], 1, None)])
    assert outcomes == [[0], [10], [20]]
    assert start.events == [
        ("start", [0]),
        ("start", [1]),
        ("collect", [0]),
        ("start", [2]),
        ("collect", [1]),
        ("collect", [2]),
    ]


def test_a_run_that_fails_when_collected_fails_only_its_own_batches():
    start = StartedRuns()
    combiner = BatchCombiner(start, max_tokens=2)
    outcomes = run_while_blocked(
        combiner, start, [([0], 1, None), ([-1], 1, None), ([3], 1, None), ([4], 2, None)]
    )
    assert outcomes[0] == [0] and outcomes[3] == [40]
    assert isinstance(outcomes[1], RuntimeError) and isinstance(outcomes[2], RuntimeError)
    assert combiner([7], 1) == [70] and combiner._in_flight is None  # still usable, nothing left behind


def test_threads_whose_batches_still_wait_are_not_woken():
    """Only a batch's own outcome, or the lead, wakes its thread: with dozens of callers waiting,
    waking them all on every run would make the leader queue behind them for the GIL."""
    run = BlockingRun()
    combiner = BatchCombiner(finished(run), max_tokens=1)
    woken_while_waiting: list[bool] = []

    def start(items: list[int], key: object):
        with combiner._lock:
            woken_while_waiting.extend(waiting.woken.is_set() for waiting in combiner._waiting)
        return finished(run)(items, key)

    combiner.start = start
    batches = [([n], 1, None) for n in range(6)]
    outcomes = run_while_blocked(combiner, run, batches)
    assert outcomes == [[10 * n] for n in range(6)]
    assert len(run.runs) == 6  # every batch ran alone
    assert len(woken_while_waiting) >= 4 and not any(woken_while_waiting)
