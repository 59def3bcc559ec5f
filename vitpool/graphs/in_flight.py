"""Batches whose work the encoder has queued on the device, and the embeddings they become.

`GraphEncoder` queues a batch (fill, replay, fresh copies of its outputs) and records a CUDA event
after it; what is here waits for that event and cuts the outputs into per-item embeddings. The
two halves are apart so that a server can queue its next batch before it waits for this one
(`GraphEncoder.start_plans`, the actor's combiner).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vitpool.errors import InvalidItemError
from vitpool.graphs.inputs import NONFINITE_MESSAGE, nonfinite_positions
from vitpool.graphs.out_of_memory import OutOfMemory, or_out_of_memory
from vitpool.items import Embedding, PreparedItem
from vitpool.packing import Budget

# A batch as the encoder runs it: its budget (None: eager, at the items' own size) and items.
RunBatch = tuple[Budget | None, list[PreparedItem]]


@dataclass
class LaunchedBatches:
    """Batches whose work is queued on the device: per batch its outputs (fresh tensors, one per
    output, the items' tokens concatenated) and its pixel rows' finite flags; `done` is recorded
    after the last of it (None on a CPU, where the work is done already)."""

    batches: list[RunBatch]
    runs: list[tuple[list[torch.Tensor], torch.Tensor]]
    done: torch.cuda.Event | None

    @classmethod
    def merged(cls, num_batches: int, launched: list[tuple[list[int], LaunchedBatches]]) -> LaunchedBatches:
        """Batches launched in groups (one per path's runner, on one stream) as one launch, in the
        order of their positions; done once the last group is."""
        batches: list = [None] * num_batches
        runs: list = [None] * num_batches
        for positions, group in launched:
            for position, batch, run in zip(positions, group.batches, group.runs):
                batches[position], runs[position] = batch, run
        return cls(batches, runs, launched[-1][1].done)

    def embeddings(self) -> list[list[Embedding | None]]:
        """Wait for the device; per batch, per item its Embedding, or None where its pixels were
        not finite."""
        if self.done is not None:
            self.done.synchronize()  # the copies to pinned host memory are complete too
        results = []
        for (_, members), (outputs, finite) in zip(self.batches, self.runs):
            bad = set(nonfinite_positions(members, finite))
            embeddings: list[Embedding | None] = []
            offset = 0
            for position, member in enumerate(members):
                end = offset + member.spec.num_tokens
                embeddings.append(
                    None if position in bad else Embedding.from_outputs([o[offset:end] for o in outputs])
                )
                offset = end
            results.append(embeddings)
        return results


@dataclass
class PendingLaunch:
    """Batches handed to the thread that queues an encoder's work (`vitpool.graphs.segments`):
    `future` holds their LaunchedBatches once queued, or the error the launch raised."""

    future: concurrent.futures.Future

    def embeddings(self) -> list[list[Embedding | None]]:
        """As `LaunchedBatches.embeddings`, once the batches are queued."""
        return self.future.result().embeddings()


@dataclass
class PlansInFlight:
    """Planned batches queued on the device by `GraphEncoder.start_plans`."""

    launched: LaunchedBatches | PendingLaunch | SettledBatches
    plan_sizes: list[list[int]]  # per run (one replay or eager batch), the items of each of its plans
    # The encoder's own halving of the same runs, for a launch that runs out of memory by the time
    # it is collected (one queued for the encoder's thread): per run, per item, as `embeddings`.
    # (Called with the bytes the allocator refused, where it said.)
    rerun: Callable[[int | None], list[list[Embedding | InvalidItemError | None]]] | None = None

    def result(self) -> list[list[Embedding | InvalidItemError]]:
        """Wait for the device: per plan, per item its Embedding, or an InvalidItemError (its
        position in the plan) where its pixels were not finite or it alone did not fit the
        device's memory."""
        if self.rerun is None:
            runs = self.launched.embeddings()
        else:
            runs = or_out_of_memory(self.launched.embeddings)
            if isinstance(runs, OutOfMemory):
                runs = self.rerun(runs.asked)
        outcomes: list[list[Embedding | InvalidItemError]] = []
        for sizes, results in zip(self.plan_sizes, runs):
            offset = 0
            for size in sizes:
                mine = results[offset : offset + size]
                outcomes.append([_in_plan(result, position) for position, result in enumerate(mine)])
                offset += size
        return outcomes


@dataclass
class SettledBatches:
    """Runs already answered (by the encoder's halving after running out of memory at launch)."""

    results: list[list[Embedding | InvalidItemError | None]]

    def embeddings(self) -> list[list[Embedding | InvalidItemError | None]]:
        return self.results


def _in_plan(result: Embedding | InvalidItemError | None, position: int) -> Embedding | InvalidItemError:
    """An item's outcome numbered by its position in its plan (a run may hold several plans)."""
    if result is None:
        return InvalidItemError(position, NONFINITE_MESSAGE)
    if isinstance(result, InvalidItemError):
        return InvalidItemError(position, result.reason)
    return result
