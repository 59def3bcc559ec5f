"""Which attention kernel a graph is captured with and an eager batch runs with: pure rules over
the batch's shape (the kernels themselves run on the GPU: tests/gpu)."""

from __future__ import annotations

import itertools

import pytest
import torch

from vitpool.kernels import attention
from vitpool.kernels.attention import (
    CUDNN_MIN_ROWS_PER_SEQUENCE,
    CUDNN_PACKED,
    CUDNN_PACKED_ONLY,
    DENSE_BUCKET_ROWS,
    FA4_MIN_ROWS_PER_SEQUENCE,
    dense_attention,
    eager_backend,
    forced_backend,
    graph_backend,
    leading_sequence_attention,
    wants_dense_graph,
)
from vitpool.kernels.cudnn_packed import bucketed_shape, cudnn_packed_available, cudnn_packed_takes

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fa4(monkeypatch):
    """Pretend FlashAttention-4 can run (or not) on the GPU, and packed cuDNN not (unless
    `packed=True`)."""

    def set_available(available: bool, packed: bool = False) -> None:
        monkeypatch.setattr(attention, "fa4_available", lambda device: available)
        monkeypatch.setattr(attention, "cudnn_packed_available", lambda device: packed)

    return set_available


@pytest.mark.parametrize(
    "choice, available, rows, sequences, expected",
    [
        ("auto", True, 4096, 4, "fa4"),  # few sequences: long ones
        ("auto", True, 1152, 4, "fa2"),  # few, but at most 288 rows each on average
        ("auto", True, 4096, 32, "fa2"),  # many short sequences
        ("auto", True, 65536, 32, "fa4"),  # many, but long on average
        ("auto", False, 4096, 4, "fa2"),  # not installed: the fallback
        ("fa2", True, 4096, 1, "fa2"),
        ("fa4", False, 256, 64, "fa4"),  # forced (the encoder refuses it where it cannot run)
    ],
)
def test_a_graph_takes_fa4_where_its_sequences_may_be_long(fa4, choice, available, rows, sequences, expected):
    fa4(available)
    assert graph_backend(choice, CUDA, rows, sequences) == expected


@pytest.mark.parametrize(
    "boundaries, rows, fa4_here, cudnn_here, expected",
    [
        ((0, 9216, 9216), 9216, True, True, "fa4"),  # one long image, a trailing empty sequence
        ((0, 3136, 3136), 3136, True, True, "cudnn"),  # too short to pay FA4's set-up per new size
        ((0, 3136, 3136), 3136, True, False, "fa2"),  # neither: FA2
        ((0, 9216), 9216, False, True, "cudnn"),  # the default install on Hopper
        ((0, 9216), 9216, False, False, "fa2"),  # ... on an older GPU
        ((0, 576, 1152, 1728, 2304), 2304, False, True, "fa2"),  # a clip's short frames
        ((0, 576, 1152, 1728, 2304), 2304, True, True, "fa2"),  # frames shorter than FA4's threshold
        ((0, 2048, 6144), 6144, False, True, "cudnn"),  # two long sequences: one call each
        ((0, 2000, 6000), 6000, False, True, "fa2"),  # one of them short: FA2 for the batch
        (tuple(range(0, 17 * 2048 + 1, 2048)), 17 * 2048, False, True, "fa2"),  # too many calls
        ((0, 8192, 16384), 16384, True, True, "fa4"),
        ((0, 4900, 4900), 4900, True, True, "fa4"),  # one 1120² image
        ((0, 100), 100, True, True, "fa2"),  # one short sequence: FA2
        ((0, 3136), 3200, True, True, "fa2"),  # rows not all covered: boundaries not understood
        ((0, 0), 0, True, True, "fa2"),
    ],
)
def test_an_eager_batch_picks_from_its_boundaries(boundaries, rows, fa4_here, cudnn_here, expected):
    assert eager_backend(boundaries, rows, fa4_here, cudnn_here) == expected


@pytest.mark.parametrize(
    "choice, fa4_here, packed_here, rows, sequences, expected",
    [
        ("auto", False, True, 4096, 64, CUDNN_PACKED),  # the default install on Hopper: every graph
        ("auto", False, True, 256, 1, CUDNN_PACKED),
        ("auto", True, True, 4096, 4, "fa4"),  # FA4 installed: still its long sequences
        ("auto", True, True, 4096, 32, CUDNN_PACKED),  # ... and packed cuDNN for the short ones
        ("auto", False, False, 4096, 64, "fa2"),  # neither runs: the fallback
        (
            "cudnn",
            False,
            False,
            4096,
            64,
            CUDNN_PACKED_ONLY,
        ),  # forced (the encoder refuses it where it cannot run)
        ("fa2", True, True, 4096, 4, "fa2"),
    ],
)
def test_a_graph_takes_packed_cudnn_where_it_runs(
    fa4, choice, fa4_here, packed_here, rows, sequences, expected
):
    fa4(fa4_here, packed=packed_here)
    assert graph_backend(choice, CUDA, rows, sequences) == expected


@pytest.mark.parametrize(
    "boundaries, rows, fa4_here, expected",
    [
        ((0, 576, 1152, 1728, 2304), 2304, False, CUDNN_PACKED),  # a clip's short frames
        ((0, 100), 100, False, CUDNN_PACKED),
        ((0, 2000, 6000), 6000, False, CUDNN_PACKED),  # a short and a long sequence: one call
        ((0, 9216, 9216), 9216, True, "fa4"),  # FA4 installed keeps its long sequences
        ((0, 3136), 3200, False, "fa2"),  # rows not all covered: boundaries not understood
    ],
)
def test_an_eager_batch_takes_packed_cudnn_where_it_runs(boundaries, rows, fa4_here, expected):
    assert eager_backend(boundaries, rows, fa4_here, True, cudnn_packed=True) == expected


def test_no_dense_graph_where_the_graphs_run_packed_cudnn(fa4, monkeypatch):
    monkeypatch.setattr(attention, "cudnn_available", lambda device: True)
    fa4(False, packed=True)
    assert not wants_dense_graph("auto", CUDA, 4096, 64)
    fa4(False, packed=False)  # the FA2 fallback keeps its dense graph for one large image
    assert wants_dense_graph("auto", CUDA, 4096, 64)


@pytest.mark.parametrize(
    "sequences, longest, expected",
    [(1, 1, (1, 512)), (3, 600, (4, 1024)), (4, 1024, (4, 1024)), (5, 9604, (8, 16384)), (0, 0, (1, 512))],
)
def test_an_eager_batch_plan_is_rounded_up_to_few_shapes(sequences, longest, expected):
    assert bucketed_shape(sequences, longest) == expected
    plan_sequences, plan_length = bucketed_shape(sequences, longest)
    assert plan_sequences >= sequences and plan_length >= longest


def test_an_encoder_choice_forces_its_kernel_on_eager_batches():
    assert forced_backend("auto") is None
    assert forced_backend("cudnn") == CUDNN_PACKED_ONLY
    assert forced_backend("fa2") == "fa2" and forced_backend("fa4") == "fa4"


def test_packed_cudnn_is_never_available_off_the_gpu():
    assert cudnn_packed_available(torch.device("cpu")) is False


@pytest.mark.parametrize(
    "head_dim, dtype, takes",
    [
        (72, torch.bfloat16, True),
        (128, torch.float16, True),
        (80, torch.bfloat16, True),
        (100, torch.bfloat16, False),
        (136, torch.bfloat16, False),
        (72, torch.float32, False),
    ],
)
def test_packed_cudnn_takes_head_sizes_multiple_of_8_up_to_128_in_half_precision(head_dim, dtype, takes):
    assert cudnn_packed_takes(head_dim, dtype) is takes


def test_a_cpu_encoder_takes_the_cudnn_choice_and_encodes_as_auto():
    """On a CPU every choice runs the block-diagonal SDPA: "cudnn" is accepted there (a pool's
    settings travel to GPU and CPU actors alike) and gives the same tokens."""
    from vitpool import GraphEncoder, Image

    item = Image(torch.randn(64, 1536, generator=torch.Generator().manual_seed(1)), (1, 8, 8))
    auto = GraphEncoder.from_pretrained(None, budgets=[64], device="cpu").encode([item])[0]
    forced = GraphEncoder.from_pretrained(None, budgets=[64], device="cpu", attention="cudnn").encode([item])[
        0
    ]
    assert torch.equal(auto.tokens, forced.tokens)


def test_an_unknown_attention_choice_names_the_choices():
    from vitpool.encoder_spec import EncoderOptions
    from vitpool.errors import ConfigError

    with pytest.raises(ConfigError, match="cudnn"):
        EncoderOptions(attention="cudnn-packed")


@pytest.mark.parametrize("lengths", [[300], [DENSE_BUCKET_ROWS], [1, 513, 40], [700, 0, 129]])
def test_dense_attention_masks_its_padding_exactly(lengths):
    """Per sequence, padded to a bucket with the padding keys masked by an extra head dimension:
    equal (fp32) to attention over each sequence alone, whatever the padding."""
    generator = torch.Generator().manual_seed(len(lengths))
    rows, heads, head_dim = sum(lengths), 3, 72
    q, k, v = (torch.randn(rows, heads, head_dim, generator=generator) * 3 for _ in range(3))
    boundaries = (0, *itertools.accumulate(lengths))
    got = dense_attention(q, k, v, boundaries, 0.1)
    for start, end in itertools.pairwise(boundaries):
        if end > start:
            want = torch.nn.functional.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1) for t in (q, k, v)), scale=0.1
            ).transpose(0, 1)
            torch.testing.assert_close(got[start:end], want, rtol=1e-5, atol=1e-5)


def test_dense_attention_leaves_rows_outside_every_sequence_zero():
    q = torch.randn(40, 2, 16)
    got = dense_attention(q, q, q, (0, 30), None)
    assert torch.equal(got[30:], torch.zeros(10, 2, 16)) and got[:30].abs().sum() > 0


def test_the_thresholds_are_between_the_measured_points():
    from vitpool.kernels.attention import FA4_MIN_ROWS_PER_GRAPH_SEQUENCE

    # in graphs FA4 lost at 256-row sequences and won at 3136; eagerly it won every repeated call
    # from 4356 rows (1056²) on, and lost at 3136 on the first call (H100, benchmarks/HISTORY.md)
    assert 256 < FA4_MIN_ROWS_PER_GRAPH_SEQUENCE <= 3136
    assert 3136 < FA4_MIN_ROWS_PER_SEQUENCE <= 4356
    # one eager call: padded cuDNN lost to FA2 at 1024 rows and won from 3136 (H100)
    assert 1024 < CUDNN_MIN_ROWS_PER_SEQUENCE <= 3136


def test_fa4_is_never_available_off_the_gpu():
    assert attention.fa4_available(torch.device("cpu")) is False


def test_leading_sequence_attention_is_exact_for_the_sequence_and_finite_for_the_padding():
    """A dense graph's attention: every row over the first sequence's keys only, its end read from
    the device tensor (as in a captured graph)."""
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(96, 2, 72, generator=generator) * 3 for _ in range(3))
    cu_seqlens = torch.tensor([0, 70, 96, 96], dtype=torch.int32)
    got = leading_sequence_attention(q, k, v, cu_seqlens, None)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t[:70].transpose(0, 1) for t in (q, k, v))
    ).transpose(0, 1)
    torch.testing.assert_close(got[:70], want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all() and got.is_contiguous()


def _tiny_runner():
    from vitpool import GraphEncoder

    encoder = GraphEncoder.from_pretrained(None, budgets=[64, 256], device="cpu")
    return encoder, encoder._runners[""]


@pytest.mark.parametrize(
    "items, fills_one_sequence",
    [
        ([("image", (1, 16, 16))], True),  # one image: one sequence, then padding
        ([("image", (1, 16, 16)), ("image", (1, 8, 8))], False),  # two sequences
        ([("video", (2, 8, 8))], False),  # a video: one sequence per temporal patch
        ([("video", (1, 16, 16))], True),  # a one-frame clip is one sequence too
    ],
)
def test_a_batch_is_one_leading_sequence_only_when_one_item_of_one_sequence(items, fills_one_sequence):
    from vitpool.graphs.runner import _leading_sequence_rows

    encoder, runner = _tiny_runner()
    rules, row_shape = encoder.adapter.item_rules, encoder.adapter.row_shape
    specs = [
        rules.item_spec(kind, (grid[0] * grid[1] * grid[2], *row_shape), "float32", grid)
        for kind, grid in items
    ]
    budget = encoder.budgets[-1]
    rows = runner.rows(budget)
    metadata = encoder.adapter.build_metadata(specs, rows, budget)
    expected = sum(spec.pixel_shape[0] for spec in specs) if fills_one_sequence else 0
    assert _leading_sequence_rows(specs, metadata, rows) == expected
