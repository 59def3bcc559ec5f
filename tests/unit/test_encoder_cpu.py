"""The static-buffer forward on CPU against Hugging Face's tower run item by item (fp32)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import ROW_WIDTH, image, make_encoder, reference_outputs, relative_error, video

from vitpool import Embedding, GraphEncoder
from vitpool.packing import SEQUENCES, Budget

BUDGETS = [16, 32, 64, 128]
TOLERANCE = 1e-5


def assert_matches_reference(reference_tower, items, embeddings: list[Embedding]) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings):
        tokens, deepstack = reference_outputs(reference_tower, item)
        assert embedding.tokens.shape == tokens.shape
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, tokens) <= TOLERANCE
        assert len(embedding.deepstack) == len(deepstack) == 2
        for got, expected in zip(embedding.deepstack, deepstack):
            assert relative_error(got, expected) <= TOLERANCE


# Each case lands in the named budget: (budget it must use, items).
CASES = {
    # one small image padded up to the smallest budget
    "image-16": (16, lambda g: [image(4, 6, g)]),
    # several images sharing one batch
    "images-32": (32, lambda g: [image(4, 4, g), image(2, 8, g), image(6, 6, g)]),
    # a video: one attention sequence per temporal patch
    "video-64": (64, lambda g: [video(4, 6, 8, g)]),
    # images and videos mixed, nearly filling the budget
    "mix-128": (128, lambda g: [image(8, 8, g), video(2, 6, 6, g), image(10, 12, g), video(3, 4, 4, g)]),
    # exactly full: no padding rows at all
    "full-64": (64, lambda g: [image(16, 16, g)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_static_forward_matches_hugging_face(tiny_adapter, reference_tower, case):
    budget, build = CASES[case]
    encoder = make_encoder(tiny_adapter, BUDGETS)
    items = build(torch.Generator().manual_seed(len(case)))
    embeddings = encoder.encode(items)
    assert_matches_reference(reference_tower, items, embeddings)
    assert encoder.stats().replays_per_budget == {budget: 1}


def test_every_budget_matches_on_fresh_random_items(tiny_adapter, reference_tower):
    encoder = make_encoder(tiny_adapter, BUDGETS)
    generator = torch.Generator().manual_seed(1)
    for budget in BUDGETS:
        # one image with just over half the budget's tokens: lands in this budget, not a smaller one
        side = 2 * int((budget // 2 + 1) ** 0.5 + 1)
        height, width = side, 2 * (((budget * 4) // side) // 2)
        items = [image(height, width, generator)]
        assert budget // 2 < height * width // 4 <= budget
        before = encoder.stats().replays_per_budget.get(budget, 0)
        assert_matches_reference(reference_tower, items, encoder.encode(items))
        assert encoder.stats().replays_per_budget.get(budget, 0) == before + 1


def test_many_items_split_into_batches_in_input_order(tiny_adapter, reference_tower):
    encoder = make_encoder(tiny_adapter, BUDGETS, max_items_per_batch=4, max_frames_per_batch=6)
    generator = torch.Generator().manual_seed(2)
    items = [image(2 * (1 + i % 4), 2 * (1 + i % 3), generator) for i in range(11)] + [
        video(3, 4, 4, generator)
    ]
    embeddings = encoder.encode(items)
    assert_matches_reference(reference_tower, items, embeddings)
    stats = encoder.stats()
    assert sum(stats.replays_per_budget.values()) >= 3  # 12 items, at most 4 per batch
    assert stats.eager_items == len(items)  # CPU: the static forward runs without a graph


def test_oversized_item_runs_eager_alone(tiny_adapter, reference_tower):
    encoder = make_encoder(tiny_adapter, BUDGETS)
    items = [image(4, 4), image(24, 24), video(2, 4, 4)]  # 144 tokens > largest budget 128
    embeddings = encoder.encode(items)
    assert_matches_reference(reference_tower, items, embeddings)
    stats = encoder.stats()
    assert stats.eager_batches == 1
    assert sum(stats.replays_per_budget.values()) == 1


def test_large_batch_then_small_gives_fresh_results(tiny_adapter):
    """Stale rows from a large batch must not leak into a later, smaller one on the same budget."""
    encoder = make_encoder(tiny_adapter, [64])
    small = [image(4, 4, torch.Generator().manual_seed(3))]
    fresh = make_encoder(tiny_adapter, [64]).encode(small)[0]
    encoder.encode([image(16, 16), video(2, 8, 4)])
    again = encoder.encode(small)[0]
    assert torch.equal(again.tokens, fresh.tokens)
    for got, expected in zip(again.deepstack, fresh.deepstack):
        assert torch.equal(got, expected)


def test_numpy_and_processor_shaped_grid(tiny_adapter, reference_tower):
    encoder = make_encoder(tiny_adapter, BUDGETS)
    item = image(6, 4)
    as_numpy = type(item)(item.pixel_values.numpy(), torch.tensor([[1, 6, 4]]))
    [from_numpy] = encoder.encode([as_numpy])
    [from_torch] = encoder.encode([item])
    assert torch.equal(from_numpy.tokens, from_torch.tokens)


def test_empty_list_returns_empty(tiny_adapter):
    encoder = make_encoder(tiny_adapter, BUDGETS)
    assert encoder.encode([]) == []
    assert encoder.stats().replays_per_budget == {}


def test_stats_count_padding(tiny_adapter):
    encoder = make_encoder(tiny_adapter, BUDGETS)
    encoder.encode([image(4, 6)])  # 6 tokens in the 16-token budget
    stats = encoder.stats()
    assert stats.batch_rows == 16 * 4
    assert stats.padding_rows == (16 - 6) * 4
    assert stats.padding_waste == pytest.approx(10 / 16)
    assert stats.captured_budgets == []  # no capture on CPU


def test_default_budgets_on_cpu(tiny_adapter):
    encoder = make_encoder(tiny_adapter, None)
    tokens = [b.num_tokens for b in encoder.budgets]
    assert tokens == sorted(tokens) and tokens[0] == 16 and tokens[-1] == 1024
    # the ladder never steps by more than 2x, and by at most 12.5% (plus alignment) above 256
    for low, high in itertools.pairwise(tokens):
        assert high <= 2 * low
        if low >= 256:
            assert high <= low * 1.125 + 32


def test_few_and_many_sequence_variants_match(tiny_adapter, reference_tower):
    encoder = make_encoder(tiny_adapter, [64, 320])
    generator = torch.Generator().manual_seed(4)
    one_large = [image(24, 24, generator)]  # 144 tokens, one sequence: the 4-sequence variant
    many_small = [image(4, 4, generator) for _ in range(9)] + [video(3, 8, 8, generator)]
    for items in (one_large, many_small):
        assert_matches_reference(reference_tower, items, encoder.encode(items))
    assert encoder.stats().replays_per_budget == {320: 2}


def test_metadata_refuses_a_batch_larger_than_its_buffers(tiny_adapter):
    rules = tiny_adapter.item_rules
    wide = rules.item_spec("image", (80, ROW_WIDTH), "float32", (1, 8, 10))
    clip = rules.item_spec("video", (32, ROW_WIDTH), "float32", (2, 4, 4))
    with pytest.raises(ValueError, match="need 80 rows and 1 sequences; the buffers hold 64 and 4"):
        tiny_adapter.build_metadata([wide], num_rows=64, budget=Budget(16, ((SEQUENCES, 4),), 4))
    with pytest.raises(ValueError, match="need 32 rows and 2 sequences; the buffers hold 64 and 1"):
        tiny_adapter.build_metadata([clip], num_rows=64, budget=Budget(16, ((SEQUENCES, 1),), 1))


def planned(encoder, items):
    from conftest import plan_batch

    plan, arrays = plan_batch(items, encoder.adapter.item_rules, encoder.budgets)
    return plan, [torch.from_numpy(array) for array in arrays]


def test_planned_batches_run_as_planned_when_they_do_not_fit_together(tiny_adapter, reference_tower):
    encoder = make_encoder(tiny_adapter, [16, 64])
    generator = torch.Generator().manual_seed(5)
    batches = [
        [image(16, 16, generator)],
        [image(8, 8, generator)],
        [image(24, 24, generator)],
        [image(2, 2, generator)],
    ]
    groups = [planned(encoder, items) for items in batches]
    assert [plan.budget.num_tokens if plan.budget else None for plan, _ in groups] == [64, 16, None, 16]
    outcomes = encoder.run_plans(groups, output_device=None)
    for items, embeddings in zip(batches, outcomes):
        assert_matches_reference(reference_tower, items, embeddings)
    stats = encoder.stats()
    # 64 + 16 tokens fit no budget; the eager item runs alone; the last plan runs on its own
    assert stats.replays_per_budget == {64: 1, 16: 2} and stats.eager_batches == 1


def test_the_encoder_picks_the_budget_a_plan_runs_in(tiny_adapter, reference_tower):
    """A plan's budget is its planner's estimate: this encoder runs it in its own smallest budget
    that holds it, or eagerly at its own size where none does."""
    encoder = make_encoder(tiny_adapter, [16, 64])
    items = [image(4, 4)]
    plan, pixels = planned(make_encoder(tiny_adapter, [32]), items)
    assert plan.budget.num_tokens == 32
    assert encoder.check_plan(plan, pixels).plan.budget.num_tokens == 16
    [embeddings] = encoder.run_plans([(plan, pixels)], output_device=None)
    assert_matches_reference(reference_tower, items, embeddings)
    assert encoder.stats().replays_per_budget == {16: 1}
    too_many = [image(8, 8), image(8, 8), image(4, 4)]  # 16 + 16 + 4 tokens
    plan, pixels = planned(make_encoder(tiny_adapter, [128]), too_many)
    small = make_encoder(tiny_adapter, [16, 32])
    assert small.check_plan(plan, pixels).plan.budget is None
    [embeddings] = small.run_plans([(plan, pixels)], output_device=None)
    assert_matches_reference(reference_tower, too_many, embeddings)
    assert small.stats().eager_batches == 1 and small.stats().replays_per_budget == {}


def test_attention_is_a_setting_of_the_encoder_and_the_pool():
    from vitpool.errors import ConfigError
    from vitpool.pool.settings import PoolSettings

    spec = PoolSettings(attention="fa2", budgets=(16,), device="cpu", dtype="float32").encoder_spec()
    assert spec.attention == "fa2"
    assert GraphEncoder.from_spec(spec).attention == "fa2"
    assert GraphEncoder.from_pretrained(None, budgets=[16], device="cpu").attention == "auto"
    with pytest.raises(ConfigError, match="'fa3' is not one of"):
        GraphEncoder.from_pretrained(None, budgets=[16], device="cpu", attention="fa3")


def test_an_encoder_is_freed_with_its_last_reference_not_by_the_garbage_collector():
    """No reference cycle through the encoder: its buffers (and, on a GPU, its graphs) go when the
    caller drops it. Graphs left to the collector could be freed while another encoder captures,
    which invalidates that capture."""
    import gc
    import weakref

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        encoder = GraphEncoder.from_pretrained(None, budgets=[16, 32], device="cpu")
        bad = image(4, 4)
        bad.pixel_values[0, 0] = float("nan")
        encoder.encode_each([bad, image(4, 4), image(40, 40)])  # an invalid item, a graph run, an eager run
        dropped = weakref.ref(encoder)
        del encoder
        assert dropped() is None
    finally:
        if was_enabled:
            gc.enable()


def test_return_exceptions_gives_each_item_its_own_outcome(tiny_adapter):
    """A NaN item and a malformed one beside good ones: by default the call raises (naming the
    bad item); with return_exceptions=True each bad slot holds its own error and the good
    items' embeddings equal those of a call without the bad ones."""
    from vitpool import InvalidItemError

    encoder = make_encoder(tiny_adapter, BUDGETS)
    generator = torch.Generator().manual_seed(3)
    good, other = image(4, 6, generator), image(6, 6, generator)
    not_finite = image(4, 4, generator)
    not_finite.pixel_values[2, 1] = float("nan")
    wrong_rows = type(good)(good.pixel_values[:-1], torch.tensor([1, 4, 6]))  # 23 rows, grid says 24
    items = [good, not_finite, other, wrong_rows]
    with pytest.raises(InvalidItemError, match="item 3: pixel_values have 23 rows"):  # checked before any run
        encoder.encode(items)
    with pytest.raises(InvalidItemError, match="item 1: pixel_values contain NaN"):
        encoder.encode(items[:3])
    outcomes = encoder.encode(items, return_exceptions=True)
    assert [type(o).__name__ for o in outcomes] == [
        "Embedding",
        "InvalidItemError",
        "Embedding",
        "InvalidItemError",
    ]
    assert outcomes[1].index == 1 and "NaN" in outcomes[1].reason
    assert outcomes[3].index == 3
    alone = encoder.encode([good, other])
    for got, expected in zip([outcomes[0], outcomes[2]], alone):
        assert torch.equal(got.tokens, expected.tokens)
    assert encoder.encode([], return_exceptions=True) == []


@pytest.mark.parametrize("rows, threads", [(9605, 4), (3, 4), (9605, 1)])
def test_large_host_pixels_are_copied_whole_by_several_threads(monkeypatch, rows, threads):
    """The pinned staging's host copy: an item over PARALLEL_BYTES is cut among the copy threads
    (rows not divisible by their number, fewer rows than threads); every row arrives."""
    import numpy as np

    from vitpool.graphs.buffers import PinnedStaging

    monkeypatch.setattr(PinnedStaging, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(PinnedStaging, "COPY_THREADS", threads)
    source = np.random.default_rng(rows).random((rows, 96), dtype=np.float32)
    target = np.full_like(source, np.nan)
    PinnedStaging((96,), torch.device("cpu"))._host_copy(target, source)
    assert np.array_equal(target, source)
