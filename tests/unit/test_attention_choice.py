"""Which attention kernel a graph is captured with and an eager batch runs with: pure rules over
the batch's shape (the kernels themselves run on the GPU: tests/gpu)."""

from __future__ import annotations

import itertools

import pytest
import torch

from vitpool.kernels import attention
from vitpool.kernels.attention import (
    CUDNN_MIN_ROWS_PER_SEQUENCE,
    DENSE_BUCKET_ROWS,
    FA4_MIN_ROWS_PER_SEQUENCE,
    dense_attention,
    eager_backend,
    graph_backend,
    leading_sequence_attention,
)

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fa4(monkeypatch):
    """Pretend FlashAttention-4 can run (or not) on the GPU."""

    def set_available(available: bool) -> None:
        monkeypatch.setattr(attention, "fa4_available", lambda device: available)

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
    specs = [rules.item_spec(kind, (grid[0] * grid[1] * grid[2], *row_shape), "float32", grid) for kind, grid in items]
    budget = encoder.budgets[-1]
    rows = runner.rows(budget)
    metadata = encoder.adapter.build_metadata(specs, rows, budget)
    expected = sum(spec.pixel_shape[0] for spec in specs) if fills_one_sequence else 0
    assert _leading_sequence_rows(specs, metadata, rows) == expected
