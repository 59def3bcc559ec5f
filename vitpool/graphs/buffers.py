"""One set of static buffers, sized for the largest budget, shared by every budget's graph.

Each budget's graph reads and writes prefix views of the same tensors, so the buffers cost the
memory of the largest budget once. Every call writes every row of its budget (padding rows too),
so nothing stale from a larger batch is ever read.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from vitpool.models.protocol import TensorSpec, VisionAdapter
from vitpool.packing import Budget
from vitpool.transport.wire import to_array


class StaticBuffers:
    """pixels [max_rows, *row_shape]; metadata as the adapter names it, each as large as any
    budget needs; finite [max_rows]; outputs [max_tokens, *output_row_shape], one per output tensor."""

    def __init__(
        self, adapter: VisionAdapter, budgets: Sequence[Budget], device: torch.device, dtype: torch.dtype
    ) -> None:
        self._adapter = adapter
        max_rows = max(adapter.max_rows(budget.num_tokens) for budget in budgets)
        max_tokens = max(budget.num_tokens for budget in budgets)
        self.pixels = torch.zeros(max_rows, *adapter.row_shape, device=device, dtype=dtype)
        self.metadata = {
            name: torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            for name, spec in _largest_metadata(adapter, budgets).items()
        }
        # written by the captured graphs: whether each pixel row was finite, and the outputs, one
        # stacked tensor where they all have one row shape (Qwen3-VL's merger and deepstack
        # features), so that a batch's outputs leave the buffers in one copy
        self.finite = torch.ones(max_rows, device=device, dtype=torch.bool)
        shapes = [tuple(shape) for shape in adapter.output_row_shapes]
        self._stacked = len(set(shapes)) == 1
        if self._stacked:
            stacked = torch.zeros(len(shapes), max_tokens, *shapes[0], device=device, dtype=dtype)
            self.outputs = list(stacked.unbind(0))
            self._stacked_outputs = stacked
        else:
            self.outputs = [torch.zeros(max_tokens, *shape, device=device, dtype=dtype) for shape in shapes]
        # The buffers are never replaced, so a budget's views are made once (a dozen slices a batch
        # otherwise); one entry per budget.
        self._views: dict[tuple[int, Budget], tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def input_views(self, num_rows: int, budget: Budget) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """pixels [num_rows, *row_shape] and the metadata tensors the adapter names for the budget,
        each a prefix view of its buffer (a fresh dict: the caller may change it)."""
        key = (num_rows, budget)
        views = self._views.get(key)
        if views is None:
            specs = self._adapter.metadata_specs(num_rows, budget)
            metadata = {
                name: self.metadata[name][tuple(slice(0, n) for n in spec.shape)]
                for name, spec in specs.items()
            }
            views = self._views[key] = (self.pixels[:num_rows], metadata)
        return views[0], dict(views[1])

    def output_views(self, num_tokens: int) -> list[torch.Tensor]:
        return [output[:num_tokens] for output in self.outputs]

    def output_copies(self, num_tokens: int, to_host: bool) -> list[torch.Tensor]:
        """The first `num_tokens` rows of every output in fresh contiguous tensors, on the device
        or (`to_host`) in pinned host memory, copied without waiting (the caller synchronises)."""
        if self._stacked:
            return list(_fresh_copy(self._stacked_outputs[:, :num_tokens], to_host).unbind(0))
        return [_fresh_copy(output, to_host) for output in self.output_views(num_tokens)]


def _fresh_copy(tensor: torch.Tensor, to_host: bool) -> torch.Tensor:
    return pinned_copy(tensor) if to_host else tensor.clone(memory_format=torch.contiguous_format)


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor in pinned host memory, queued without waiting (the caller
    synchronises before reading it)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _largest_metadata(adapter: VisionAdapter, budgets: Sequence[Budget]) -> dict[str, TensorSpec]:
    """Per metadata name, a shape that holds every budget's view (the largest in each dimension)."""
    largest: dict[str, TensorSpec] = {}
    for budget in budgets:
        for name, spec in adapter.metadata_specs(adapter.max_rows(budget.num_tokens), budget).items():
            known = largest.get(name)
            if known is None:
                largest[name] = spec
                continue
            assert known.dtype == spec.dtype and len(known.shape) == len(spec.shape), (
                f"metadata {name!r} changes dtype or rank between budgets"
            )
            largest[name] = TensorSpec(tuple(map(max, known.shape, spec.shape)), spec.dtype)
    return largest


class PinnedStaging:
    """Pinned host rows that large host pixels pass through on their way to the device.

    From ordinary (pageable) memory a large copy runs at the driver's staging speed and holds the
    host before the replay can start. Copied into pinned memory first, the pixels go by DMA, which
    does not hold the host; the conversion to the compute dtype runs on the device.
    The host copy is NumPy's, on the calling thread: torch's converting copy ran on its CPU thread
    pool, and beside a pool's busy processes that pool stalled, making an in-process encode several
    times slower. Small batches go directly: for one 224² image (1.2 MB) a staging pass cost more
    than it saved. Tensors already pinned (the pool's shared segments are registered with CUDA)
    always go directly. An item of PARALLEL_BYTES or more is copied by COPY_THREADS threads (NumPy
    lets go of the GIL while it copies): that shortened the largest images' encodes, while a 1120²
    image (29 MB) gained nothing.

    Figures: benchmarks/RESULTS.md, "What the pool adds to one call" (the stalled thread pool);
    benchmarks/HISTORY.md, "Large host pixels through pinned memory" (staging) and "Attention where
    compute dominates: cuDNN on the default install" (the threads).
    """

    MIN_BYTES = 4 << 20
    MAX_BYTES = 256 << 20  # larger batches copy directly rather than hold this much pinned memory
    PARALLEL_BYTES = 32 << 20
    COPY_THREADS = 4

    def __init__(self, row_shape: tuple[int, ...], device: torch.device) -> None:
        self._row_shape, self._device = row_shape, device
        self._rows: dict[torch.dtype, torch.Tensor] = {}  # per pixel dtype
        self._copied: torch.cuda.Event | None = None

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """target.copy_(source) for each (rows on the device, rows anywhere) pair; returns once the
        copies are queued. The batch's host pixels are staged together when they add up to
        MIN_BYTES: four 224² images (4.8 MB) are as slow through pageable memory as one tensor
        of their size."""
        staged = [self._may_stage(source) for _, source in pairs]
        staged_bytes = sum(source.nbytes for (_, source), stage in zip(pairs, staged) if stage)
        if staged_bytes >= self.MIN_BYTES:  # is_pinned asks the driver (tens of µs): only here
            staged = [stage and not source.is_pinned() for (_, source), stage in zip(pairs, staged)]
            staged_bytes = sum(source.nbytes for (_, source), stage in zip(pairs, staged) if stage)
        if not self.MIN_BYTES <= staged_bytes <= self.MAX_BYTES:
            staged = [False] * len(pairs)
        for (target, source), stage in zip(pairs, staged):
            if not stage:
                target.copy_(source, non_blocking=True)
        if not any(staged):
            return
        if self._copied is not None:
            self._copied.synchronize()  # the previous batch's copies have left the pinned rows
        rows: dict[torch.dtype, int] = {}
        for (_, source), stage in zip(pairs, staged):
            if stage:
                rows[source.dtype] = rows.get(source.dtype, 0) + source.shape[0]
        for dtype, count in rows.items():
            if dtype not in self._rows or self._rows[dtype].shape[0] < count:
                self._rows[dtype] = torch.empty((count, *self._row_shape), dtype=dtype, pin_memory=True)
        taken = dict.fromkeys(rows, 0)
        for (target, source), stage in zip(pairs, staged):
            if stage:
                row = taken[source.dtype]
                pinned = self._rows[source.dtype][row : row + source.shape[0]]
                self._host_copy(to_array(pinned), to_array(source))
                if pinned.dtype == target.dtype:
                    target.copy_(pinned, non_blocking=True)
                else:  # the pixels' dtype by DMA, then the compute dtype by a kernel on the device
                    target.copy_(pinned.to(target.device, non_blocking=True))
                taken[source.dtype] = row + source.shape[0]
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self._device))

    def _host_copy(self, target: np.ndarray, source: np.ndarray) -> None:
        if self.COPY_THREADS <= 1 or source.nbytes < self.PARALLEL_BYTES:
            np.copyto(target, source)
            return
        bounds = np.linspace(0, source.shape[0], self.COPY_THREADS + 1).astype(int)
        parts = [slice(start, end) for start, end in itertools.pairwise(bounds)]
        list(_copy_threads(self.COPY_THREADS).map(lambda part: np.copyto(target[part], source[part]), parts))

    def _may_stage(self, source: torch.Tensor) -> bool:
        return source.device.type == "cpu" and tuple(source.shape[1:]) == self._row_shape


@functools.cache
def _copy_threads(count: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's threads for large host copies (started on first use)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=count, thread_name_prefix="vitpool-copy")


class PinnedMetadata:
    """Pinned host memory that a batch's metadata passes through on its way to the static buffers.

    CUDA makes a copy from pageable memory wait for the work already queued on its stream. From
    pageable memory the metadata of the next batch would wait for the replay before it, and the
    GPU would sit idle while the host finished that batch's fill and launched its replay. From
    pinned memory the copies queue behind the replay and the host goes on. Two slots, so the
    host never waits for the copies of the batch it has just queued.
    """

    SLOTS = 2
    ALIGN = 64  # bytes; every dtype's views start aligned

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._arenas = [torch.empty(0, dtype=torch.uint8) for _ in range(self.SLOTS)]
        self._copied: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self._slot = 0

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """target.copy_(source) for each (device tensor, host tensor) pair; returns once queued."""
        slot, self._slot = self._slot, (self._slot + 1) % self.SLOTS
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()  # this slot's previous copies have left it
        sizes = [_aligned(source.numel() * source.element_size(), self.ALIGN) for _, source in pairs]
        if self._arenas[slot].numel() < sum(sizes):
            self._arenas[slot] = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
        offset = 0
        for (target, source), size in zip(pairs, sizes):
            nbytes = source.numel() * source.element_size()
            pinned = self._arenas[slot][offset : offset + nbytes].view(source.dtype).view(source.shape)
            pinned.copy_(source)
            target.copy_(pinned, non_blocking=True)
            offset += size
        self._copied[slot] = torch.cuda.Event()
        self._copied[slot].record(torch.cuda.current_stream(self._device))


def _aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment
