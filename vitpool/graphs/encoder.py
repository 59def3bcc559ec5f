"""GraphEncoder: a vision tower run as one captured CUDA graph per token budget.

The recipe: static buffers sized for the largest budget; capture every budget, largest first,
into one shared memory pool; check each graph against the eager run of the same static forward
right after capture; per batch, copy the items (and their metadata) into the buffers, write the
padding rows, replay, and clone each item's rows out. An item larger than every budget runs
eager, alone. On a CPU the same static forward runs without capture.

What a caller hands `encode` is checked as a pool's caller checks it (`vitpool.items`): a list, each
item by the model's rules, each item within `max_item_tokens`; a bad item's InvalidItemError names
its index. A batch that runs out of device memory runs again in halves, down to single items; an
item that does not fit alone is refused with the memory it asked for, and the call's other items
are still encoded.

Batches come three ways: `encode` / `encode_each` check and pack the caller's items themselves;
`run_plans` runs batches a pool's dispatcher already planned (item specs computed in the
caller's process, trusted after a cheap consistency check), and `start_plans` queues such batches
and returns, so that a server can queue its next batch before it collects these
(`vitpool.graphs.in_flight`); `encode_specs` packs checked items. A planned batch is checked once:
`check_plan` gives a `CheckedPlan`, which `start_plans` runs without checking it again (an actor
checks each batch as it arrives, before batches are combined). The encoder never looks inside an
item: its adapter does (`vitpool.models.VisionAdapter`).

This module is the API: settings, loading, checking and packing. One batch's fill, forward and
outputs are the batch runner's (`vitpool.graphs.runner`), which capture (`vitpool.graphs.capture`)
uses too; neither imports this module.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitpool.dtypes import dtype_from_name
from vitpool.errors import ConfigError, InvalidItemError
from vitpool.graphs.capture import capture_all
from vitpool.graphs.defaults import default_token_budgets, resolve_device, resolve_dtype
from vitpool.graphs.in_flight import LaunchedBatches, PendingLaunch, PlansInFlight, RunBatch
from vitpool.graphs.inputs import (
    NONFINITE_MESSAGE,
    CheckedPlan,
    asked_bytes,
    check_pixels,
    check_plan,
    is_out_of_memory,
    out_of_memory_reason,
    totals,
)
from vitpool.graphs.runner import BatchRunner
from vitpool.graphs.segments import Interleaver
from vitpool.graphs.stats import EncoderStats
from vitpool.items import (
    Embedding,
    Item,
    Prepared,
    PreparedItem,
    check_item_list,
    check_token_bound,
    prepare_item,
)
from vitpool.kernels.attention import fa4_available
from vitpool.kernels.compiled import set_compile_cache_dir
from vitpool.kernels.cudnn_packed import cudnn_packed_available
from vitpool.kernels.fp8 import fp8_supported, install_fp8_linears
from vitpool.models import VisionAdapter, load_adapter
from vitpool.packing import Budget, fits, pack
from vitpool.rules.paths import PathRules, rules_of_part
from vitpool.specs import (
    BatchPlan,
    EncoderOptions,
    EncoderSpec,
    ItemRules,
    ItemSpec,
    OutputLayout,
)
from vitpool.specs import capacity_limits as merged_capacity_limits
from vitpool.transport.wire import wire_dtype_name

logger = logging.getLogger(__name__)


class GraphEncoder:
    """Encodes images and videos with a vision tower, replaying a CUDA graph per token budget.

    Args:
        adapter: the model, seen through `vitpool.models.VisionAdapter`.
        options: how to capture and run it (`vitpool.specs.EncoderOptions`, where each option is
            documented): budgets, max_items_per_batch, max_frames_per_batch, capacity_limits,
            device, dtype, attention, fused_ops, compiled_blocks, compile_cache_dir,
            urgent_tokens, precision, max_item_tokens. None: the defaults.
        **option_values: options by name, over `options`: `GraphEncoder(adapter, budgets=[64, 256],
            attention="fa2")`. `device` may be a torch device and `dtype` a torch dtype.

    Attributes:
        options: the options it was built with.
        budgets: the batch shapes, from the adapter's item rules.
        output_layout: the tensors each item gets (`Embedding.outputs` order).
        device, dtype: where and in what it computes (the options' values, resolved).
        max_item_tokens: the bound on one item `encode` takes (None: none).

    Raises:
        ConfigError: an invalid option (`EncoderOptions`), or one this model or device cannot
            take (budgets or capacity limits against the family's rules, a device without CUDA,
            "fa4" or "fp8" where they cannot run).
        TypeError: a keyword that is no option.
    """

    def __init__(
        self, adapter: VisionAdapter, options: EncoderOptions | None = None, **option_values: Any
    ) -> None:
        self.options = options = _options_with(options, option_values)
        self.max_item_tokens = options.max_item_tokens
        self.device = resolve_device(options.device)
        self.fused_ops = options.fused_ops
        self.compiled_blocks = options.compiled_blocks and self.device.type == "cuda"
        if self.compiled_blocks:
            set_compile_cache_dir(options.compile_cache_dir)
        self.dtype = resolve_dtype(dtype_from_name(options.dtype), self.device)
        self.attention = _check_attention(options.attention, self.device, self.dtype)
        self.precision = _check_precision(options.precision, self.device, self.dtype)
        if self.precision == "fp8" and getattr(adapter, "fp8_refused", None):
            raise ConfigError(
                f"precision 'fp8' is not offered for {type(adapter).__name__}: {adapter.fp8_refused}"
            )
        self.adapter = adapter
        _place_tower(adapter.tower, self.device, self.dtype)
        # A family whose item is several inputs runs each through its own adapter, buffers and
        # graphs (a path, `vitpool.rules.paths`); the others have one path, "".
        self._paths: dict[str, VisionAdapter] = dict(getattr(adapter, "paths", None) or {"": adapter})
        if self.precision == "fp8":
            towers = {id(each.tower): each.tower for each in (adapter, *self._paths.values())}
            prepared = sum(install_fp8_linears(tower) for tower in towers.values())
            logger.info("precision fp8: %d Linears of the tower's blocks run as FP8 GEMMs", prepared)
        try:
            limits = merged_capacity_limits(options.max_frames_per_batch, dict(options.capacity_limits))
            budgets_of = {
                path: _path_budgets(
                    adapter.item_rules,
                    path,
                    path_adapter,
                    options.budgets,
                    self.device,
                    options.max_items_per_batch,
                    limits,
                )
                for path, path_adapter in self._paths.items()
            }
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.budgets: list[Budget] = sorted(budget for own in budgets_of.values() for budget in own)
        self.output_layout = OutputLayout(tuple(adapter.output_row_shapes), wire_dtype_name(self.dtype))
        # bound to the rules, not to self: an encoder in a reference cycle (and its graphs) would
        # wait for the garbage collector, which may run while another encoder captures
        consistent = functools.partial(_spec_is_consistent, adapter.item_rules)
        self._is_consistent = functools.lru_cache(maxsize=4096)(consistent)
        self._runners = {
            path: BatchRunner(
                path_adapter,
                budgets_of[path],
                self.device,
                self.dtype,
                self.attention,
                self.fused_ops,
                self.compiled_blocks,
                precision=self.precision,
            )
            for path, path_adapter in self._paths.items()
        }
        self._row_shapes = {path: tuple(path_adapter.row_shape) for path, path_adapter in self._paths.items()}
        self._urgent: BatchRunner | None = None
        self._interleaver: Interleaver | None = None
        self.urgent_budgets: frozenset[Budget] = frozenset()  # those of the urgent lane
        if self.device.type == "cuda":
            if options.urgent_tokens is not None and len(self._paths) == 1:
                self._start_urgent_lane(options.urgent_tokens, budgets_of[""])
            pool = (
                torch.cuda.graph_pool_handle()
            )  # one memory pool for every path's graphs: they replay in turn
            for path, runner in self._runners.items():
                capture_all(runner, budgets_of[path], pool)
            if self._urgent is not None:
                capture_all(self._urgent, sorted(self.urgent_budgets), torch.cuda.graph_pool_handle())

    def _start_urgent_lane(self, urgent_tokens: int, budgets: list[Budget]) -> None:
        """The urgent lane's runner (its own buffers, captured into a memory pool of its own: its
        graphs replay between two segments of a main-lane run, whose tensors that cross the cut
        live in the main pool), the main lane's budgets above it cut into segments, and the thread
        that queues both lanes' work."""
        ordered = sorted(budgets)
        cutoff = next(
            (b.num_tokens for b in ordered if b.num_tokens >= urgent_tokens), ordered[-1].num_tokens
        )
        urgent_budgets = [b for b in ordered if b.num_tokens <= cutoff]
        self._urgent = BatchRunner(
            self.adapter,
            urgent_budgets,
            self.device,
            self.dtype,
            self.attention,
            self.fused_ops,
            self.compiled_blocks,
            precision=self.precision,
        )
        self._runners[""].segment_above_tokens = cutoff
        self.urgent_budgets = frozenset(urgent_budgets)
        self._interleaver = Interleaver(self.device)
        weakref.finalize(self, self._interleaver.close)  # its thread ends with the encoder

    @classmethod
    def from_pretrained(
        cls, path: str | Path | None = None, options: EncoderOptions | None = None, **option_values: Any
    ) -> GraphEncoder:
        """Load a local Hugging Face checkpoint and capture its graphs.

        Args:
            path: a directory with a vision-tower-only save or a full multimodal checkpoint
                (safetensors), or only a config (random weights). None: the tiny Qwen3-VL-shaped
                model shipped with vitpool (random weights), so everything runs offline.
            options, **option_values: as for the constructor (`vitpool.specs.EncoderOptions`).

        Raises:
            CheckpointError: the directory cannot be loaded (names the missing or unexpected keys).
            ConfigError: invalid options.
        """
        options = _options_with(options, option_values)
        device = resolve_device(options.device)
        adapter = load_adapter(path, device, resolve_dtype(dtype_from_name(options.dtype), device))
        return cls(adapter, options)

    @classmethod
    def from_spec(cls, spec: EncoderSpec) -> GraphEncoder:
        """The encoder `spec` describes (an actor's, or a pool's settings), loaded and captured.

        Raises:
            CheckpointError, ConfigError: as for `from_pretrained`.
        """
        return cls.from_pretrained(spec.model, spec.options())

    # encode

    def encode(
        self,
        items: Sequence[Item],
        output_device: str | torch.device | None = None,
        return_exceptions: bool = False,
    ) -> list[Embedding] | list[Embedding | InvalidItemError]:
        """Encode `items`; returns one Embedding per item, in input order.

        Args:
            items: a list (or tuple) of Image and Video items.
            output_device: where the results go. None: the encoder's device. "cpu": each batch's
                outputs are copied to pinned host memory in one transfer per tensor.
            return_exceptions: False (default): a bad item raises and nothing is returned. True:
                every item is encoded that can be, and a bad item's slot holds its
                InvalidItemError instead (as `asyncio.gather(..., return_exceptions=True)`).

        Raises:
            TypeError: `items` is not a list (a tensor, a single item, a dict, a generator).
            InvalidItemError: an item is malformed, over `max_item_tokens` (refused before any
                work), has pixels that are not finite, or alone does not fit the device's memory;
                the message names its index. Unless `return_exceptions`; the encoder stays usable.
        """
        check_item_list(items)
        if return_exceptions:
            return self.encode_each(items, output_device)
        if not items:
            return []
        prepared = [self._checked_item(index, item) for index, item in enumerate(items)]
        outcomes = self.encode_prepared(prepared, output_device)
        for outcome in outcomes:
            if isinstance(outcome, InvalidItemError):
                raise outcome
        return outcomes  # type: ignore[return-value]  # no slot holds an error

    def encode_each(
        self, items: Sequence[Item], output_device: str | torch.device | None = None
    ) -> list[Embedding | InvalidItemError]:
        """`encode(items, output_device, return_exceptions=True)`: a bad item does not stop the
        others; its slot holds its InvalidItemError (naming its index in `items`).

        Raises:
            TypeError: `items` is not a list.
        """
        check_item_list(items)
        outcomes: list[Embedding | InvalidItemError | None] = [None] * len(items)
        prepared: list[Prepared] = []
        indices: list[int] = []
        for index, item in enumerate(items):
            try:
                prepared.append(self._checked_item(index, item))
                indices.append(index)
            except InvalidItemError as error:
                outcomes[index] = error
        for index, outcome in zip(indices, self.encode_prepared(prepared, output_device)):
            outcomes[index] = _renumbered(outcome, index)
        return outcomes  # type: ignore[return-value]  # every slot holds a result or an error

    def _checked_item(self, index: int, item: Item) -> Prepared:
        """Item `index` of a call checked by the model's rules and within `max_item_tokens`, as a
        pool's caller checks it; InvalidItemError naming the index otherwise."""
        prepared = prepare_item(index, item, self.adapter.item_rules)
        check_token_bound(index, prepared, self.max_item_tokens, "encoder", "build the encoder")
        return prepared

    def encode_prepared(
        self, prepared: Sequence[Prepared], output_device: str | torch.device | None = None
    ) -> list[Embedding | InvalidItemError]:
        """`encode_specs` of checked items, an item of several inputs (`PreparedParts`) as its
        parts, whose outputs are joined into its one Embedding (or its first part's error)."""
        parts = [part for item in prepared for part in item.parts]
        if len(parts) == len(prepared):
            return self.encode_specs(parts, output_device)
        outcomes, offset = [], 0
        part_outcomes = self.encode_specs(parts, output_device)
        for position, item in enumerate(prepared):
            mine = part_outcomes[offset : offset + len(item.parts)]
            offset += len(item.parts)
            errors = [outcome for outcome in mine if isinstance(outcome, InvalidItemError)]
            outcomes.append(
                InvalidItemError(position, errors[0].reason) if errors else Embedding.joined(mine)
            )
        return outcomes

    def encode_specs(
        self, prepared: Sequence[PreparedItem], output_device: str | torch.device | None = None
    ) -> list[Embedding | InvalidItemError]:
        """Encode items already checked by the model's item rules (`vitpool.items.prepare_items`),
        packing them into budgets here. Per item its Embedding, or an InvalidItemError (its
        position in `prepared`) where its pixels were not finite or it alone did not fit the
        device's memory (batches that run out of memory run again in halves, down to single items).

        Raises:
            ValueError: an item's pixels do not have the shape its spec says.
        """
        for position, item in enumerate(prepared):
            check_pixels(position, item.spec, item.pixels, self._row_shape(item.spec.path))
        batches = pack([item.spec for item in prepared], self.budgets, budgets_sorted=True)
        runs: list[RunBatch] = [
            (batch.budget, [prepared[i] for i in batch.item_indices]) for batch in batches
        ]
        outcomes: list[Embedding | InvalidItemError | None] = [None] * len(prepared)
        for group in _launch_groups(runs):
            group_results = self._embeddings_splitting([runs[p] for p in group], output_device)
            for position, results in zip(group, group_results):
                for index, result in zip(batches[position].item_indices, results):
                    if result is None:
                        result = InvalidItemError(index, NONFINITE_MESSAGE)
                    # an error comes named by its position in its batch
                    outcomes[index] = _renumbered(result, index)
        return outcomes  # type: ignore[return-value]  # every item is in one batch

    def _embeddings_splitting(
        self, runs: list[RunBatch], output_device: str | torch.device | None
    ) -> list[list[Embedding | InvalidItemError | None]]:
        """Per batch, per item: its Embedding; None where its pixels were not finite; or an
        InvalidItemError (its position in its batch) where it ran out of device memory alone.
        Batches that run out of memory run again in halves, then a batch's items in halves (a part
        of a batch fits its budget), so one item too large for the device costs the others of
        its call nothing."""
        try:
            return self._launch(runs, output_device).embeddings()
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(error):
                raise
            asked = asked_bytes(error)
        # Retried outside the except clause: the exception's traceback holds the failed run's
        # tensors until the clause ends (PyTorch FAQ), and freeing the cache needs them gone.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if len(runs) > 1:
            logger.warning("out of %s memory on %d batches; running them in halves", self.device, len(runs))
            half = len(runs) // 2
            return self._embeddings_splitting(runs[:half], output_device) + self._embeddings_splitting(
                runs[half:], output_device
            )
        budget, members = runs[0]
        if len(members) == 1:
            reason = out_of_memory_reason(members[0].spec, budget is None, str(self.device), asked)
            logger.error("refused an item: %s", reason)
            return [[InvalidItemError(0, reason)]]
        logger.warning(
            "out of %s memory on a batch of %d items; encoding them in halves", self.device, len(members)
        )
        half = len(members) // 2
        [first] = self._embeddings_splitting([(budget, members[:half])], output_device)
        [second] = self._embeddings_splitting([(budget, members[half:])], output_device)
        return [first + [_renumbered(outcome, half + position) for position, outcome in enumerate(second)]]

    def run_plans(
        self,
        groups: Sequence[tuple[BatchPlan, Sequence[torch.Tensor]]],
        output_device: str | torch.device | None = "cpu",
    ) -> list[list[Embedding | InvalidItemError]]:
        """Run batches as their planner packed them: per plan, per item its Embedding, or an
        InvalidItemError (its position in the plan) where its pixels were not finite.

        Consecutive plans that together fit one budget run as one replay (batches that waited
        for the encoder together); the others run as planned.

        Raises:
            ValueError: a plan does not match its pixels or this encoder's budgets (the batch
                fails as a whole).
        """
        return self.start_plans(groups, output_device).result()

    def start_plans(
        self,
        groups: Sequence[tuple[BatchPlan, Sequence[torch.Tensor]] | CheckedPlan],
        output_device: str | torch.device | None = "cpu",
        urgent: bool = False,
    ) -> PlansInFlight:
        """`run_plans` in two halves: this one checks the plans and queues their work on the
        device, and returns without waiting for it; `PlansInFlight.result()` waits. A server that
        queues its next batches before it waits for these keeps the GPU busy while its host
        finishes one batch and prepares the next. A group that this encoder's `check_plan`
        returned (a `CheckedPlan`) is not checked again.

        `urgent`: run in the urgent lane (see `urgent_tokens`) where the runs fit its budgets, between
        two segments of the main lane's run being queued; elsewhere, as any batch.

        Raises:
            ValueError: as for `run_plans`, before anything is queued.
        """
        checked = [group if isinstance(group, CheckedPlan) else self.check_plan(*group) for group in groups]
        members = [[PreparedItem(s, p) for s, p in zip(plan.specs, pixels)] for plan, pixels in checked]
        runs = self._merge_plans([plan for plan, _ in checked])
        batches: list[RunBatch] = [
            (budget, [m for i in indices for m in members[i]]) for budget, indices in runs
        ]
        sizes = [[len(members[i]) for i in indices] for _, indices in runs]
        if urgent and self._fits_urgent_lane(batches):
            to_host = self._wants_host(output_device)
            urgent_lane = self._urgent
            future = self._interleaver.urgent(lambda: urgent_lane.launch(batches, to_host))  # type: ignore[union-attr]
            return PlansInFlight(PendingLaunch(future), sizes)
        return PlansInFlight(self._launch(batches, output_device), sizes)

    @property
    def has_urgent_lane(self) -> bool:
        """Whether this encoder has an urgent lane (`urgent_tokens`, on a GPU, one path)."""
        return self._urgent is not None

    def _fits_urgent_lane(self, batches: Sequence[RunBatch]) -> bool:
        return self._urgent is not None and all(budget in self.urgent_budgets for budget, _ in batches)

    def check_plan(self, plan: BatchPlan, pixels: Sequence[np.ndarray | torch.Tensor]) -> CheckedPlan:
        """Whether a batch planned elsewhere can run: its pixels shaped as their specs say, each
        spec what the model's rules make of its layout (cheap: specs seen before are not derived
        again). The budget it runs in is picked here: this encoder's smallest that holds it (the
        plan's own budget was its planner's estimate), else none, and it runs eagerly at its own
        size, as a planner's batch of one item over every budget does.

        Returns:
            The plan in the budget picked for it and its pixels as tensors, as `start_plans` runs
            them without checking them again.

        Raises:
            ValueError: what does not match; the batch fails as a whole.
        """
        path = plan.specs[0].path if plan.specs else ""
        if any(spec.path != path for spec in plan.specs):
            raise ValueError(f"a batch mixes paths {sorted({spec.path for spec in plan.specs})}")
        tensors = check_plan(plan, pixels, self._row_shape(path), self._is_consistent)
        budget = self._budget_for(plan.specs, path)
        return CheckedPlan(
            plan if budget == plan.budget else dataclasses.replace(plan, budget=budget), tensors
        )

    def _budget_for(self, specs: Sequence[ItemSpec], path: str) -> Budget | None:
        """The smallest budget of `path` that holds these items, their pixel rows included; None
        where none does."""
        num_items, num_tokens, needs = totals(specs)
        num_rows = sum(spec.num_rows for spec in specs)
        runner = self._runner(path)
        for budget in self.budgets:
            if (
                budget.path == path
                and fits(budget, num_items, num_tokens, needs)
                and num_rows <= runner.rows(budget)
            ):
                return budget
        return None

    def stats(self) -> EncoderStats:
        """A snapshot of the counters (every path's together)."""
        snapshots = []
        for runner in self._runners.values():
            with runner.lock:
                snapshots.append(copy.deepcopy(runner.stats))
        if self._urgent is None:
            return snapshots[0] if len(snapshots) == 1 else EncoderStats.combined(snapshots)
        with self._urgent.lock:
            urgent = copy.deepcopy(self._urgent.stats)
        total = EncoderStats.combined([*snapshots, urgent])
        # the urgent lane's budgets are copies of the others': list them once
        total.captured_budgets = [b for s in snapshots for b in s.captured_budgets]
        total.disabled_budgets = [b for s in snapshots for b in s.disabled_budgets]
        total.dense_graphs = [b for s in snapshots for b in s.dense_graphs]
        total.urgent_interrupts = self._interleaver.interrupts if self._interleaver is not None else 0
        return total

    def _runner(self, path: str) -> BatchRunner:
        runner = self._runners.get(path)
        if runner is None:
            raise ValueError(f"this encoder has no path {path!r}; its paths are {sorted(self._runners)}")
        return runner

    def _row_shape(self, path: str) -> tuple[int, ...]:
        if path not in self._row_shapes:
            self._runner(path)  # raises, naming this encoder's paths
        return self._row_shapes[path]

    def _merge_plans(self, plans: Sequence[BatchPlan]) -> list[tuple[Budget | None, list[int]]]:
        """(budget, plan indices) per run: a plan joins the run before it when together they fit
        one budget (`_budget_for` picks it); an eager plan runs alone."""
        runs: list[tuple[Budget | None, list[int]]] = []
        for index, plan in enumerate(plans):
            previous = runs[-1][0] if runs else None
            if plan.budget is not None and previous is not None and previous.path == plan.budget.path:
                indices = [*runs[-1][1], index]
                merged = self._budget_for(
                    [spec for i in indices for spec in plans[i].specs], plan.budget.path
                )
                if merged is not None:
                    runs[-1] = (merged, indices)
                    continue
            runs.append((plan.budget, [index]))
        return runs

    def _launch(
        self, batches: Sequence[RunBatch], output_device: str | torch.device | None
    ) -> LaunchedBatches | PendingLaunch:
        """Queue the batches' work on the device; their outputs are fresh tensors once it is done."""
        to_host = self._wants_host(output_device)
        if not batches:  # every item of the call was refused before it got here
            return LaunchedBatches([], [], None)
        if len(self._runners) == 1:
            [runner] = self._runners.values()
            if self._interleaver is not None:
                return PendingLaunch(
                    self._interleaver.main(lambda between: runner.launch(batches, to_host, between))
                )
            return runner.launch(batches, to_host)
        by_path: dict[str, list[int]] = {}
        for position, (_, members) in enumerate(batches):
            by_path.setdefault(members[0].spec.path, []).append(position)
        launched = [
            (positions, self._runner(path).launch([batches[p] for p in positions], to_host))
            for path, positions in by_path.items()
        ]
        return LaunchedBatches.merged(len(batches), launched)

    def _wants_host(self, output_device: str | torch.device | None) -> bool:
        if output_device is None:
            return False
        if output_device == "cpu":  # what an actor asks for on every batch: nothing to parse
            return True
        try:
            resolved = torch.device(output_device)
        except (RuntimeError, TypeError):
            resolved = None
        if resolved is None or resolved.type not in ("cpu", self.device.type):
            raise ConfigError(f"output_device {output_device!r}: use None (the encoder's device) or 'cpu'")
        return resolved.type == "cpu"


# attention choice -> whether it runs on a device, and what it needs where it does not
_DEVICE_ATTENTION = {
    "cudnn": (
        cudnn_packed_available,
        (
            "the nvidia-cudnn-frontend package (installed with vitpool on Linux) and a GPU of compute "
            "capability 9.0 or newer"
        ),
    ),
    "fa4": (fa4_available, "the flash-attn-4 package and a GPU of compute capability 9.0 or newer"),
}


def _check_attention(attention: str, device: torch.device, dtype: torch.dtype) -> str:
    """What `EncoderOptions` cannot check without the device: whether FA4 or packed cuDNN runs here."""
    if attention in _DEVICE_ATTENTION and device.type == "cuda":
        available, needs = _DEVICE_ATTENTION[attention]
        if dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"attention {attention!r} runs in bfloat16 or float16, not {dtype}")
        if not available(device):
            raise ConfigError(
                f"attention {attention!r} needs {needs}; use 'auto' to take it where it can run"
            )
    return attention


def _check_precision(precision: str, device: torch.device, dtype: torch.dtype) -> str:
    """What `EncoderOptions` cannot check without the device: whether it runs FP8 GEMMs."""
    if precision == "fp8":
        if not fp8_supported(device):
            raise ConfigError(
                "precision 'fp8' needs a GPU of compute capability 8.9 or newer (FP8 tensor cores); the "
                f"device is {device}; use 'bf16'"
            )
        if dtype != torch.bfloat16:
            raise ConfigError(f"precision 'fp8' computes in bfloat16, not {dtype}")
    return precision


def _options_with(options: EncoderOptions | None, values: Mapping[str, Any]) -> EncoderOptions:
    """`options` (None: the defaults) with `values` over them, a torch device or dtype among them
    given by name (the options hold plain values).

    Raises:
        ConfigError: an invalid option; TypeError: a name that is no option.
    """
    if options is not None and not isinstance(options, EncoderOptions):
        raise TypeError(
            f"options must be a vitpool.specs.EncoderOptions, not {type(options).__name__}; give budgets and "
            "the other options by name (budgets=[64, 256])"
        )
    plain = dict(values)
    device, dtype = plain.get("device"), plain.get("dtype")
    if device is not None and not isinstance(device, str):
        plain["device"] = str(resolve_device(device))  # a torch.device, or an index
    if isinstance(dtype, torch.dtype):
        plain["dtype"] = str(dtype).removeprefix("torch.")
    if options is None:
        return EncoderOptions(**plain)
    return dataclasses.replace(options, **plain) if plain else options


def _spec_is_consistent(rules: ItemRules, spec: ItemSpec) -> bool:
    """Whether `spec` is what the model's rules (its input's, for an item of several inputs) make
    of its own layout."""
    try:
        if isinstance(rules, PathRules):
            own = rules_of_part(rules, spec.path)
            derived = own.item_spec(spec.modality, spec.pixel_shape, spec.pixel_dtype, spec.layout)
            return dataclasses.replace(derived, path=spec.path) == spec
        return rules.item_spec(spec.modality, spec.pixel_shape, spec.pixel_dtype, spec.layout) == spec
    except (ValueError, TypeError):
        return False


def _path_budgets(
    rules: ItemRules,
    path: str,
    adapter: VisionAdapter,
    budgets: Sequence[int] | None,
    device: torch.device,
    max_items_per_batch: int | None,
    limits: Mapping[str, int],
) -> list[Budget]:
    """A path's budgets: the user's token budgets, else its own adapter's defaults. Rules that
    route items to paths themselves (`ItemSpec.path` by the item's kind) mark their budgets."""
    token_budgets = default_token_budgets(device, adapter) if budgets is None else budgets
    if isinstance(rules, PathRules):
        return rules.path_budgets(path, token_budgets, max_items_per_batch, limits)
    return [
        budget for budget in rules.budgets(token_budgets, max_items_per_batch, limits) if budget.path == path
    ]


def _launch_groups(runs: Sequence[RunBatch]) -> list[list[int]]:
    """Positions of the runs launched together: every budgeted run in one launch, each eager run
    (one item over every budget) in its own. An eager item is large enough that a launch of its
    own costs little, and it is the one likely to run out of memory: alone, it is refused without
    running again, and without the call's other batches running again."""
    budgeted = [position for position, (budget, _) in enumerate(runs) if budget is not None]
    eager = [[position] for position, (budget, _) in enumerate(runs) if budget is None]
    return ([budgeted] if budgeted else []) + eager


def _renumbered(
    outcome: Embedding | InvalidItemError | None, index: int
) -> Embedding | InvalidItemError | None:
    """An item's error under its index in the caller's list (anything else as it is)."""
    return InvalidItemError(index, outcome.reason) if isinstance(outcome, InvalidItemError) else outcome


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
