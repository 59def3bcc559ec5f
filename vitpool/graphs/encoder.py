"""GraphEncoder: a vision tower run as one captured CUDA graph per token budget.

The recipe: static buffers sized for the largest budget; capture every budget, largest first,
into one shared memory pool; check each graph against the eager run of the same static forward
right after capture; per call, pack the items into budgets, copy them (and their metadata) into
the buffers, write the padding rows, replay, and clone each item's rows out. An item larger than
every budget runs eager, alone. On a CPU the same static forward runs without capture.
"""

from __future__ import annotations

import copy
import logging
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from vitpool.errors import ConfigError, InvalidItemError
from vitpool.graphs.buffers import StaticBuffers
from vitpool.graphs.defaults import default_token_budgets, resolve_device, resolve_dtype
from vitpool.graphs.inputs import (
    NONFINITE_MESSAGE,
    PreparedItem,
    nonfinite_items,
    prepare_item,
    prepare_items,
)
from vitpool.graphs.stats import EncoderStats
from vitpool.items import Embedding, Item
from vitpool.models import VisionAdapter, load_adapter
from vitpool.packing import Batch, Budget, ItemCost, make_budgets, pack

logger = logging.getLogger(__name__)

# Largest relative error (Frobenius norm) a replay may show against eager before its budget is
# disabled. Graph and eager run the same kernels, so a healthy graph is far below these.
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


class GraphEncoder:
    """Encodes images and videos with a vision tower, replaying a CUDA graph per token budget.

    Args:
        adapter: the model, seen through `vitpool.models.VisionAdapter`.
        budgets: token budgets (output tokens per batch) to capture. None: derived from the
            device (a ladder up to 4096 tokens on a large GPU, up to 1024 on a CPU).
        max_items_per_batch: most items in one batch (default min(32, smallest budget)).
        max_frames_per_batch: most attention sequences (video frames / temporal patches) in
            one batch (default 64); it sizes the `cu_seqlens` buffer.
        device: "cuda", "cuda:N" or "cpu"; default the current GPU if there is one.
        dtype: compute dtype; default bfloat16 on a GPU, float32 on a CPU.

    Raises:
        ConfigError: invalid budgets, batch limits, device or dtype.
    """

    def __init__(
        self,
        adapter: VisionAdapter,
        budgets: Sequence[int] | None = None,
        max_items_per_batch: int | None = None,
        max_frames_per_batch: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.adapter = adapter
        _place_tower(adapter.tower, self.device, self.dtype)
        token_budgets = default_token_budgets(self.device) if budgets is None else budgets
        try:
            self.budgets: list[Budget] = make_budgets(token_budgets, max_items_per_batch, max_frames_per_batch)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        largest = self.budgets[-1]
        self._buffers = StaticBuffers(
            adapter, self._rows(largest), largest.max_sequences, self.device, self.dtype
        )
        self._graphs: dict[Budget, torch.cuda.CUDAGraph] = {}
        self._stats = EncoderStats()
        self._lock = threading.Lock()  # one batch at a time owns the static buffers
        if self.device.type == "cuda":
            self._capture_all()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        budgets: Sequence[int] | None = None,
        max_items_per_batch: int | None = None,
        max_frames_per_batch: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> GraphEncoder:
        """Load a local Hugging Face checkpoint and capture its graphs.

        Args:
            path: a directory with a vision-tower-only save or a full Qwen3-VL checkpoint
                (safetensors), or only a config (random weights). None: the tiny Qwen3-VL-shaped
                model shipped with vitpool (random weights), so everything runs offline.
            budgets, max_items_per_batch, max_frames_per_batch, device, dtype: as for the
                constructor.

        Raises:
            CheckpointError: the directory cannot be loaded (names the missing or unexpected keys).
            ConfigError: invalid settings.
        """
        resolved_device = resolve_device(device)
        resolved_dtype = resolve_dtype(dtype, resolved_device)
        adapter = load_adapter(path, resolved_device, resolved_dtype)
        return cls(adapter, budgets, max_items_per_batch, max_frames_per_batch, resolved_device, resolved_dtype)

    # encode

    def encode(self, items: Sequence[Item], output_device: str | torch.device | None = None) -> list[Embedding]:
        """Encode `items`; returns one Embedding per item, in input order.

        Args:
            items: Image and Video items.
            output_device: where the results go. None: the encoder's device. "cpu": each batch's
                outputs are copied to pinned host memory in one transfer per tensor.

        Raises:
            InvalidItemError: an item is malformed (the message names its index); nothing is
                returned, and the encoder stays usable.
        """
        if not items:
            return []
        prepared = prepare_items(items, self.adapter)
        results, bad = self._encode_prepared(prepared, output_device)
        if bad:
            raise InvalidItemError(bad[0], NONFINITE_MESSAGE)
        return results  # type: ignore[return-value]  # every slot is filled when nothing is bad

    def encode_each(
        self, items: Sequence[Item], output_device: str | torch.device | None = None
    ) -> list[Embedding | InvalidItemError]:
        """Like `encode`, but a bad item does not stop the others: its slot holds its error.

        For servers that batch the items of several callers together.
        """
        outcomes: list[Embedding | InvalidItemError | None] = [None] * len(items)
        prepared: list[PreparedItem | None] = []
        for index, item in enumerate(items):
            try:
                prepared.append(prepare_item(index, item, self.adapter))
            except InvalidItemError as error:
                prepared.append(None)
                outcomes[index] = error
        results, bad = self._encode_prepared(prepared, output_device)
        for index, result in enumerate(results):
            if result is not None:
                outcomes[index] = result
        for index in bad:
            outcomes[index] = InvalidItemError(index, NONFINITE_MESSAGE)
        return outcomes  # type: ignore[return-value]  # every slot holds a result or an error

    def _encode_prepared(
        self, prepared: list[PreparedItem | None], output_device: str | torch.device | None
    ) -> tuple[list[Embedding | None], list[int]]:
        """Results (None where prepared is None or the pixels were not finite) and the indices of
        items with non-finite pixels."""
        to_host = self._wants_host(output_device)
        indices = [i for i, p in enumerate(prepared) if p is not None]
        costs = [ItemCost(prepared[i].size.num_tokens, prepared[i].size.num_sequences) for i in indices]
        results: list[Embedding | None] = [None] * len(prepared)
        finite_checks = []
        with torch.no_grad(), self._lock:
            for batch in pack(costs, self.budgets):
                batch_indices = [indices[i] for i in batch.item_indices]
                members = [prepared[i] for i in batch_indices]
                tokens, deepstack, finite_rows = self._run_batch(batch, members, to_host)
                finite_checks.append((batch_indices, members, finite_rows))
                offset = 0
                for index, member in zip(batch_indices, members):
                    end = offset + member.size.num_tokens
                    results[index] = Embedding(tokens[offset:end], [d[offset:end] for d in deepstack])
                    offset = end
        # Waits for the device, so the non-blocking copies to the host are complete too.
        bad = nonfinite_items(finite_checks)
        for index in bad:
            results[index] = None
        return results, bad

    def _wants_host(self, output_device: str | torch.device | None) -> bool:
        if output_device is None:
            return False
        try:
            resolved = torch.device(output_device)
        except (RuntimeError, TypeError):
            resolved = None
        if resolved is None or resolved.type not in ("cpu", self.device.type):
            raise ConfigError(f"output_device {output_device!r}: use None (the encoder's device) or 'cpu'")
        return resolved.type == "cpu"

    @staticmethod
    def _to_host(tensor: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of a device tensor, made without waiting (the caller synchronises).
        A host tensor is returned as it is: on a CPU encoder the outputs are already fresh."""
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def stats(self) -> EncoderStats:
        """A snapshot of the counters."""
        with self._lock:
            return copy.deepcopy(self._stats)

    def _run_batch(
        self, batch: Batch, members: list[PreparedItem], to_host: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Outputs of the batch's items, concatenated and owned by the caller (on the host if
        `to_host`): tokens [tokens, width], deepstack, and whether each of the items' pixel rows
        was finite [rows] (on the device)."""
        num_tokens = batch.num_tokens
        if batch.budget is None:
            self._stats.eager_batches += 1
            self._stats.eager_items += len(members)
            tokens, deepstack, finite_rows = self._run_exact(members)
        else:
            budget = batch.budget
            self._stats.replays_per_budget[budget.num_tokens] = self._stats.replays_per_budget.get(budget.num_tokens, 0) + 1
            self._stats.batch_rows += self._rows(budget)
            self._stats.padding_rows += batch.padding_tokens * self.adapter.merge_unit
            finite_rows = self._fill(budget, [m.grid for m in members], [m.pixels for m in members])
            graph = self._graphs.get(budget)
            if graph is None:
                self._stats.eager_items += len(members)
                tokens, deepstack = self._static_forward(budget)
                tokens, deepstack = tokens[:num_tokens], [d[:num_tokens] for d in deepstack]
            else:
                self._stats.graph_items += len(members)
                graph.replay()
                tokens, deepstack = self._buffers.output_views(num_tokens)
                if not to_host:  # the next replay overwrites the output buffers
                    return tokens.clone(), [d.clone() for d in deepstack], finite_rows
        if to_host:
            return self._to_host(tokens), [self._to_host(d) for d in deepstack], finite_rows
        return tokens, deepstack, finite_rows

    def _run_exact(
        self, members: list[PreparedItem]
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Eager run at the items' own size: no padding, fresh tensors."""
        grids = [m.grid for m in members]
        num_rows = sum(m.size.num_rows for m in members)
        num_sequences = sum(m.size.num_sequences for m in members)
        pixels = torch.cat([m.pixels.to(self.device, self.dtype) for m in members])
        metadata = {
            name: tensor.to(self.device)
            for name, tensor in self.adapter.build_metadata(grids, num_rows, num_sequences).items()
        }
        finite_rows = torch.isfinite(pixels).all(dim=1)
        _zero_nonfinite(pixels)
        tokens, deepstack = self.adapter.forward(pixels, metadata)
        return tokens, deepstack, finite_rows

    def _fill(self, budget: Budget, grids: list, pixel_list: list[torch.Tensor]) -> torch.Tensor:
        """Write a batch into the budget's views of the static buffers, padding rows included.

        Returns whether each item row is finite [rows], computed on the device.
        """
        rows = self._rows(budget)
        pixels, metadata = self._buffers.input_views(rows, budget.max_sequences)
        row = 0
        for item_pixels in pixel_list:
            pixels[row : row + item_pixels.shape[0]].copy_(item_pixels, non_blocking=True)
            row += item_pixels.shape[0]
        finite_rows = torch.isfinite(pixels[:row]).all(dim=1)
        _zero_nonfinite(pixels[:row])
        pixels[row:].zero_()
        for name, tensor in self.adapter.build_metadata(grids, rows, budget.max_sequences).items():
            metadata[name].copy_(tensor, non_blocking=True)
        return finite_rows

    def _static_forward(self, budget: Budget) -> tuple[torch.Tensor, list[torch.Tensor]]:
        pixels, metadata = self._buffers.input_views(self._rows(budget), budget.max_sequences)
        return self.adapter.forward(pixels, metadata)

    def _rows(self, budget: Budget) -> int:
        return budget.num_tokens * self.adapter.merge_unit

    # capture

    def _capture_all(self) -> None:
        """Capture every budget, largest first, into one shared pool; check each right after."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        rng = random.Random(0)
        generator = torch.Generator(device=self.device).manual_seed(0)
        total = len(self.budgets)
        with torch.no_grad():
            for number, budget in enumerate(reversed(self.budgets), start=1):
                budget_start = time.perf_counter()
                graph = self._capture(budget, pool, rng, generator)
                error = self._check(budget, graph, rng, generator)
                tolerance = CHECK_TOLERANCE[self.dtype]
                if error <= tolerance:
                    self._graphs[budget] = graph
                    self._stats.captured_budgets.append((budget.num_tokens, budget.max_sequences))
                    logger.info(
                        "captured budget %d/%d: %d tokens (%d rows), %d sequences in %.2f s, rel. error %.1e",
                        number, total, budget.num_tokens, self._rows(budget), budget.max_sequences,
                        time.perf_counter() - budget_start, error,
                    )
                else:
                    self._stats.disabled_budgets.append((budget.num_tokens, budget.max_sequences))
                    logger.warning(
                        "budget %d tokens, %d sequences disabled, it will run eager: replay vs eager "
                        "rel. error %.1e (tolerance %.0e, inf = non-finite output)",
                        budget.num_tokens, budget.max_sequences, error, tolerance,
                    )
        # Give back what the eager warm-ups and checks cached; the graphs' pool stays reserved.
        torch.cuda.empty_cache()
        self._stats.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d of %d budgets in %.2f s (%.2f GiB reserved on %s, weights included)",
            len(self._graphs), total, self._stats.capture_seconds,
            torch.cuda.memory_reserved(self.device) / 1024**3, self.device,
        )

    def _capture(
        self, budget: Budget, pool: tuple, rng: random.Random, generator: torch.Generator
    ) -> torch.cuda.CUDAGraph:
        self._fill_random(budget, rng, generator)
        # warm-up on a side stream: lazy initialisation (cuBLAS handles, kernels) stays out of the graph
        side_stream = torch.cuda.Stream(self.device)
        side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side_stream):
            self._forward_into_outputs(budget)
        torch.cuda.current_stream(self.device).wait_stream(side_stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._forward_into_outputs(budget)
        return graph

    def _forward_into_outputs(self, budget: Budget) -> None:
        # Copy into the shared output buffers, so no graph keeps outputs of its own alive in the pool.
        tokens, deepstack = self._static_forward(budget)
        out_tokens, out_deepstack = self._buffers.output_views(budget.num_tokens)
        out_tokens.copy_(tokens)
        for out, feature in zip(out_deepstack, deepstack):
            out.copy_(feature)

    def _check(
        self, budget: Budget, graph: torch.cuda.CUDAGraph, rng: random.Random, generator: torch.Generator
    ) -> float:
        """Replay on fresh random items and compare with eager; inf if any output row is non-finite."""
        self._fill_random(budget, rng, generator)
        graph.replay()
        replayed_tokens, replayed_deepstack = self._buffers.output_views(budget.num_tokens)
        eager_tokens, eager_deepstack = self._static_forward(budget)
        error = 0.0
        for replayed, eager in zip([replayed_tokens, *replayed_deepstack], [eager_tokens, *eager_deepstack]):
            if not bool(torch.isfinite(replayed).all()):
                return float("inf")
            difference = torch.linalg.vector_norm((replayed - eager).float())
            scale = torch.linalg.vector_norm(eager.float()).clamp_min(1e-12)
            error = max(error, float(difference / scale))
        return error

    def _fill_random(self, budget: Budget, rng: random.Random, generator: torch.Generator) -> None:
        grids = self.adapter.sample_grids(self._rows(budget), budget.max_sequences, rng)
        pixels = [
            torch.randn(
                self.adapter.item_size(grid).num_rows, self.adapter.row_width,
                device=self.device, dtype=self.dtype, generator=generator,
            )
            for grid in grids
        ]
        self._fill(budget, grids, pixels)


def _zero_nonfinite(pixels: torch.Tensor) -> None:
    """A bad item fails alone: its NaN would otherwise reach the other items of its batch where
    attention masks with a multiply (SDPA's block-diagonal mask on a CPU: 0 * NaN is NaN)."""
    torch.nan_to_num_(pixels, nan=0.0, posinf=0.0, neginf=0.0)


def _place_tower(tower: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Move the tower to `device` and its parameters to `dtype`.

    Buffers keep their dtype: rotary inverse frequencies stay float32, as when Hugging Face
    loads a model in half precision.
    """
    tower.to(device)
    for parameter in tower.parameters():
        if parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    tower.eval().requires_grad_(False)
