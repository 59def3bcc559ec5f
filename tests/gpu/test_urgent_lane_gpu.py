"""GPU: the urgent lane (`GraphEncoder(urgent_tokens=...)`, the pool's `urgent_tokens`):
the larger budgets captured in segments, each checked against eager at capture; small batches
replayed from a second copy of the small budgets' graphs between two segments of the runs being
queued give what the main lane gives, and so do the interrupted runs. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_answers_close, image, plan_batch, relative_error, send_concurrently, video

from vitpool import GraphEncoder
from vitpool.actors.encoder_actor import EncoderActor
from vitpool.encoder_spec import ActorSpec, EncoderSpec

pytestmark = pytest.mark.gpu

BUDGETS = [64, 128, 256]


@pytest.fixture(scope="module")
def urgent_encoder() -> GraphEncoder:
    return GraphEncoder.from_pretrained(
        None, budgets=BUDGETS, device="cuda", dtype=torch.bfloat16, urgent_tokens=100
    )


def planned(encoder: GraphEncoder, items: list) -> tuple:
    plan, arrays = plan_batch(items, encoder.adapter.item_rules, encoder.budgets)
    return plan, [torch.from_numpy(a) for a in arrays]


def assert_equal_outcomes(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        for got_tensor, want_tensor in zip(g.outputs, w.outputs, strict=True):
            assert torch.isfinite(got_tensor).all() and relative_error(got_tensor, want_tensor) <= 1e-3


def test_the_urgent_lane_holds_the_budgets_up_to_the_first_of_at_least_its_tokens(urgent_encoder):
    assert urgent_encoder.has_urgent_lane
    assert sorted(b.num_tokens for b in urgent_encoder.urgent_budgets) == [64, 128]
    stats = urgent_encoder.stats()
    assert sorted(tokens for tokens, _ in stats.captured_budgets) == BUDGETS  # listed once, each checked
    assert stats.disabled_budgets == []
    segments = {b.num_tokens: len(g.segments) for b, g in urgent_encoder._runners[""].graphs.items()}
    assert segments == {64: 1, 128: 1, 256: 2}  # the tiny tower's 4 blocks, cut before the third


def test_small_batches_interrupt_queued_segmented_runs_and_every_result_equals_its_batch_alone(
    urgent_encoder,
):
    """Fresh random items: many segmented (256-token) runs queued, then small urgent batches; some
    small batch goes between two segments of a run (counted), and every batch, interrupted or
    interrupting, equals the same batch run alone."""
    generator = torch.Generator().manual_seed(23)
    interrupts_before = urgent_encoder.stats().urgent_interrupts
    for _attempt in range(10):
        large_groups = [
            planned(urgent_encoder, [image(24, 24, generator), image(16, 16, generator)]) for _ in range(12)
        ]
        small_groups = [planned(urgent_encoder, [image(8, 8 + 2 * n, generator)]) for n in range(4)]
        large_flights = [urgent_encoder.start_plans([group], "cpu") for group in large_groups]
        small_flights = [urgent_encoder.start_plans([group], "cpu", urgent=True) for group in small_groups]
        for group, flight in zip(large_groups + small_groups, large_flights + small_flights, strict=True):
            [got] = flight.result()
            [alone] = urgent_encoder.run_plans([group], "cpu")
            assert_equal_outcomes(got, alone)
        if urgent_encoder.stats().urgent_interrupts > interrupts_before:
            break
    assert urgent_encoder.stats().urgent_interrupts > interrupts_before


def test_urgent_batches_queued_beside_large_runs_equal_the_main_lane(urgent_encoder):
    """Per urgent budget, fresh random items: an urgent batch started while large runs (a graph
    and an eager batch) are queued on the main stream, collected after them, equals the same
    batch run alone in the main lane; the large runs equal theirs too."""
    generator = torch.Generator().manual_seed(13)
    small_batches = {
        64: [image(8, 8, generator), video(2, 4, 4, generator)],  # 16 + 8 tokens
        128: [image(16, 12, generator), image(8, 8, generator), image(6, 10, generator)],  # 48 + 16 + 15
    }
    large = [
        [image(24, 24, generator), image(12, 16, generator)],
        [image(40, 36, generator)],
    ]  # 256 budget; eager
    for tokens, items in small_batches.items():
        small = planned(urgent_encoder, items)
        assert small[0].budget.num_tokens == tokens
        large_groups = [planned(urgent_encoder, batch) for batch in large]
        large_flights = [urgent_encoder.start_plans([group], "cpu") for group in large_groups]
        urgent_flight = urgent_encoder.start_plans([small], "cpu", urgent=True)
        [urgent_got] = urgent_flight.result()
        large_got = [flight.result()[0] for flight in large_flights]
        [alone] = urgent_encoder.run_plans([small], "cpu")
        assert_equal_outcomes(urgent_got, alone)
        for group, got in zip(large_groups, large_got, strict=True):
            [large_alone] = urgent_encoder.run_plans([group], "cpu")
            assert_equal_outcomes(got, large_alone)


def test_an_urgent_batch_outside_the_lanes_budgets_runs_in_the_main_lane(urgent_encoder):
    generator = torch.Generator().manual_seed(17)
    items = [image(24, 24, generator), image(12, 16, generator)]
    group = planned(urgent_encoder, items)
    assert group[0].budget not in urgent_encoder.urgent_budgets
    before = urgent_encoder.stats().replays_per_budget.get(256, 0)
    [got] = urgent_encoder.start_plans([group], "cpu", urgent=True).result()
    assert urgent_encoder.stats().replays_per_budget[256] == before + 1
    assert_equal_outcomes(got, urgent_encoder.encode(items, output_device="cpu"))


def test_an_actor_sends_small_batches_to_the_urgent_lane_and_answers_every_batch_right():
    actor = EncoderActor(
        0,
        ActorSpec(
            EncoderSpec(budgets=tuple(BUDGETS), dtype="bfloat16", device="cuda", urgent_tokens=64),
            serve_channel=False,
            overlap_runs=True,
            small_first_tokens=64,
        ),
    )
    generator = torch.Generator().manual_seed(19)
    batches = []
    for n in range(24):  # small (<= 64 tokens) and large batches, interleaved
        small = [image(2 * (1 + n % 4), 2 * (2 + n % 3), generator), image(4, 6, generator)]
        batches.append(small if n % 2 else [image(20, 24, generator), image(8, 8, generator)])
    wanted = [actor.encoder.encode(items, output_device="cpu") for items in batches]
    got = send_concurrently(actor, batches, timeout_s=120)
    # a combined run replays a larger budget, whose GEMMs may round differently
    assert_answers_close(got, wanted, 1e-2)
    assert actor._urgent_combiner is not None and actor._urgent_combiner.counters.runs > 0
    assert actor._combiner.counters.runs > 0
