"""A planned batch is checked once on its way through an actor, and still refused, naming the item,
when it does not hold; an in-process caller of `run_plans` / `start_plans` gets the full check."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import BUDGETS, assert_same, image, make_encoder, plan_batch, video

from vitpool.actors.encoder_actor import EncoderActor
from vitpool.encoder_spec import ActorSpec, EncoderSpec
from vitpool.graphs import encoder as encoder_module
from vitpool.graphs.inputs import CheckedPlan, nonfinite_positions
from vitpool.items import PreparedItem
from vitpool.specs import BatchPlan, ItemSpec
from vitpool.transport.link import OK


@pytest.fixture(scope="module")
def actor() -> EncoderActor:
    spec = ActorSpec(EncoderSpec(budgets=tuple(BUDGETS), dtype="float32", device="cpu"), serve_channel=False)
    return EncoderActor(0, spec)


@pytest.fixture
def counted_checks(monkeypatch) -> list[BatchPlan]:
    """Every plan the encoder module's `check_plan` checks, in order."""
    checked: list[BatchPlan] = []
    real = encoder_module.check_plan

    def counting(plan, *args):
        checked.append(plan)
        return real(plan, *args)

    monkeypatch.setattr(encoder_module, "check_plan", counting)
    return checked


def lying_spec(plan: BatchPlan, position: int) -> BatchPlan:
    """The plan with item `position`'s spec claiming one token of a 2x2 grid for its rows."""
    specs = list(plan.specs)
    specs[position] = replace(specs[position], layout=(1, 2, 2), num_tokens=1)
    return BatchPlan(plan.budget, tuple(specs))


def wrong_dtype(plan: BatchPlan, pixels: list, position: int) -> tuple[BatchPlan, list]:
    """Item `position`'s pixels as float64, which its spec says travel as float32."""
    return plan, [p.astype(np.float64) if i == position else p for i, p in enumerate(pixels)]


def short_rows(plan: BatchPlan, pixels: list, position: int) -> tuple[BatchPlan, list]:
    """Item `position`'s pixels missing their last four rows."""
    return plan, [p[:-4] if i == position else p for i, p in enumerate(pixels)]


# (how item 2 of a batch of three is broken, words of the batch's ValueError)
BROKEN_ITEMS = {
    "a spec that lies about its grid": (lambda plan, pixels: (lying_spec(plan, 2), pixels), "its spec"),
    "pixels of another dtype": (
        lambda plan, pixels: wrong_dtype(plan, pixels, 2),
        "do not travel as float32",
    ),
    "pixels shorter than the spec": (lambda plan, pixels: short_rows(plan, pixels, 2), "its spec says"),
}


def test_a_batch_through_the_actor_is_checked_once(actor, counted_checks):
    items = [image(4, 6), video(2, 4, 4), image(2, 2)]
    plan, pixels = plan_batch(items, actor.encoder.adapter.item_rules, actor.encoder.budgets)
    values, receipt = actor.run_batch(plan, pixels)
    assert receipt.status == OK and all(value is not None for value in values)
    assert counted_checks == [plan]  # in run_batch, before the combiner; the encoder trusts it then


@pytest.mark.parametrize("name", sorted(BROKEN_ITEMS))
def test_a_broken_item_reaching_the_actor_fails_its_batch_naming_it(actor, name):
    breaks, words = BROKEN_ITEMS[name]
    plan, pixels = plan_batch(
        [image(4, 4), image(2, 6), image(4, 4)], actor.encoder.adapter.item_rules, actor.encoder.budgets
    )
    runs_before = actor.stats().runs
    with pytest.raises(ValueError, match=f"item 2 of the batch: .*{words}"):
        actor.run_batch(*breaks(plan, pixels))
    assert actor.stats().runs == runs_before  # refused before it could share a run
    values, receipt = actor.run_batch(plan, pixels)  # the actor still serves
    assert receipt.status == OK and all(value is not None for value in values)


def tensors_of(pixels: list) -> list[torch.Tensor]:
    return [torch.from_numpy(array) for array in pixels]


def test_in_process_plans_are_checked_in_full(tiny_adapter, counted_checks):
    encoder = make_encoder(tiny_adapter, [16, 64])
    plan, pixels = plan_batch([image(2, 2), image(4, 4)], encoder.adapter.item_rules, encoder.budgets)
    with pytest.raises(ValueError, match="item 1 of the batch: its spec"):
        encoder.run_plans([(lying_spec(plan, 1), tensors_of(pixels))])
    with pytest.raises(ValueError, match="item 0 of the batch: pixels of shape"):
        encoder.start_plans([(plan, [tensors_of(pixels)[0][:-4], tensors_of(pixels)[1]])])
    counted_checks.clear()
    encoder.run_plans([(plan, tensors_of(pixels))])
    assert counted_checks == [plan]


def test_a_checked_plan_runs_without_a_second_check_and_as_the_plan_would(tiny_adapter, counted_checks):
    encoder = make_encoder(tiny_adapter, [16, 64])
    items = [image(2, 2), video(2, 2, 2), image(4, 4)]
    plan, pixels = plan_batch(items, encoder.adapter.item_rules, encoder.budgets)
    checked = encoder.check_plan(plan, tensors_of(pixels))
    assert isinstance(checked, CheckedPlan) and checked.plan == plan
    counted_checks.clear()
    [outcomes] = encoder.start_plans([checked], "cpu").result()
    assert counted_checks == []
    assert_same(outcomes, encoder.encode(items))


def test_nonfinite_positions_finds_the_bad_items_only():
    rows = [4, 8, 4]
    members = [
        PreparedItem(ItemSpec("image", (n, 1), "float32", (1, 2, n // 2), n // 4), torch.zeros(n, 1))
        for n in rows
    ]
    flags = torch.ones(sum(rows), dtype=torch.bool)
    assert nonfinite_positions(members, flags) == []
    flags[4 + 7] = False  # the last row of item 1
    flags[4 + 8] = False  # the first row of item 2
    assert nonfinite_positions(members, flags) == [1, 2]


def test_input_views_are_made_once_per_budget_in_a_fresh_dict(tiny_adapter):
    encoder = make_encoder(tiny_adapter, [16, 64])
    runner = encoder._runner("")
    budget = encoder.budgets[0]
    rows = runner.rows(budget)
    pixels, metadata = runner.buffers.input_views(rows, budget)
    again_pixels, again = runner.buffers.input_views(rows, budget)
    assert again_pixels is pixels and again is not metadata
    assert all(again[name] is tensor for name, tensor in metadata.items())
    assert pixels.shape[0] == rows and pixels.data_ptr() == runner.buffers.pixels.data_ptr()
