"""Capturing an encoder's budgets through its batch runner (`vitpool.graphs.runner`): largest
first, into one shared memory pool, each checked against the eager run of the same static forward
right after its capture.

A budget whose replay does not match eager (or gives a non-finite row) is disabled: its batches
run the static forward eagerly, counted in the stats. A budget the runner `wants_dense` for is
captured and checked a second time with its dense attention (`BatchRunner.dense_graphs`); that
graph is dropped where the check fails, where the tower never took the dense kernel (another hook,
a head size cuDNN cannot take), or where its attention read boundaries other than the batch's own
metadata buffer (ones it derived itself, which the runner cannot check on the host).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import random
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from vitpool.graphs.segments import SegmentedGraph, segmented_capture
from vitpool.kernels.attention import boundary_key, is_boundary, recording_leading_sequence_reads
from vitpool.kernels.cudnn_packed import bind_stream
from vitpool.packing import Budget

if TYPE_CHECKING:
    from vitpool.graphs.runner import BatchRunner

logger = logging.getLogger(__name__)

# Largest relative error (Frobenius norm) a replay may show against eager before its budget is
# disabled. Graph and eager run the same kernels, so a healthy graph is far below these.
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def capture_all(runner: BatchRunner, budgets: Sequence[Budget], pool: tuple | None = None) -> None:
    """Capture each of `budgets`, largest first, into one shared pool (`pool`, or a new one), each
    through `runner`'s fill and static forward, and check it right after; checked graphs go to
    `runner.graphs`. The runners of an encoder's paths share one pool: their graphs replay one at a
    time on one stream, and each batch's outputs are copied out before the next replay."""
    start = time.perf_counter()
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    rng = random.Random(0)
    generator = torch.Generator(device=runner.device).manual_seed(0)
    stats = runner.stats
    total = len(budgets)
    with torch.no_grad(), _no_collection_while_capturing():
        for number, budget in enumerate(sorted(budgets, reverse=True), start=1):
            budget_start = time.perf_counter()
            graph = _capture(runner, budget, pool, rng, generator)
            error = _check(runner, budget, graph, rng, generator)
            tolerance = CHECK_TOLERANCE[runner.dtype]
            if error <= tolerance:
                runner.graphs[budget] = graph
                stats.captured_budgets.append((budget.num_tokens, budget.max_sequences))
                logger.info(
                    "captured budget %d/%d: %d tokens (%d rows), limits %s, %d items in %.2f s "
                    "(%d segments), rel. error %.1e",
                    number,
                    total,
                    budget.num_tokens,
                    runner.rows(budget),
                    dict(budget.limits),
                    budget.max_items,
                    time.perf_counter() - budget_start,
                    len(graph.segments),
                    error,
                )
            else:
                stats.disabled_budgets.append((budget.num_tokens, budget.max_sequences))
                logger.warning(
                    "budget %d tokens, limits %s disabled, it will run eager: replay vs eager "
                    "rel. error %.1e (tolerance %.0e, inf = non-finite output)",
                    budget.num_tokens,
                    dict(budget.limits),
                    error,
                    tolerance,
                )
                continue
            if runner.wants_dense(budget):
                _capture_dense(runner, budget, pool, rng, generator)
    # Give back what the eager warm-ups and checks cached; the graphs' pool stays reserved.
    torch.cuda.empty_cache()
    stats.capture_seconds = time.perf_counter() - start
    logger.info(
        "captured %d of %d budgets in %.2f s (%.2f GiB reserved on %s, weights included)",
        len(runner.graphs),
        total,
        stats.capture_seconds,
        torch.cuda.memory_reserved(runner.device) / 1024**3,
        runner.device,
    )


def _capture_dense(
    runner: BatchRunner, budget: Budget, pool: tuple, rng: random.Random, generator: torch.Generator
) -> None:
    with recording_leading_sequence_reads() as reads:
        graph = _capture(runner, budget, pool, rng, generator, dense=True)
    _, metadata = runner.buffers.input_views(runner.rows(budget), budget)
    checked = {boundary_key(t) for t in metadata.values() if is_boundary(t)}
    if not reads or not set(reads) <= checked:
        logger.debug(
            "budget %d tokens: no dense graph (%s)",
            budget.num_tokens,
            "the tower's attention never took it: another hook, or a head size over 120"
            if not reads
            else "the tower's attention reads boundaries of its own",
        )
        return
    error = _check(runner, budget, graph, rng, generator, dense=True)
    if error <= CHECK_TOLERANCE[runner.dtype]:
        runner.dense_graphs[budget] = graph
        runner.stats.dense_graphs.append((budget.num_tokens, budget.max_sequences))
        logger.info(
            "captured the dense graph of %d tokens, limits %s: rel. error %.1e",
            budget.num_tokens,
            dict(budget.limits),
            error,
        )
    else:
        logger.warning(
            "budget %d tokens, limits %s: dense graph dropped (replay vs eager rel. error %.1e)",
            budget.num_tokens,
            dict(budget.limits),
            error,
        )


@contextlib.contextmanager
def _no_collection_while_capturing() -> Iterator[None]:
    """Collect garbage once, then keep Python's automatic collection off until every budget is
    captured. A CUDA graph left in a reference cycle (of an earlier encoder, or of the caller's
    objects) is freed only by the collector, and freeing it destroys its executable graph, which
    CUDA forbids while a stream captures: the capture is invalidated ("operation not permitted
    when stream is capturing (function reset)"; benchmarks/HISTORY.md, "Runs that overlap,
    measured"). torch 2.11 no longer collects before a capture."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _capture(
    runner: BatchRunner,
    budget: Budget,
    pool: tuple,
    rng: random.Random,
    generator: torch.Generator,
    dense: bool = False,
) -> SegmentedGraph:
    runner.fill_random(budget, rng, generator)
    # warm-up on a side stream: lazy initialisation (cuBLAS handles, kernels, cuDNN plans) stays
    # out of the graph
    side_stream = torch.cuda.Stream(runner.device)
    side_stream.wait_stream(torch.cuda.current_stream(runner.device))
    with torch.cuda.stream(side_stream):
        _forward_into_outputs(runner, budget, dense)
    torch.cuda.current_stream(runner.device).wait_stream(side_stream)
    # Every capture runs on one stream per device, to which cuDNN's handle is bound here, outside
    # the capture: cudnnSetStream inside a capture failed (cudaErrorStreamCaptureInvalidated).
    # (Warmed up on the capture stream itself, the graphs' startup memory grew several-fold.)
    stream = _capture_stream(runner.device)
    bind_stream(runner.device, stream)
    cuts = runner.cut_points(budget)
    with _workspace_in_graph_pool():
        if not cuts:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                _forward_into_outputs(runner, budget, dense)
            return SegmentedGraph([graph])
        with segmented_capture(cuts, pool, runner.device, stream) as graphs:
            _forward_into_outputs(runner, budget, dense)
        return SegmentedGraph(graphs)


@functools.cache
def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every capture on `device` runs on (as torch.cuda.graph's own shared one)."""
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def _workspace_in_graph_pool() -> Iterator[None]:
    """Let the capture allocate cuBLAS's workspace in the graphs' own pool, and forget it after.

    cuBLAS keeps one workspace per (handle, stream) in a process-wide cache, and a graph bakes in
    the address it used at capture. Captured with a cached workspace, the graphs depend on memory
    they do not own: PyTorch's CUDA-graph trees (`torch.compile(mode="reduce-overhead")`) clear
    that cache around every recording, and once the memory is handed back the replays write
    their GEMM workspace into freed or reused memory. An encoder dropped after capturing left the
    workspace of torch.cuda.graph's shared capture stream in its released pool, the next encoder
    captured with it, and after a compiled model ran beside it the replays slowed several-fold and
    then faulted ("unspecified launch failure"; benchmarks/HISTORY.md, "An encoder beside
    CUDA-graph trees in one process"). Cleared before the
    capture, the workspace is allocated inside it, from the pool that lives as long as the
    graphs and serves only their captures (which never run at once); cleared after, no cache
    points into that pool. PyTorch's graph trees do the same around their recordings.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    try:
        yield
    finally:
        if clear is not None:
            clear()


def _forward_into_outputs(runner: BatchRunner, budget: Budget, dense: bool = False) -> None:
    # Copy into the shared output buffers, so no graph keeps outputs of its own alive in the pool.
    outputs = runner.static_forward(budget, dense)
    for target, output in zip(runner.buffers.output_views(budget.num_tokens), outputs):
        target.copy_(output[: budget.num_tokens])


def _check(
    runner: BatchRunner,
    budget: Budget,
    graph: SegmentedGraph,
    rng: random.Random,
    generator: torch.Generator,
    dense: bool = False,
) -> float:
    """Replay on fresh random items and compare with eager; inf if any output row is non-finite."""
    runner.fill_random(budget, rng, generator)
    graph.replay()
    replayed = runner.buffers.output_views(budget.num_tokens)
    eager = [output[: budget.num_tokens] for output in runner.static_forward(budget, dense)]
    error = 0.0
    for got, expected in zip(replayed, eager):
        if not bool(torch.isfinite(got).all()):
            return float("inf")
        difference = torch.linalg.vector_norm((got - expected).float())
        scale = torch.linalg.vector_norm(expected.float()).clamp_min(1e-12)
        error = max(error, float(difference / scale))
    return error
