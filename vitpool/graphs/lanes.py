"""Where an encoder's batches run: one batch runner per path, captured at startup; the urgent
lane beside the main one, with the thread that interleaves their work; and the halving of runs
that run out of device memory, the one place that does it, for a caller's items and for batches
a pool planned alike.

A path is a family's input of its own shape (`vitpool.rules.paths`): each has its own buffers,
budgets and graphs. The urgent lane (`urgent_tokens`, on a GPU, one path) is a second runner over
the small budgets, captured into a memory pool of its own, whose replays go between two segments
of a main-lane run (`vitpool.graphs.segments`).
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from collections.abc import Mapping, Sequence

import torch

from vitpool.errors import InvalidItemError
from vitpool.graphs.capture import capture_all
from vitpool.graphs.in_flight import LaunchedBatches, PendingLaunch, PlansInFlight, RunBatch, SettledBatches
from vitpool.graphs.out_of_memory import OutOfMemory, or_out_of_memory, out_of_memory_reason
from vitpool.graphs.runner import BatchRunner
from vitpool.graphs.segments import Interleaver
from vitpool.graphs.stats import EncoderStats
from vitpool.items import Embedding
from vitpool.models import VisionAdapter
from vitpool.packing import Budget

logger = logging.getLogger(__name__)

# Per run, per item: its Embedding; None where its pixels were not finite; an InvalidItemError
# (its position in its run) where it alone did not fit the device's memory.
RunOutcomes = list[list[Embedding | InvalidItemError | None]]


class Lanes:
    """The runners of one encoder, captured when built (on a GPU)."""

    def __init__(
        self,
        paths: Mapping[str, VisionAdapter],
        budgets_of: Mapping[str, list[Budget]],
        device: torch.device,
        dtype: torch.dtype,
        attention: str,
        fused_ops: bool,
        compiled_blocks: bool,
        precision: str,
        urgent_tokens: int | None,
    ) -> None:
        self.device = device
        self._runner_options = (device, dtype, attention, fused_ops, compiled_blocks)
        self._precision = precision
        self.runners = {path: self._new_runner(adapter, budgets_of[path]) for path, adapter in paths.items()}
        self.urgent: BatchRunner | None = None
        self.interleaver: Interleaver | None = None
        self.urgent_budgets: frozenset[Budget] = frozenset()
        self._oom_lock = threading.Lock()  # runs out of memory may be collected on several threads
        self._oom_splits = 0
        if device.type != "cuda":
            return
        if urgent_tokens is not None and len(paths) == 1:
            self._start_urgent_lane(paths[""], urgent_tokens, budgets_of[""])
        pool = torch.cuda.graph_pool_handle()  # one memory pool for every path's graphs: they replay in turn
        for path, runner in self.runners.items():
            capture_all(runner, budgets_of[path], pool)
        if self.urgent is not None:
            capture_all(self.urgent, sorted(self.urgent_budgets), torch.cuda.graph_pool_handle())

    def _new_runner(self, adapter: VisionAdapter, budgets: list[Budget]) -> BatchRunner:
        return BatchRunner(adapter, budgets, *self._runner_options, precision=self._precision)

    def _start_urgent_lane(self, adapter: VisionAdapter, urgent_tokens: int, budgets: list[Budget]) -> None:
        """The urgent lane's runner (its own buffers, captured into a memory pool of its own: its
        graphs replay between two segments of a main-lane run, whose tensors that cross the cut
        live in the main pool), the main lane's budgets above it cut into segments, and the thread
        that queues both lanes' work."""
        ordered = sorted(budgets)
        cutoff = next(
            (b.num_tokens for b in ordered if b.num_tokens >= urgent_tokens), ordered[-1].num_tokens
        )
        urgent_budgets = [b for b in ordered if b.num_tokens <= cutoff]
        self.urgent = self._new_runner(adapter, urgent_budgets)
        self.runners[""].segment_above_tokens = cutoff
        self.urgent_budgets = frozenset(urgent_budgets)
        self.interleaver = Interleaver(self.device)
        weakref.finalize(self, self.interleaver.close)  # its thread ends with the lanes

    def runner(self, path: str) -> BatchRunner:
        runner = self.runners.get(path)
        if runner is None:
            raise ValueError(f"this encoder has no path {path!r}; its paths are {sorted(self.runners)}")
        return runner

    def fits_urgent_lane(self, batches: Sequence[RunBatch]) -> bool:
        return self.urgent is not None and all(budget in self.urgent_budgets for budget, _ in batches)

    def launch(self, batches: Sequence[RunBatch], to_host: bool) -> LaunchedBatches | PendingLaunch:
        """Queue the batches' work on the main lane; their outputs are fresh tensors once it is done."""
        if not batches:  # every item of the call was refused before it got here
            return LaunchedBatches([], [], None)
        if len(self.runners) == 1:
            [runner] = self.runners.values()
            if self.interleaver is not None:
                return PendingLaunch(
                    self.interleaver.main(lambda between: runner.launch(batches, to_host, between))
                )
            return runner.launch(batches, to_host)
        by_path: dict[str, list[int]] = {}
        for position, (_, members) in enumerate(batches):
            by_path.setdefault(members[0].spec.path, []).append(position)
        launched = [
            (positions, self.runner(path).launch([batches[p] for p in positions], to_host))
            for path, positions in by_path.items()
        ]
        return LaunchedBatches.merged(len(batches), launched)

    def start(
        self, batches: list[RunBatch], plan_sizes: list[list[int]], to_host: bool, urgent: bool
    ) -> PlansInFlight:
        """Queue planned batches (on the urgent lane where asked and they fit its budgets) and
        return; one that runs out of memory, at launch or when collected, runs in halves on the
        main lane."""

        def rerun(asked: int | None) -> RunOutcomes:
            return self.after_out_of_memory(batches, to_host, asked)

        def queue() -> PlansInFlight:
            if urgent and self.fits_urgent_lane(batches):
                urgent_lane = self.urgent
                future = self.interleaver.urgent(lambda: urgent_lane.launch(batches, to_host))  # type: ignore[union-attr]
                return PlansInFlight(PendingLaunch(future), plan_sizes, rerun)
            return PlansInFlight(self.launch(batches, to_host), plan_sizes, rerun)

        queued = or_out_of_memory(queue)
        if isinstance(queued, OutOfMemory):
            return PlansInFlight(SettledBatches(rerun(queued.asked)), plan_sizes)
        return queued

    def run_halving(self, runs: list[RunBatch], to_host: bool) -> RunOutcomes:
        """Run the batches and wait; batches that run out of memory run again in halves, then a
        batch's items in halves (a part of a batch fits its budget), so one item too large for the
        device costs the others of its call nothing."""
        outcomes = or_out_of_memory(lambda: self.launch(runs, to_host).embeddings())
        if isinstance(outcomes, OutOfMemory):
            return self.after_out_of_memory(runs, to_host, outcomes.asked)
        return outcomes

    def after_out_of_memory(self, runs: list[RunBatch], to_host: bool, asked: int | None) -> RunOutcomes:
        """`runs` ran out of device memory (`asked`: the bytes the allocator refused, where it
        said): free the cache and run them in halves; an item alone is refused with its reason."""
        with self._oom_lock:
            self._oom_splits += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(runs) > 1:
            logger.warning("out of %s memory on %d batches; running them in halves", self.device, len(runs))
            half = len(runs) // 2
            return self.run_halving(runs[:half], to_host) + self.run_halving(runs[half:], to_host)
        budget, members = runs[0]
        if len(members) == 1:
            reason = out_of_memory_reason(members[0].spec, budget is None, str(self.device), asked)
            logger.error("refused an item: %s", reason)
            return [[InvalidItemError(0, reason)]]
        logger.warning(
            "out of %s memory on a batch of %d items; encoding them in halves", self.device, len(members)
        )
        half = len(members) // 2
        [first] = self.run_halving([(budget, members[:half])], to_host)
        [second] = self.run_halving([(budget, members[half:])], to_host)
        return [first + [renumbered(outcome, half + position) for position, outcome in enumerate(second)]]

    def stats(self) -> EncoderStats:
        """A snapshot of the counters (every path's together)."""
        snapshots = []
        for runner in self.runners.values():
            with runner.lock:
                snapshots.append(copy.deepcopy(runner.stats))
        if self.urgent is None:
            total = snapshots[0] if len(snapshots) == 1 else EncoderStats.combined(snapshots)
        else:
            with self.urgent.lock:
                urgent = copy.deepcopy(self.urgent.stats)
            total = EncoderStats.combined([*snapshots, urgent])
            # the urgent lane's budgets are copies of the others': list them once
            total.captured_budgets = [b for s in snapshots for b in s.captured_budgets]
            total.disabled_budgets = [b for s in snapshots for b in s.disabled_budgets]
            total.dense_graphs = [b for s in snapshots for b in s.dense_graphs]
            total.urgent_interrupts = self.interleaver.interrupts if self.interleaver is not None else 0
        with self._oom_lock:
            total.oom_splits = self._oom_splits
        return total


def renumbered(
    outcome: Embedding | InvalidItemError | None, index: int
) -> Embedding | InvalidItemError | None:
    """An item's error under its index in a larger list (anything else as it is)."""
    return InvalidItemError(index, outcome.reason) if isinstance(outcome, InvalidItemError) else outcome


def launch_groups(runs: Sequence[RunBatch]) -> list[list[int]]:
    """Positions of the runs launched together: every budgeted run in one launch, each eager run
    (one item over every budget) in its own. An eager item is large enough that a launch of its
    own costs little, and it is the one likely to run out of memory: alone, it is refused without
    running again, and without the call's other batches running again."""
    budgeted = [position for position, (budget, _) in enumerate(runs) if budget is not None]
    eager = [[position] for position, (budget, _) in enumerate(runs) if budget is None]
    return ([budgeted] if budgeted else []) + eager
