"""GPU: runs started before the last is collected (`GraphEncoder.start_plans`, the actor's
overlapping combiner) give exactly what each batch gives alone. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_answers_close, image, plan_batch, send_concurrently, video

from vitpool import GraphEncoder
from vitpool.actors.encoder_actor import EncoderActor
from vitpool.encoder_spec import ActorSpec, EncoderSpec

pytestmark = pytest.mark.gpu

BUDGETS = [64, 128, 256]


@pytest.fixture(scope="module")
def gpu_encoder() -> GraphEncoder:
    return GraphEncoder.from_pretrained(None, budgets=BUDGETS, device="cuda", dtype=torch.bfloat16)


def planned(encoder: GraphEncoder, items: list) -> tuple:
    plan, arrays = plan_batch(items, encoder.adapter.item_rules, encoder.budgets)
    return plan, [torch.from_numpy(a) for a in arrays]


@pytest.mark.parametrize("output_device", [None, "cpu"])
def test_plans_started_back_to_back_and_collected_late_keep_their_own_outputs(gpu_encoder, output_device):
    """Every batch is queued before any is collected: same-shaped batches (which reuse the
    metadata in the buffers), others in between, one too large for every budget (eager)."""
    generator = torch.Generator().manual_seed(5)
    batches = [
        [image(8, 8, generator)],
        [image(8, 8, generator)],
        [image(6, 10, generator), video(2, 4, 4, generator)],
        [image(8, 8, generator)],
        [image(40, 36, generator)],
        [image(4, 4, generator), image(4, 4, generator)],
    ]
    groups = [planned(gpu_encoder, items) for items in batches]
    in_flight = [gpu_encoder.start_plans([group], output_device) for group in groups]
    collected = [flight.result()[0] for flight in in_flight]
    for group, got in zip(groups, collected, strict=True):
        [alone] = gpu_encoder.run_plans([group], output_device)
        for g, a in zip(got, alone, strict=True):
            for got_tensor, alone_tensor in zip(g.outputs, a.outputs, strict=True):
                assert got_tensor.is_cuda == (output_device is None)
                assert torch.isfinite(got_tensor).all() and torch.equal(got_tensor, alone_tensor)


def test_concurrent_batches_through_an_overlapping_actor_equal_the_encoder():
    actor = EncoderActor(
        0,
        ActorSpec(
            EncoderSpec(budgets=tuple(BUDGETS), dtype="bfloat16", device="cuda"),
            serve_channel=False,
            overlap_runs=True,
        ),
    )
    generator = torch.Generator().manual_seed(9)
    batches = [
        [image(2 * (1 + n % 4), 2 * (2 + n % 3), generator), image(4, 6, generator)] for n in range(24)
    ]
    wanted = [actor.encoder.encode(items, output_device="cpu") for items in batches]
    got = send_concurrently(actor, batches, timeout_s=120)
    # a combined run replays a larger budget, whose GEMMs may round differently
    assert_answers_close(got, wanted, 1e-2)
    assert actor.stats().runs < len(batches)  # batches did wait and run together


def test_a_runs_nonfinite_items_are_its_own_when_the_next_run_is_queued_first(gpu_encoder):
    """Each run's finite flags are copied to the host behind its own replay: a batch collected
    after the next one was queued reports its own bad items, graph and eager alike."""
    from vitpool import InvalidItemError

    generator = torch.Generator().manual_seed(11)
    first = [image(8, 8, generator), image(8, 8, generator)]
    first[1].pixel_values[3, 7] = float("nan")
    eager = [image(40, 36, generator), image(4, 4, generator)]  # larger than every budget
    eager[0].pixel_values[0, 0] = float("inf")
    clean = [image(8, 8, generator), image(8, 8, generator)]
    flights = [
        gpu_encoder.start_plans([planned(gpu_encoder, items)], "cpu") for items in (first, eager, clean)
    ]
    [got_first], [got_eager], [got_clean] = (flight.result() for flight in flights)
    assert isinstance(got_first[1], InvalidItemError) and got_first[1].index == 1
    assert isinstance(got_eager[0], InvalidItemError) and got_eager[0].index == 0
    for good in (got_first[0], got_eager[1], *got_clean):
        assert not isinstance(good, InvalidItemError)
        assert all(torch.isfinite(output).all() for output in good.outputs)
