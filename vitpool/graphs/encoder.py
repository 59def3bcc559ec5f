"""GraphEncoder: a vision tower run as one captured CUDA graph per token budget.

Static buffers sized for the largest budget; every budget captured, largest first, into one
memory pool and checked against the eager run of the same forward; per batch, the items copied
in, padding rows written, the graph replayed and each item's rows cloned out. An item larger
than every budget runs eager, alone, as does one whose rows no path's buffers hold (its rules
mark it: `ItemSpec.served_by_graph`); on a CPU the same static forward runs without capture.

`encode` checks what a caller hands it as a pool's caller would (`vitpool.items`: a list, each
item by the model's rules and within `max_item_tokens`; errors name the index). `run_plans` and
`start_plans` run batches a pool already planned, checked once where they arrive (`check_plan`
gives a `CheckedPlan`, not checked again); `start_plans` returns before the device is done
(`vitpool.graphs.in_flight`). The encoder never looks inside an item: its adapter does.

This module is the API: loading, checking and packing. Where batches run (the runners per path,
the urgent lane, the halving of runs that run out of memory) is `vitpool.graphs.lanes`; what the
options come to on the device, `vitpool.graphs.options`; one batch's fill, forward and outputs,
the batch runner's (`vitpool.graphs.runner`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitpool.dtypes import dtype_from_name
from vitpool.encoder_spec import EncoderOptions, EncoderSpec
from vitpool.encoder_spec import capacity_limits as merged_capacity_limits
from vitpool.errors import ConfigError, InvalidItemError
from vitpool.graphs.defaults import resolve_device, resolve_dtype
from vitpool.graphs.in_flight import PlansInFlight, RunBatch
from vitpool.graphs.inputs import (
    NONFINITE_MESSAGE,
    CheckedPlan,
    check_pixels,
    check_plan,
    totals,
)
from vitpool.graphs.lanes import Lanes, launch_groups, renumbered
from vitpool.graphs.options import (
    check_attention,
    check_precision,
    options_with,
    path_budgets,
    place_tower,
    spec_is_consistent,
)
from vitpool.graphs.runner import BatchRunner
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
from vitpool.kernels.compiled import set_compile_cache_dir
from vitpool.kernels.fp8 import install_fp8_linears
from vitpool.models import VisionAdapter, load_adapter
from vitpool.models.protocol import check_adapter
from vitpool.packing import Budget, fits, pack
from vitpool.specs import BatchPlan, ItemSpec, OutputLayout
from vitpool.transport.wire import wire_dtype_name

logger = logging.getLogger(__name__)


class GraphEncoder:
    """Encodes images and videos with a vision tower, replaying a CUDA graph per token budget.

    Args:
        adapter: the model, seen through `vitpool.models.VisionAdapter`.
        options: how to capture and run it (`vitpool.encoder_spec.EncoderOptions`, where each option is
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
        check_adapter(adapter)  # one built by hand, not through load_adapter, is checked here
        self.options = options = options_with(options, option_values)
        self.max_item_tokens = options.max_item_tokens
        self.device = resolve_device(options.device)
        self.fused_ops = options.fused_ops
        self.compiled_blocks = options.compiled_blocks and self.device.type == "cuda"
        if self.compiled_blocks:
            set_compile_cache_dir(options.compile_cache_dir)
        self.dtype = resolve_dtype(dtype_from_name(options.dtype), self.device)
        self.attention = check_attention(options.attention, self.device, self.dtype)
        self.precision = check_precision(options.precision, self.device, self.dtype)
        if self.precision == "fp8" and adapter.fp8_refused:
            raise ConfigError(
                f"precision 'fp8' is not offered for {type(adapter).__name__}: {adapter.fp8_refused}"
            )
        self.adapter = adapter
        place_tower(adapter.tower, self.device, self.dtype)
        # A family whose item is several inputs runs each through its own adapter, buffers and
        # graphs (a path, `vitpool.rules.paths`); the others have one path, "".
        self._paths: dict[str, VisionAdapter] = dict(adapter.paths)
        if self.precision == "fp8":
            towers = {id(each.tower): each.tower for each in (adapter, *self._paths.values())}
            prepared = sum(install_fp8_linears(tower) for tower in towers.values())
            logger.info("precision fp8: %d Linears of the tower's blocks run as FP8 GEMMs", prepared)
        try:
            limits = merged_capacity_limits(options.max_frames_per_batch, dict(options.capacity_limits))
            budgets_of = {
                path: path_budgets(
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
        consistent = functools.partial(spec_is_consistent, adapter.item_rules)
        self._is_consistent = functools.lru_cache(maxsize=4096)(consistent)
        self._row_shapes = {path: tuple(path_adapter.row_shape) for path, path_adapter in self._paths.items()}
        self._lanes = Lanes(
            self._paths,
            budgets_of,
            self.device,
            self.dtype,
            self.attention,
            self.fused_ops,
            self.compiled_blocks,
            self.precision,
            options.urgent_tokens,
        )
        self._runners = self._lanes.runners  # by path (benchmarks and tests reach a runner here)
        self.urgent_budgets: frozenset[Budget] = self._lanes.urgent_budgets  # those of the urgent lane

    @classmethod
    def from_pretrained(
        cls, path: str | Path | None = None, options: EncoderOptions | None = None, **option_values: Any
    ) -> GraphEncoder:
        """Load a local Hugging Face checkpoint and capture its graphs.

        Args:
            path: a directory with a vision-tower-only save or a full multimodal checkpoint
                (safetensors), or only a config (random weights). None: the tiny Qwen3-VL-shaped
                model shipped with vitpool (random weights), so everything runs offline.
            options, **option_values: as for the constructor (`vitpool.encoder_spec.EncoderOptions`).

        Raises:
            CheckpointError: the directory cannot be loaded (names the missing or unexpected keys).
            ConfigError: invalid options.
        """
        options = options_with(options, option_values)
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
            return self._encode_each(items, output_device)
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
        return self._encode_each(items, output_device)

    def _encode_each(
        self, items: Sequence[Item], output_device: str | torch.device | None
    ) -> list[Embedding | InvalidItemError]:
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
            outcomes[index] = renumbered(outcome, index)
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
        to_host = self._wants_host(output_device)
        for position, item in enumerate(prepared):
            check_pixels(position, item.spec, item.pixels, self._row_shape(item.spec.path))
        batches = pack([item.spec for item in prepared], self.budgets, budgets_sorted=True)
        runs: list[RunBatch] = [
            (batch.budget, [prepared[i] for i in batch.item_indices]) for batch in batches
        ]
        outcomes: list[Embedding | InvalidItemError | None] = [None] * len(prepared)
        for group in launch_groups(runs):
            group_results = self._lanes.run_halving([runs[p] for p in group], to_host)
            for position, results in zip(group, group_results):
                for index, result in zip(batches[position].item_indices, results):
                    if result is None:
                        result = InvalidItemError(index, NONFINITE_MESSAGE)
                    # an error comes named by its position in its batch
                    outcomes[index] = renumbered(result, index)
        return outcomes  # type: ignore[return-value]  # every item is in one batch

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
        return self._lanes.start(batches, sizes, self._wants_host(output_device), urgent)

    @property
    def has_urgent_lane(self) -> bool:
        """Whether this encoder has an urgent lane (`urgent_tokens`, on a GPU, one path)."""
        return self._lanes.urgent is not None

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
        return self._lanes.stats()

    def _runner(self, path: str) -> BatchRunner:
        return self._lanes.runner(path)

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
