"""GPU: each budget's captured graph against eager on fresh random inputs (bf16). Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close_to_reference, assert_same_item, image, relative_error, video

from vitpool import GraphEncoder
from vitpool.graphs import capture as capture_module

pytestmark = pytest.mark.gpu

BUDGETS = [64, 128, 256]
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def gpu_encoder() -> GraphEncoder:
    return GraphEncoder.from_pretrained(None, budgets=BUDGETS, device="cuda", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def gpu_reference(gpu_encoder):
    tower = copy.deepcopy(gpu_encoder.adapter.tower)
    tower.config._attn_implementation = "sdpa"
    return tower


def test_every_budget_is_captured(gpu_encoder):
    stats = gpu_encoder.stats()
    assert sorted(t for t, _ in stats.captured_budgets) == BUDGETS and stats.disabled_budgets == []


# budget: two image grids whose tokens together are over half the budget, so they land in it
GRIDS_PER_BUDGET = {64: [(10, 10), (4, 8)], 128: [(14, 14), (8, 10)], 256: [(20, 20), (12, 12)]}


@pytest.mark.parametrize("budget", BUDGETS)
def test_graph_matches_eager_per_budget(gpu_encoder, gpu_reference, budget):
    generator = torch.Generator().manual_seed(budget)
    items = [image(h, w, generator) for h, w in GRIDS_PER_BUDGET[budget]]
    tokens = sum(it.pixel_values.shape[0] for it in items) // 4
    assert budget // 2 < tokens <= budget
    before = gpu_encoder.stats()
    embeddings = gpu_encoder.encode(items)
    after = gpu_encoder.stats()
    assert after.replays_per_budget.get(budget, 0) == before.replays_per_budget.get(budget, 0) + 1
    assert after.graph_items == before.graph_items + 2
    assert_close_to_reference(gpu_reference, items, embeddings)


def test_video_and_mix(gpu_encoder, gpu_reference):
    generator = torch.Generator().manual_seed(7)
    items = [video(4, 8, 8, generator), image(6, 10, generator), video(2, 4, 6, generator)]
    assert_close_to_reference(gpu_reference, items, gpu_encoder.encode(items))


def test_large_then_small_equals_fresh(gpu_encoder):
    small = [image(4, 6, torch.Generator().manual_seed(3))]
    fresh = GraphEncoder.from_pretrained(None, budgets=[256], device="cuda").encode(small)[0]
    gpu_encoder.encode([image(30, 30), video(2, 8, 8)])  # fills most of the 256-token buffers
    again = gpu_encoder.encode(small)[0]
    assert torch.equal(again.tokens, fresh.tokens)
    for got, expected in zip(again.deepstack, fresh.deepstack):
        assert torch.equal(got, expected)


def test_oversized_item_runs_eager(gpu_encoder, gpu_reference):
    items = [image(40, 40)]  # 400 tokens > 256
    before = gpu_encoder.stats()
    assert_close_to_reference(gpu_reference, items, gpu_encoder.encode(items))
    after = gpu_encoder.stats()
    assert after.eager_batches == before.eager_batches + 1
    assert after.eager_items == before.eager_items + 1
    assert after.graph_items == before.graph_items


def test_an_eager_batch_picks_its_attention_from_its_boundaries(monkeypatch, gpu_encoder, gpu_reference):
    """An image too large for every budget runs eager at its own rows: one long sequence, known on
    the host, so the hook runs FA4 where it is installed (cuDNN otherwise, on Hopper); a video's
    short per-frame sequences stay on FA2; a replayed graph never asks."""
    from vitpool.kernels import attention

    decisions = []
    original = attention.eager_backend
    monkeypatch.setattr(
        attention, "eager_backend", lambda *args: decisions.append(original(*args)) or decisions[-1]
    )
    device = gpu_encoder.device
    packed = attention.cudnn_packed_available(device)
    dense = "cudnn" if attention.cudnn_available(device) else "fa2"
    long_image = "fa4" if attention.fa4_available(device) else attention.CUDNN_PACKED if packed else dense
    items = [image(96, 96, torch.Generator().manual_seed(5))]  # 9216 rows: one long sequence, eager
    assert 96 * 96 >= attention.FA4_MIN_ROWS_PER_SEQUENCE
    assert_close_to_reference(gpu_reference, items, gpu_encoder.encode(items))
    assert decisions and set(decisions) == {long_image}
    decisions.clear()
    clip = [video(4, 24, 24, torch.Generator().manual_seed(6))]  # 4 frames of 576 rows: eager
    assert_close_to_reference(gpu_reference, clip, gpu_encoder.encode(clip))
    assert decisions and set(decisions) == {attention.CUDNN_PACKED if packed else "fa2"}
    decisions.clear()
    gpu_encoder.encode([image(10, 10)])
    assert decisions == []


def test_one_image_filling_a_budget_replays_its_dense_graph(monkeypatch, gpu_reference):
    """Where packed cuDNN does not run (FA2 graphs), a budget of 1024 rows has a second graph with
    cuDNN attention over all its rows, replayed for a batch of one image that fills most of it; two
    images in that budget replay the packed one. (With packed cuDNN there is no second graph.)"""
    from vitpool.kernels import attention

    if not attention.cudnn_available(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("no cuDNN attention on this GPU")
    monkeypatch.setattr(attention, "cudnn_packed_available", lambda device: False)
    gpu_encoder = GraphEncoder.from_pretrained(None, budgets=BUDGETS, device="cuda", dtype=torch.bfloat16)
    assert [tokens for tokens, _ in gpu_encoder.stats().dense_graphs] == [256]
    one = [image(30, 32, torch.Generator().manual_seed(12))]  # 960 of the budget's 1024 rows
    before = gpu_encoder.stats()
    assert_close_to_reference(gpu_reference, one, gpu_encoder.encode(one))
    after = gpu_encoder.stats()
    assert after.dense_items == before.dense_items + 1 and after.graph_items == before.graph_items + 1
    two = [image(16, 30, torch.Generator().manual_seed(13)), image(14, 30, torch.Generator().manual_seed(14))]
    assert_close_to_reference(gpu_reference, two, gpu_encoder.encode(two))
    assert gpu_encoder.stats().dense_items == after.dense_items
    small = [image(4, 6, torch.Generator().manual_seed(3))]  # after the dense replay: as fresh
    fresh = GraphEncoder.from_pretrained(None, budgets=[64], device="cuda").encode(small)[0]
    assert torch.equal(gpu_encoder.encode(small)[0].tokens, fresh.tokens)


def test_forced_fa2_matches_the_tower(gpu_reference):
    encoder = GraphEncoder.from_pretrained(None, budgets=[64, 256], device="cuda", attention="fa2")
    assert encoder.stats().disabled_budgets == [] and encoder.stats().dense_graphs == []
    items = [image(40, 40, torch.Generator().manual_seed(8)), image(10, 12, torch.Generator().manual_seed(9))]
    assert_close_to_reference(gpu_reference, items, encoder.encode(items))


def test_failed_check_disables_budget_and_eager_is_used(monkeypatch, gpu_reference):
    # A negative tolerance fails every check: every budget must fall back to eager.
    monkeypatch.setitem(capture_module.CHECK_TOLERANCE, torch.bfloat16, -1.0)
    encoder = GraphEncoder.from_pretrained(None, budgets=[64, 128], device="cuda")
    stats = encoder.stats()
    assert sorted(t for t, _ in stats.disabled_budgets) == [64, 128] and stats.captured_budgets == []
    items = [image(8, 8), video(2, 4, 4)]
    assert_close_to_reference(gpu_reference, items, encoder.encode(items))
    stats = encoder.stats()
    assert stats.graph_items == 0 and stats.eager_items == 2


def _small_graph() -> torch.cuda.CUDAGraph:
    values = torch.zeros(16, device="cuda")
    values.add_(1)  # warm-up: the kernel is loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values.add_(1)
    return graph


def test_a_graph_freed_by_the_garbage_collector_cannot_break_a_capture(monkeypatch):
    """During each budget's capture an older graph becomes garbage held only by a new reference
    cycle, and allocations give the collector every chance to run: had it freed the graph there
    (CUDA forbids destroying a graph while a stream captures), the capture would be invalidated."""
    import gc

    held = [_small_graph() for _ in BUDGETS]
    forward = capture_module._forward_into_outputs

    def forward_leaving_garbage(runner, budget, dense=False):
        if held and torch.cuda.is_current_stream_capturing():
            cycle = {"graph": held.pop()}
            cycle["itself"] = cycle  # young garbage: a collection of the youngest generation frees it
            del cycle
            _ = [[] for _ in range(100)]  # tracked allocations, each may start that collection
        forward(runner, budget, dense)

    monkeypatch.setattr(capture_module, "_forward_into_outputs", forward_leaving_garbage)
    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        encoder = GraphEncoder.from_pretrained(None, budgets=BUDGETS, device="cuda", dtype=torch.bfloat16)
    finally:
        gc.set_threshold(*thresholds)
    assert held == []  # a graph became garbage during every capture
    stats = encoder.stats()
    assert sorted(t for t, _ in stats.captured_budgets) == BUDGETS and stats.disabled_budgets == []
    gc.collect()  # the old graphs go now, with no capture running
    [embedding] = encoder.encode([image(8, 8, torch.Generator().manual_seed(4))])
    assert torch.isfinite(embedding.tokens).all()


def test_planned_batches_to_the_host_equal_encode(gpu_encoder):
    from conftest import plan_batch

    generator = torch.Generator().manual_seed(11)
    batches = [[image(8, 8, generator), video(2, 4, 4, generator)], [image(6, 6, generator)]]
    groups = []
    for items in batches:
        plan, arrays = plan_batch(items, gpu_encoder.adapter.item_rules, gpu_encoder.budgets)
        groups.append((plan, [torch.from_numpy(a) for a in arrays]))
    before = gpu_encoder.stats()
    outcomes = gpu_encoder.run_plans(groups, "cpu")
    assert gpu_encoder.stats().graph_items == before.graph_items + 3
    for items, got in zip(batches, outcomes):
        for embedding, want in zip(got, gpu_encoder.encode(items)):
            for g, w in zip(embedding.outputs, want.outputs, strict=True):
                assert g.device.type == "cpu" and torch.equal(g, w.cpu())


def test_a_tiled_family_is_captured_and_matches_its_tower(tmp_path):
    import toy_family

    encoder = GraphEncoder.from_pretrained(
        toy_family.write_checkpoint(tmp_path), budgets=[8, 16, 32], device="cuda"
    )
    stats = encoder.stats()
    assert sorted(t for t, _ in stats.captured_budgets) == [8, 16, 32] and stats.disabled_budgets == []
    generator = torch.Generator().manual_seed(0)
    items = [toy_family_item(n, generator) for n in (1, 3, 2, 5, 12)]  # the last runs eager
    for item, embedding in zip(items, encoder.encode(items)):
        with torch.no_grad():
            expected = encoder.adapter.tower(item.pixel_values.to("cuda", torch.bfloat16))
        for got, want in zip(embedding.outputs, expected, strict=True):
            assert torch.isfinite(got).all() and relative_error(got, want) <= TOLERANCE


def toy_family_item(num_tiles: int, generator: torch.Generator):
    from vitpool import Image

    return Image(torch.randn(num_tiles, 3, 8, 8, generator=generator))


def test_batches_queued_back_to_back_keep_their_own_pixels(gpu_encoder):
    """One call packed into many batches: each batch's host pixels and metadata pass through the
    same pinned staging memory while earlier batches may still be copying or running."""
    generator = torch.Generator().manual_seed(21)
    items = [image(14, 16, generator) for _ in range(12)]  # 56 tokens each: several batches
    together = gpu_encoder.encode(items)
    assert gpu_encoder.stats().replays_per_budget
    for item, got in zip(items, together):
        alone = gpu_encoder.encode([item])[0]
        assert_same_item(got.tokens, alone.tokens)


def test_non_finite_pixels_fail_their_item_alone_inside_a_graph(gpu_encoder):
    """The graph checks and cleans its own pixels: a NaN or infinite item fails alone, the others
    of its batch (and the next batch, in the same buffers) give what they give alone."""
    generator = torch.Generator().manual_seed(37)
    good = [image(8, 8, generator), image(8, 12, generator)]
    bad = [image(8, 8, generator), image(4, 4, generator)]
    bad[0].pixel_values[5, 3] = float("nan")
    bad[1].pixel_values[0, 0] = float("inf")
    replays = sum(gpu_encoder.stats().replays_per_budget.values())
    outcomes = gpu_encoder.encode_each([good[0], bad[0], good[1], bad[1]])
    assert sum(gpu_encoder.stats().replays_per_budget.values()) == replays + 1  # one graph batch
    assert [type(o).__name__ for o in outcomes] == [
        "Embedding",
        "InvalidItemError",
        "Embedding",
        "InvalidItemError",
    ]
    assert outcomes[1].index == 1 and outcomes[3].index == 3 and "NaN or infinity" in outcomes[1].reason
    for got, item in zip((outcomes[0], outcomes[2]), good):
        assert_same_item(got.tokens, gpu_encoder.encode([item])[0].tokens)


def test_small_host_items_are_staged_together_when_their_batch_is_large(gpu_encoder, gpu_reference):
    """Items under 4 MB each but over it together pass through pinned memory as one batch; one of
    them alone copies directly. Either way each gives what it gives alone, and what the tower gives."""
    from vitpool.graphs.buffers import PinnedStaging

    generator = torch.Generator().manual_seed(29)
    items = [image(16, 16, generator) for _ in range(4)]
    sizes = [it.pixel_values.nbytes for it in items]
    assert max(sizes) < PinnedStaging.MIN_BYTES <= sum(sizes)
    staging = gpu_encoder._runner("").staging
    before = staging._copied
    together = gpu_encoder.encode(items)
    assert staging._copied is not before  # staged
    before = staging._copied
    alone = [gpu_encoder.encode([item])[0] for item in items]
    assert staging._copied is before  # not staged
    for got, want in zip(together, alone):
        assert_same_item(got.tokens, want.tokens)
    assert_close_to_reference(gpu_reference, items, together)


def test_large_host_pixels_pass_through_pinned_memory_unchanged(gpu_encoder, gpu_reference):
    """Items of 4 MB and more pass through pinned memory (converted to the compute dtype on the
    device): several such batches back to back (and an eager one) give what each item gives
    alone, and what the tower gives."""
    from vitpool.graphs.buffers import PinnedStaging

    generator = torch.Generator().manual_seed(23)
    items = [image(28, 28, generator) for _ in range(3)] + [image(40, 40, generator)]  # 196 tokens; eager
    assert all(it.pixel_values.nbytes >= PinnedStaging.MIN_BYTES for it in items)
    together = gpu_encoder.encode(items)
    staged = gpu_encoder._runner("").staging._rows
    assert staged and all(rows.is_pinned() for rows in staged.values())
    for item, got in zip(items, together):
        assert_same_item(got.tokens, gpu_encoder.encode([item])[0].tokens)
    assert_close_to_reference(gpu_reference, items, together)


@pytest.mark.parametrize("on_device", [False, True])
def test_the_dense_attention_padding_kernel_writes_what_torch_would(on_device):
    """The Triton kernel that pads q, k, v for the dense cuDNN path: the rows and head dimension
    padded with zeros, column 72 set to 1 in q and to the mask value in k from row 700 on."""
    from vitpool.kernels.dense_cudnn import pad_for_dense_attention

    generator = torch.Generator(device="cuda").manual_seed(43)
    qkv = torch.randn(750, 3, 16, 72, device="cuda", dtype=torch.bfloat16, generator=generator)
    q, k, v = qkv.unbind(1)  # strided views, as the towers hand them over
    limit = torch.tensor([0, 700], device="cuda", dtype=torch.int32)[1] if on_device else 700
    got = pad_for_dense_attention(q, k, v, 1024, 80, limit, -30000.0)
    assert got is not None
    for tensor, padded in zip((q, k, v), got):
        want = torch.zeros(1024, 16, 80, device="cuda", dtype=torch.bfloat16)
        want[:750, :, :72] = tensor
        if tensor is q:
            want[:, :, 72] = 1.0
        elif tensor is k:
            want[700:, :, 72] = -30000.0
        assert torch.equal(padded, want)
