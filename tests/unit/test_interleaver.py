"""The thread that queues an encoder's work when small batches may interrupt runs
(`vitpool.graphs.segments.Interleaver`), and where a segmented capture cuts a tower. On a CPU the
interleaver keeps no CUDA events; the order of launches is what is tested here (the GPU tests
check segmented graphs against eager)."""

from __future__ import annotations

import threading

import pytest
import torch

from vitpool.graphs.segments import Interleaver, SegmentedGraph, cut_points


@pytest.fixture
def interleaver():
    feeder = Interleaver(torch.device("cpu"))
    yield feeder
    feeder.close()


def test_urgent_work_runs_between_two_segments_of_the_run_being_fed(interleaver):
    order: list[str] = []
    started, urgent_submitted = threading.Event(), threading.Event()

    def main_run(between) -> str:
        order.append("segment 0")
        started.set()
        urgent_submitted.wait(5)  # the small batch arrives while segment 0 is queued
        between()
        order.append("segment 1")
        between()
        order.append("segment 2")
        return "main"

    main = interleaver.main(main_run)
    assert started.wait(5)
    urgent = interleaver.urgent(lambda: order.append("small") or "small")
    urgent_submitted.set()
    assert main.result(5) == "main" and urgent.result(5) == "small"
    assert order == ["segment 0", "small", "segment 1", "segment 2"]
    assert interleaver.interrupts == 1


def test_main_runs_keep_their_order_and_urgent_work_goes_ahead_of_those_not_begun(interleaver):
    order: list[str] = []
    started, release = threading.Event(), threading.Event()

    def blocking(between) -> None:
        started.set()
        release.wait(5)
        order.append("first")

    first = interleaver.main(blocking)
    assert started.wait(5)
    later = [interleaver.main(lambda between, n=n: order.append(f"main {n}")) for n in range(3)]
    small = interleaver.urgent(lambda: order.append("small"))
    release.set()
    for future in [first, *later, small]:
        future.result(5)
    assert order == ["first", "small", "main 0", "main 1", "main 2"]
    assert interleaver.interrupts == 0  # no segment boundary was crossed


def test_a_launch_that_raises_fails_its_own_future_only(interleaver):
    def broken(between) -> None:
        raise torch.cuda.OutOfMemoryError("out of memory (test)")

    failed = interleaver.main(broken)
    fine = interleaver.main(lambda between: 7)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        failed.result(5)
    assert fine.result(5) == 7


def test_a_closed_interleaver_refuses_new_work_after_finishing_the_queued():
    feeder = Interleaver(torch.device("cpu"))
    queued = feeder.main(lambda between: "done")
    feeder.close()
    assert queued.result(5) == "done"
    with pytest.raises(RuntimeError, match="closed"):
        feeder.urgent(lambda: None)


class _Block(torch.nn.Module):
    def forward(self, x):
        return x + 1


def test_cuts_fall_before_every_second_block_of_the_longest_stack():
    tower = torch.nn.Module()
    tower.merger = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])  # shorter stack
    tower.blocks = torch.nn.ModuleList([_Block() for _ in range(7)])
    cuts = cut_points(tower, blocks_per_segment=2)
    assert cuts == [tower.blocks[2], tower.blocks[4], tower.blocks[6]]
    assert cut_points(torch.nn.Linear(2, 2)) == []  # no repeated blocks: one graph


def test_a_segmented_graph_calls_between_after_every_segment_but_the_last():
    class Counting:
        def __init__(self, log, name):
            self.log, self.name = log, name

        def replay(self):
            self.log.append(self.name)

    log: list[str] = []
    graph = SegmentedGraph([Counting(log, "a"), Counting(log, "b"), Counting(log, "c")])
    graph.replay(lambda: log.append("|"))
    assert log == ["a", "|", "b", "|", "c"]
    log.clear()
    graph.replay()
    assert log == ["a", "b", "c"]
