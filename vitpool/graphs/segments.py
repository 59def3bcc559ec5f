"""Runs that the urgent lane's small batches can interrupt: a budget's graph captured as several
graphs, cut between the tower's blocks, and one thread that replays them with urgent batches in
between.

Why: a small batch that arrives while a 1024-token run is on the GPU waits for all of it, longer
than a small call's own latency, and a CUDA stream of higher priority does not help (its
kernels share the SMs with the run's and slow both). Cut into segments, the run is replayed one
segment at a time, and a small batch that waits goes between two of them, on the same stream, so
it waits for the segments already queued and no more (`benchmarks/studies/small_call_tails.py`
models what that buys). Under load that cuts small calls' median and tail sharply but costs some
saturated throughput, so it is off by default (`EncoderOptions.urgent_tokens`). Figures:
`benchmarks/RESULTS.md`, "Small calls under load".

The cuts need nothing of the model: the forward is captured as usual, and a forward pre-hook on
every `BLOCKS_PER_SEGMENT`-th block of the tower's longest stack of repeated blocks ends the graph
being captured and begins the next, into the same memory pool. A tensor that crosses a cut (the
hidden states, rotary tables, `cu_seqlens`) was allocated by an earlier segment and is read by a
later one; the small batches in between run from buffers and a memory pool of their own, so
nothing they write can reach it.

`Interleaver` is the one thread that queues the GPU work of both lanes: each main-lane run as its
launch function, which calls `between` after each segment; there the thread lets at most
`LOOKAHEAD_SEGMENTS` segments stay queued and launches the urgent batches that wait.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vitpool.kernels.compiled import repeated_block_stacks

# Blocks per segment: one replay per segment costs a few microseconds of host time, far less than a
# block of a large run takes on the GPU; one block a segment helped small calls little more and cost
# the other calls more (benchmarks/HISTORY.md, "Small batches that interrupt large runs").
BLOCKS_PER_SEGMENT = 2
# Segments left queued on the GPU while the feeding thread waits: enough that the GPU does not run
# dry while the thread waits for Python's lock, few enough that a small batch waits little.
LOOKAHEAD_SEGMENTS = 2


class SegmentedGraph:
    """A budget's forward as one or more CUDA graphs, replayed in order.

    Attributes:
        segments: the graphs, in the order the forward runs them.
    """

    def __init__(self, segments: list[torch.cuda.CUDAGraph]) -> None:
        self.segments = segments

    def replay(self, between: Callable[[], None] | None = None) -> None:
        """Replay every segment; `between()` runs after each but the last."""
        last = len(self.segments) - 1
        for index, segment in enumerate(self.segments):
            segment.replay()
            if between is not None and index < last:
                between()


def cut_points(tower: torch.nn.Module, blocks_per_segment: int = BLOCKS_PER_SEGMENT) -> list[torch.nn.Module]:
    """The blocks before which a segmented capture starts a new graph: every
    `blocks_per_segment`-th block of the tower's longest stack of repeated blocks, the first
    excluded (none where the tower has no such stack)."""
    stacks = repeated_block_stacks(tower)
    if not stacks:
        return []
    longest = max(stacks, key=len)
    return list(longest)[blocks_per_segment::blocks_per_segment]


@contextlib.contextmanager
def segmented_capture(
    cut_before: list[torch.nn.Module],
    pool: tuple,
    device: torch.device,
    stream: torch.cuda.Stream | None = None,
) -> Iterator[list[torch.cuda.CUDAGraph]]:
    """Capture the work queued inside into graphs (the yielded list fills in), a new one begun
    wherever one of `cut_before` is about to run. As `torch.cuda.graph`: the device synchronised
    first, captured on a side stream (`stream`, or a new one), into `pool`."""
    graphs = [torch.cuda.CUDAGraph()]

    def cut(_module: torch.nn.Module, _args: Any) -> None:
        graphs[-1].capture_end()
        graphs.append(torch.cuda.CUDAGraph())
        graphs[-1].capture_begin(pool=pool)

    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device) if stream is None else stream
    handles = [block.register_forward_pre_hook(cut) for block in cut_before]
    try:
        with torch.cuda.stream(stream):
            graphs[0].capture_begin(pool=pool)
            try:
                yield graphs
            finally:
                graphs[-1].capture_end()  # also on failure: a stream left capturing breaks the device
    finally:
        for handle in handles:
            handle.remove()
    torch.cuda.current_stream(device).wait_stream(stream)


class Interleaver:
    """The thread that queues an encoder's GPU work: main-lane runs in the order given, and urgent
    work (small batches) as soon as it comes, between two segments of the run being fed.

    On a CPU device (tests) `between` keeps no events: the work is done when it returns.
    """

    def __init__(self, device: torch.device, lookahead: int = LOOKAHEAD_SEGMENTS) -> None:
        self.device = device
        self.lookahead = lookahead
        self.interrupts = 0  # urgent launches made between two segments of a run
        self._main: collections.deque[tuple[Callable, concurrent.futures.Future]] = collections.deque()
        self._urgent: collections.deque[tuple[Callable, concurrent.futures.Future]] = collections.deque()
        self._queued: collections.deque[torch.cuda.Event] = collections.deque()  # after each segment fed
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._feed, name="vitpool-interleaver", daemon=True)
        self._thread.start()

    def main(self, launch: Callable[[Callable[[], None]], Any]) -> concurrent.futures.Future:
        """Queue `launch(between)` after the main-lane launches before it; its future holds what it
        returns (or raises)."""
        return self._submit(self._main, launch)

    def urgent(self, launch: Callable[[], Any]) -> concurrent.futures.Future:
        """Queue `launch()` ahead of every main-lane launch not yet begun, and between two segments
        of the one being fed."""
        return self._submit(self._urgent, launch)

    def close(self) -> None:
        """Stop the thread once the queued launches are done."""
        with self._ready:
            self._closed = True
            self._ready.notify()

    def _submit(self, queue: collections.deque, launch: Callable) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the encoder's interleaver is closed")
            queue.append((launch, future))
            self._ready.notify()
        return future

    def between(self) -> None:
        """After a segment of a main-lane run: wait until at most `lookahead` segments are queued,
        then launch the urgent work that waits."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._queued.append(event)
            while len(self._queued) > self.lookahead:
                self._queued.popleft().synchronize()
        with self._ready:
            waiting = bool(self._urgent)
        if waiting:
            self.interrupts += self._run_urgent()

    def _feed(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._urgent or self._main or self._closed)
                if not self._urgent and not self._main:
                    return  # closed, nothing left
                task = None if self._urgent else self._main.popleft()
            if task is None:
                self._run_urgent()
            else:
                launch, future = task
                self._settle(future, functools.partial(launch, self.between))

    def _run_urgent(self) -> int:
        """Launch every urgent task waiting now; returns how many."""
        count = 0
        while True:
            with self._ready:
                if not self._urgent:
                    return count
                launch, future = self._urgent.popleft()
            self._settle(future, launch)
            count += 1

    @staticmethod
    def _settle(future: concurrent.futures.Future, launch: Callable[[], Any]) -> None:
        try:
            future.set_result(launch())
        except BaseException as raised:  # noqa: BLE001 - the caller of the future gets it
            future.set_exception(raised)
