"""Which attention kernel a graph is captured with and an eager batch runs with: pure rules over
the batch's shape (the kernels themselves run on the GPU: tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from vitpool.models import attention
from vitpool.models.attention import FA4_MIN_ROWS_PER_SEQUENCE, eager_backend, graph_backend

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
    "boundaries, rows, fa4_here, expected",
    [
        ((0, 9216, 9216), 9216, True, "fa4"),  # one long image, a trailing empty sequence
        ((0, 3136, 3136), 3136, True, "fa2"),  # not long enough to pay FA4's set-up per new size
        ((0, 3136, 3136), 3136, False, "fa2"),  # no FA4: FA2
        ((0, 576, 1152, 1728, 2304), 2304, False, "fa2"),  # a clip's frames, no FA4
        ((0, 576, 1152, 1728, 2304), 2304, True, "fa2"),  # frames shorter than FA4's threshold
        ((0, 8192, 16384), 16384, True, "fa4"),
        ((0, 4900, 4900), 4900, True, "fa4"),  # one 1120² image
        ((0, 100), 100, True, "fa2"),  # one short sequence: FA2
        ((0, 3136), 3200, True, "fa2"),  # rows not all covered: boundaries not understood
        ((0, 0), 0, True, "fa2"),
    ],
)
def test_an_eager_batch_picks_from_its_boundaries(boundaries, rows, fa4_here, expected):
    assert eager_backend(boundaries, rows, fa4_here) == expected


def test_the_thresholds_are_between_the_measured_points():
    from vitpool.models.attention import FA4_MIN_ROWS_PER_GRAPH_SEQUENCE

    # in graphs FA4 lost at 256-row sequences and won at 3136; eagerly it won every repeated call
    # from 4356 rows (1056²) on, and lost at 3136 on the first call (H100, benchmarks/HISTORY.md)
    assert 256 < FA4_MIN_ROWS_PER_GRAPH_SEQUENCE <= 3136
    assert 3136 < FA4_MIN_ROWS_PER_SEQUENCE <= 4356


def test_fa4_is_never_available_off_the_gpu():
    assert attention.fa4_available(torch.device("cpu")) is False
