"""One batch at a time through an encoder's static buffers: fill, forward (a graph's replay or
eager), fresh copies of the outputs. `GraphEncoder` (the API) runs its batches here, and
`capture` captures and checks each budget's graph through the same fill and forward.

A budgeted batch is copied into the budget's prefix views of the static buffers, its padding rows
written too, and its graph replayed (or, where the budget has no graph, the same static forward
run eagerly). A batch without a budget runs eagerly at its own rows (of its own shape, for an
item no graph serves). Either way the outputs are fresh tensors (on the device, or in pinned host
memory) and each pixel row's finite flag is read back without waiting for later work.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from vitpool.graphs.buffers import PinnedMetadata, PinnedStaging, StaticBuffers, pinned_copy
from vitpool.graphs.in_flight import LaunchedBatches, RunBatch
from vitpool.graphs.inputs import finite_rows, totals
from vitpool.graphs.segments import SegmentedGraph, cut_points
from vitpool.graphs.stats import EncoderStats
from vitpool.items import PreparedItem
from vitpool.kernels.attention import (
    DENSE_MIN_FILL,
    LEADING_SEQUENCE,
    forced_backend,
    graph_backend,
    host_boundaries,
    is_boundary,
    use_attention,
    wants_dense_graph,
)
from vitpool.kernels.compiled import use_compiled_blocks
from vitpool.kernels.fp8 import use_fp8
from vitpool.kernels.fused import use_fused_ops
from vitpool.models import VisionAdapter
from vitpool.packing import Budget
from vitpool.specs import ItemSpec


class BatchRunner:
    """The static buffers of one encoder, its graphs (filled in by `capture.capture_all`) and its
    counters; runs batches through them, one at a time (`lock`).

    Attributes:
        graphs: budget -> its checked graph; a budget without one runs its static forward eagerly.
        dense_graphs: budget -> a second checked graph of the same forward with cuDNN attention
            over all its rows (`vitpool.kernels.attention.leading_sequence_attention`), replayed
            for a batch of one sequence that fills most of the budget (`wants_dense`).
        stats: the counters `GraphEncoder.stats()` copies (under `lock`).
        attention, fused_ops, compiled_blocks, precision: the kernels the forward runs with (`kernels`).
        segment_above_tokens: budgets of more tokens are captured in segments that other work
            may run between (`vitpool.graphs.segments`); None: every budget as one graph.
    """

    def __init__(
        self,
        adapter: VisionAdapter,
        budgets: Sequence[Budget],
        device: torch.device,
        dtype: torch.dtype,
        attention: str,
        fused_ops: bool,
        compiled_blocks: bool,
        segment_above_tokens: int | None = None,
        precision: str = "bf16",
    ) -> None:
        self.adapter, self.device, self.dtype = adapter, device, dtype
        self.segment_above_tokens = segment_above_tokens
        self.attention, self.fused_ops, self.compiled_blocks = attention, fused_ops, compiled_blocks
        self.precision = precision
        self.buffers = StaticBuffers(adapter, budgets, device, dtype)
        on_gpu = device.type == "cuda"
        self.staging = PinnedStaging(adapter.row_shape, device) if on_gpu else None
        self._metadata_staging = PinnedMetadata(device) if on_gpu else None
        self._metadata_key: tuple | None = None  # what the metadata buffers hold
        self.graphs: dict[Budget, SegmentedGraph] = {}
        self.dense_graphs: dict[Budget, SegmentedGraph] = {}
        self._leading_rows = 0  # rows of the one sequence the buffers' batch holds (0: not one)
        self.stats = EncoderStats()
        self.lock = threading.Lock()  # one batch at a time owns the static buffers

    def cut_points(self, budget: Budget) -> list[torch.nn.Module]:
        """The blocks before which the budget's capture begins a new segment (none: one graph)."""
        if self.segment_above_tokens is None or budget.num_tokens <= self.segment_above_tokens:
            return []
        return cut_points(self.adapter.tower)

    def rows(self, budget: Budget) -> int:
        """Pixel rows of the budget's static views."""
        return self.adapter.max_rows(budget.num_tokens)

    def wants_dense(self, budget: Budget) -> bool:
        """Whether the budget gets a dense capture too: a large enough budget, FA2 its graph's
        kernel, and one set of sequence boundaries in its metadata (a tower with a second set,
        Qwen2.5-VL's windows, would rarely see one item be one sequence in both)."""
        rows = self.rows(budget)
        boundaries = [
            spec for spec in self.adapter.metadata_specs(rows, budget).values() if is_boundary(spec)
        ]
        return (
            self.device.type == "cuda"
            and len(boundaries) == 1
            and wants_dense_graph(self.attention, self.device, rows, budget.max_sequences)
        )

    def launch(
        self, batches: Sequence[RunBatch], to_host: bool, between: Callable[[], None] | None = None
    ) -> LaunchedBatches:
        """Queue the batches' work on the device; their outputs are fresh tensors (in pinned host
        memory if `to_host`) once it is done. `between()` runs between two segments of a segmented
        graph's replay (`vitpool.graphs.segments.Interleaver`)."""
        with torch.no_grad(), self.lock:
            runs = [self._run(budget, members, to_host, between) for budget, members in batches]
            done = None
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
        return LaunchedBatches(list(batches), runs, done)

    def _run(
        self,
        budget: Budget | None,
        members: list[PreparedItem],
        to_host: bool,
        between: Callable[[], None] | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Outputs of the batch's items, concatenated and owned by the caller (on the host if
        `to_host`), one tensor per output [tokens, *row_shape]; and whether each of the items'
        pixel rows was finite [rows], in host memory once the batch's work is done. Reading the
        flags from the device would wait for whatever is queued after this batch, the next
        replay included."""
        specs = [member.spec for member in members]
        num_tokens = sum(spec.num_tokens for spec in specs)
        if budget is None:
            self.stats.eager_batches += 1
            self.stats.eager_items += len(members)
            outputs, finite = self.run_exact(members)
            outputs, finite = [output[:num_tokens] for output in outputs], _on_host(finite)
        else:
            rows = self.rows(budget)
            self.stats.replays_per_budget[budget.num_tokens] = (
                self.stats.replays_per_budget.get(budget.num_tokens, 0) + 1
            )
            item_rows = self.fill(budget, specs, [member.pixels for member in members])
            self.stats.batch_rows += rows
            self.stats.padding_rows += rows - item_rows
            graph = self.graphs.get(budget)
            if budget in self.dense_graphs and self._leading_rows >= DENSE_MIN_FILL * rows:
                graph = self.dense_graphs[budget]
                self.stats.dense_items += len(members)
            if graph is None:
                self.stats.eager_items += len(members)
                outputs = [output[:num_tokens] for output in self.static_forward(budget)]
            else:
                self.stats.graph_items += len(members)
                graph.replay(between)
            flags = self.buffers.finite[:item_rows]  # the next replay overwrites them
            finite = _on_host(flags) if flags.is_cuda else flags.clone()
            if graph is not None:  # ... and the output buffers
                return self.buffers.output_copies(num_tokens, to_host), finite
        if to_host:
            # eager outputs are fresh; on a CPU encoder they are on the host already
            outputs = [_on_host(output) for output in outputs]
        return outputs, finite

    def run_exact(self, members: list[PreparedItem]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Eager run at the items' own size: no padding, fresh tensors; and each pixel row's
        finite flag (on the device). Rows of the items' own shape: the adapter's, or another that
        no graph serves (such an item runs alone)."""
        specs = [member.spec for member in members]
        num_items, num_tokens, needs = totals(specs)
        exact = Budget(num_tokens, needs, num_items)  # capacities exactly what the items use
        num_rows = sum(member.pixels.shape[0] for member in members)
        row_shape = specs[0].pixel_shape[1:]
        pixels = torch.empty((num_rows, *row_shape), device=self.device, dtype=self.dtype)
        self.copy_rows(pixels, [member.pixels for member in members])
        on_host = self.adapter.build_metadata(specs, pixels.shape[0], exact)
        metadata = {name: tensor.to(self.device) for name, tensor in on_host.items()}
        finite = finite_rows(pixels)
        _zero_nonfinite(pixels)
        # not captured: the batch's boundaries on the host, from which the attention hook picks its
        # kernel under "auto" (backend None) and sizes packed cuDNN's plan
        with host_boundaries(on_host, metadata), self.kernels(forced_backend(self.attention)):
            return self.adapter.forward(pixels, metadata), finite

    def fill(self, budget: Budget, specs: Sequence[ItemSpec], pixel_list: Sequence[torch.Tensor]) -> int:
        """Write a batch into the budget's views of the static buffers, padding rows included;
        returns the items' rows. The static forward checks and cleans the pixels itself."""
        rows = self.rows(budget)
        pixels, metadata = self.buffers.input_views(rows, budget)
        row = self.copy_rows(pixels, pixel_list)
        pixels[row:].zero_()
        # Metadata depends only on the specs and the budget: a batch shaped like the last one
        # (a stream of same-sized images) finds it in the buffers already.
        key = (budget, tuple(specs))
        if key != self._metadata_key:
            built = self.adapter.build_metadata(specs, rows, budget)
            # only a budget with a dense graph asks (a graph batch's host work is on the hot path)
            self._leading_rows = (
                _leading_sequence_rows(specs, built, rows) if budget in self.dense_graphs else 0
            )
            pairs = [(metadata[name], tensor) for name, tensor in built.items()]
            if self._metadata_staging is None:
                for target, tensor in pairs:
                    target.copy_(tensor)
            else:
                self._metadata_staging.copy(pairs)
            self._metadata_key = key
        return row

    def fill_random(self, budget: Budget, rng: random.Random, generator: torch.Generator) -> None:
        """Random valid items of the adapter's choosing into the budget's buffers (capture, checks)."""
        specs = self.adapter.sample_specs(self.rows(budget), budget, rng)
        pixels = [
            torch.randn(spec.pixel_shape, device=self.device, dtype=self.dtype, generator=generator)
            for spec in specs
        ]
        self.fill(budget, specs, pixels)

    def copy_rows(self, target: torch.Tensor, pixel_list: Sequence[torch.Tensor]) -> int:
        """Copy the items' pixels one after another into `target`'s first rows (large host
        tensors through pinned memory); returns the rows written."""
        pairs, row = [], 0
        for item_pixels in pixel_list:
            pairs.append((target[row : row + item_pixels.shape[0]], item_pixels))
            row += item_pixels.shape[0]
        if self.staging is None:
            for rows, item_pixels in pairs:
                rows.copy_(item_pixels)
        else:
            self.staging.copy(pairs)
        return row

    def static_forward(self, budget: Budget, dense: bool = False) -> list[torch.Tensor]:
        """The forward over the budget's buffers (captured, checked, or run eager when disabled),
        with the attention kernel its graph is captured with (`dense`: its dense graph's); writes
        the buffers' `finite` flags."""
        rows = self.rows(budget)
        pixels, metadata = self.buffers.input_views(rows, budget)
        # Part of the graph, so a call launches none of it: which rows are finite (read after the
        # replay), and the non-finite values zeroed so that a bad item cannot reach the others.
        self.buffers.finite[:rows].copy_(finite_rows(pixels))
        _zero_nonfinite(pixels)
        backend = (
            LEADING_SEQUENCE
            if dense
            else graph_backend(self.attention, self.device, rows, budget.max_sequences)
        )
        with self.kernels(backend):
            return self.adapter.forward(pixels, metadata)

    @contextlib.contextmanager
    def kernels(self, attention_backend: str | None) -> Iterator[None]:
        """The kernels the tower's forward runs with: this device current (kernels launched by
        device index, Triton and FA4, run where the tensors are), the attention backend (None:
        the hook picks per batch), and the fused, compiled and FP8 parts as set."""
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with (
            device,
            use_attention(attention_backend),
            use_fused_ops(self.fused_ops),
            use_compiled_blocks(self.compiled_blocks),
            use_fp8(self.precision == "fp8"),
        ):
            yield


def _leading_sequence_rows(specs: Sequence[ItemSpec], metadata: dict[str, torch.Tensor], rows: int) -> int:
    """The rows of the batch's one attention sequence, where it is one item and every sequence
    boundary of its metadata (1-D int32, as the packed kernels take them) reads [0, n, rows,
    rows...]; else 0. With the capture's check that the tower's attention reads no other
    boundaries (`capture._capture_dense`), what a dense graph needs to give the packed one's result."""
    if len(specs) != 1:
        return 0
    boundaries = [t for t in metadata.values() if is_boundary(t)]
    if not boundaries:
        return 0
    first = boundaries[0]
    if len(first) < 3 or first[0] != 0 or not 0 < int(first[1]) <= rows:
        return 0
    expected = torch.full_like(first, rows)
    expected[0], expected[1] = 0, first[1]
    if not all(t.shape == first.shape and torch.equal(t, expected) for t in boundaries):
        return 0
    return int(first[1])


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's pinned host copy, queued on the stream (read it once the stream has
    passed it); a host tensor as it is."""
    return pinned_copy(tensor) if tensor.is_cuda else tensor


def _zero_nonfinite(pixels: torch.Tensor) -> None:
    """A bad item fails alone: its NaN would otherwise reach the other items of its batch where
    attention masks with a multiply (SDPA's block-diagonal mask on a CPU: 0 * NaN is NaN)."""
    torch.nan_to_num_(pixels, nan=0.0, posinf=0.0, neginf=0.0)
