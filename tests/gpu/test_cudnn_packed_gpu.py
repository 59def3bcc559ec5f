"""GPU: cuDNN's packed attention (`vitpool.kernels.cudnn_packed`) against SDPA per sequence, eager
and captured, and encoders on it against the tower at every budget. Skipped without CUDA or where
the kernel does not run (before Hopper)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close_to_reference, image, relative_error, video

from vitpool import GraphEncoder

pytestmark = pytest.mark.gpu

BUDGETS = [64, 128, 256]
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def device() -> torch.device:
    from vitpool.kernels.cudnn_packed import cudnn_packed_available

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    if not cudnn_packed_available(device):
        pytest.skip("no packed cuDNN attention on this GPU")
    return device


def per_sequence_reference(q, k, v, boundaries, scale=None):
    out = torch.zeros_like(q, dtype=torch.float32)
    for start, end in itertools.pairwise(boundaries):
        if end > start:
            out[start:end] = F.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1).float() for t in (q, k, v)), scale=scale
            ).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lengths, slots",
    [([196] * 6, 6), ([1024, 7, 513, 300], 9), ([4096, 0], 2), ([64, 0, 200, 0], 12)],
)
def test_packed_cudnn_equals_sdpa_per_sequence_eager_and_captured(device, dtype, lengths, slots):
    """Sequences of varied lengths (empty ones and unused slots too), q/k/v as strided views of one
    fused projection as the towers make them (16 heads of 72, as most); the captured graph replayed
    on fresh inputs with its output poisoned first gives the same, every row written and finite."""
    from vitpool.kernels.cudnn_packed import packed_cudnn_attention

    generator = torch.Generator(device=device).manual_seed(sum(lengths))
    rows, heads, head_dim = sum(lengths), 16, 72
    boundaries = [0, *itertools.accumulate(lengths)]
    boundaries += [rows] * (slots + 1 - len(boundaries))
    cu_seqlens = torch.tensor(boundaries, device=device, dtype=torch.int32)
    fused = torch.randn((rows, 3, heads, head_dim), device=device, dtype=dtype, generator=generator)
    q, k, v = fused.unbind(1)
    assert not q.is_contiguous()
    got = packed_cudnn_attention(q, k, v, cu_seqlens, max(lengths), 0.1)
    assert got is not None  # the towers' shapes have plans of small workspaces
    assert torch.isfinite(got).all()
    assert relative_error(got, per_sequence_reference(q, k, v, boundaries, 0.1)) <= TOLERANCE
    # more plan sequences than the boundaries hold, as an eager batch's rounded plan has
    wider = packed_cudnn_attention(q, k, v, cu_seqlens, 2 * max(lengths), 0.1, sequences=2 * slots)
    assert relative_error(wider, got) <= TOLERANCE

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        packed_cudnn_attention(q, k, v, cu_seqlens, max(lengths), 0.1)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # warmed up on the capture's stream, as the encoder does
        captured = packed_cudnn_attention(q, k, v, cu_seqlens, max(lengths), 0.1)
    fused.copy_(torch.randn(fused.shape, device=device, dtype=dtype, generator=generator))
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.isfinite(captured).all()
    assert relative_error(captured, per_sequence_reference(q, k, v, boundaries, 0.1)) <= TOLERANCE


def test_a_shape_whose_plan_needs_a_large_workspace_is_declined_and_the_hook_runs_fa2(device):
    """One sequence over few heads: where cuDNN's plan is a split engine (megabytes of workspace,
    which failed to capture), the kernel declines (None) and the attention hook gives FA2's result."""
    from torch.nn.attention.varlen import varlen_attn

    from vitpool.kernels import cudnn_packed
    from vitpool.kernels.attention import CUDNN_PACKED, flash_varlen, use_attention

    q, k, v = (torch.randn((4096, 4, 72), device=device, dtype=torch.bfloat16) for _ in range(3))
    cu_seqlens = torch.tensor([0, 4096], device=device, dtype=torch.int32)
    got = cudnn_packed.packed_cudnn_attention(q, k, v, cu_seqlens, 4096, None)
    plan = list(cudnn_packed._PLANS._plans.values())[-1]  # the plan just built (or found) for this shape
    assert (got is None) == (plan.workspace_size > cudnn_packed.MAX_WORKSPACE_BYTES)
    with use_attention(CUDNN_PACKED):
        hooked = flash_varlen(q, k, v, cu_seqlens, cu_seqlens, 4096, 4096, None)
    want = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, 4096, 4096)
    assert relative_error(hooked, want) <= TOLERANCE
    print(f"1 x 4096 rows, 4 heads: workspace {plan.workspace_size} bytes, declined {got is None}")


def test_a_plan_that_loses_its_race_declines_from_then_on_and_one_that_wins_runs(device):
    """The race against the caller's other kernel, on a plan's first call: a rival that costs nothing
    wins and the shape declines (None) on every later call, raced or not; a rival slower than cuDNN
    loses and the plan runs, its output the per-sequence attention."""
    from vitpool.kernels import cudnn_packed

    q, k, v = (torch.randn((600, 8, 64), device=device, dtype=torch.bfloat16) for _ in range(3))
    cu_seqlens = torch.tensor([0, 100, 600], device=device, dtype=torch.int32)
    raced = []

    def instant():
        raced.append("instant")
        return q

    # sequence counts no other test uses: plans of their own, never raced before
    assert (
        cudnn_packed.packed_cudnn_attention(q, k, v, cu_seqlens, 600, None, sequences=11, rival=instant)
        is None
    )
    assert raced  # it ran in the race
    raced.clear()
    assert (
        cudnn_packed.packed_cudnn_attention(q, k, v, cu_seqlens, 600, None, sequences=11, rival=instant)
        is None
    )
    assert cudnn_packed.packed_cudnn_attention(q, k, v, cu_seqlens, 600, None, sequences=11) is None
    assert raced == []  # the verdict is kept: no second race
    big = torch.randn((4096, 4096), device=device, dtype=torch.bfloat16)

    def slow():
        return big @ big

    got = cudnn_packed.packed_cudnn_attention(q, k, v, cu_seqlens, 600, None, sequences=13, rival=slow)
    assert got is not None and torch.isfinite(got).all()
    assert relative_error(got, per_sequence_reference(q, k, v, [0, 100, 600])) <= TOLERANCE


@pytest.fixture(scope="module")
def cudnn_encoder(device) -> GraphEncoder:
    return GraphEncoder.from_pretrained(
        None, budgets=BUDGETS, device="cuda", dtype=torch.bfloat16, attention="cudnn"
    )


@pytest.fixture(scope="module")
def reference_tower(cudnn_encoder):
    tower = copy.deepcopy(cudnn_encoder.adapter.tower)
    tower.config._attn_implementation = "sdpa"
    return tower


def test_an_encoder_on_packed_cudnn_builds_its_plans_at_startup(device):
    """Every budget's graph is captured with packed cuDNN: its plans are built while the encoder
    starts (one per budget and attention shape), and a replay builds none."""
    from vitpool.kernels import cudnn_packed

    before = cudnn_packed.plans_built()
    encoder = GraphEncoder.from_pretrained(None, budgets=[48, 96], device="cuda", attention="cudnn")
    assert cudnn_packed.plans_built() - before >= 2
    assert encoder.stats().dense_graphs == [] and encoder.stats().disabled_budgets == []
    started = cudnn_packed.plans_built()
    encoder.encode([image(8, 8), image(12, 10), video(2, 6, 6)])
    assert cudnn_packed.plans_built() == started


@pytest.mark.parametrize(
    "budget, grids", [(64, [(10, 10), (4, 8)]), (128, [(14, 14), (8, 10)]), (256, [(20, 20), (12, 12)])]
)
def test_graph_on_packed_cudnn_matches_the_tower_per_budget(cudnn_encoder, reference_tower, budget, grids):
    items = [image(h, w, torch.Generator().manual_seed(budget + h)) for h, w in grids]
    before = cudnn_encoder.stats()
    embeddings = cudnn_encoder.encode(items)
    after = cudnn_encoder.stats()
    assert after.replays_per_budget.get(budget, 0) == before.replays_per_budget.get(budget, 0) + 1
    assert_close_to_reference(reference_tower, items, embeddings)


def test_packed_cudnn_big_then_small_equals_fresh_and_video(cudnn_encoder, reference_tower):
    small = [image(4, 6, torch.Generator().manual_seed(3))]
    fresh = GraphEncoder.from_pretrained(None, budgets=[256], device="cuda", attention="cudnn").encode(small)[
        0
    ]
    cudnn_encoder.encode([image(30, 30), video(2, 8, 8)])
    assert torch.equal(cudnn_encoder.encode(small)[0].tokens, fresh.tokens)
    clip = [video(4, 8, 8, torch.Generator().manual_seed(7)), image(6, 10, torch.Generator().manual_seed(8))]
    assert_close_to_reference(reference_tower, clip, cudnn_encoder.encode(clip))


def test_an_eager_batch_on_packed_cudnn_matches_the_tower(cudnn_encoder, reference_tower):
    """Too large for every budget: eager at its own rows, on a rounded plan."""
    items = [
        image(40, 40, torch.Generator().manual_seed(21)),
        video(4, 24, 24, torch.Generator().manual_seed(22)),
    ]
    before = cudnn_encoder.stats()
    assert_close_to_reference(reference_tower, items, cudnn_encoder.encode(items))
    assert cudnn_encoder.stats().eager_items > before.eager_items


def test_the_boundaries_derived_inputs_are_shared_within_one_forward_and_fresh_in_the_next(device):
    """Every layer of one forward reads the same boundaries: their lengths and offsets are derived
    once. The next forward, with other boundaries in the same buffer, derives them again."""
    from vitpool.kernels import cudnn_packed

    q, k, v = (torch.randn((512, 16, 72), device=device, dtype=torch.bfloat16) for _ in range(3))
    cu_seqlens = torch.tensor([0, 100, 512, 512], device=device, dtype=torch.int32)
    for boundaries in ([0, 100, 512, 512], [0, 300, 400, 512]):
        cu_seqlens.copy_(torch.tensor(boundaries, device=device, dtype=torch.int32))
        with cudnn_packed.one_forward():
            first = cudnn_packed.packed_cudnn_attention(q, k, v, cu_seqlens, 512, None)
            second = cudnn_packed.packed_cudnn_attention(q, k, v, cu_seqlens, 512, None)
            assert len(cudnn_packed._DERIVED.get()) == 1
        assert torch.equal(first, second)
        assert relative_error(first, per_sequence_reference(q, k, v, boundaries)) <= TOLERANCE
