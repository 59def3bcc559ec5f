"""The encoder actor: one GraphEncoder on one GPU (or a CPU), fed planned batches by the pool.

A plain class; the pool wraps it with `ray.remote`, so this module imports no Ray and the class
can be tested in-process. Batches come two ways, both as a `BatchPlan` (the item specs the
caller's process computed, and the budget its dispatcher chose) with one pixel array per item.
Through Ray (`encode_batch`), pixels arrive as NumPy views of the object store and results leave
as pinned host copies, one transfer per tensor per batch. Through the same-node channel
(`vitpool.transport.channel`), pixels arrive in a caller's shared-memory segment and results go
back into it. The actor trusts the plan after the encoder's cheap consistency check, made once per
batch as it arrives (`GraphEncoder.check_plan`): what passed it runs without a second check.

The engine (`vitpool.graphs`, transformers, the model's code) is imported when an actor is built,
not with this module: Ray loads an actor's class wherever a handle to it is unpickled, and a
pool's callers hold handles.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from vitpool.actors.combining import BatchCombiner, Collect, finished
from vitpool.actors.reports import ActorInfo, ActorStats
from vitpool.encoder_spec import ActorSpec
from vitpool.errors import EncodeError, InvalidItemError, counted
from vitpool.items import Embedding, PreparedItem
from vitpool.specs import BatchPlan, ItemSpec
from vitpool.transport.channel import ChannelServer, channel_supported
from vitpool.transport.link import OK, RETIRED, BatchReceipt
from vitpool.transport.wire import to_array

if TYPE_CHECKING:
    from vitpool.graphs import GraphEncoder
    from vitpool.graphs.inputs import CheckedPlan

logger = logging.getLogger(__name__)


class EncoderActor:
    """Owns one GraphEncoder. Its constructor returns once every graph is captured and checked.

    Args:
        actor_index: the actor's number in its pool, for logs and stats.
        spec: the encoder to build and how to serve it (`vitpool.encoder_spec.ActorSpec`).
        gpu_ids: the node's GPUs it runs on, as Ray names them; None: those Ray gave the actor.
        encoder: the encoder, built and captured already (a warm standby's, `vitpool.actors.standby`);
            None: built from `spec` here.

    Raises:
        CheckpointError, ConfigError: the encoder cannot be built. Inside a Ray actor the
            constructor keeps the error instead and `info` raises it: Ray would report it as
            ActorDiedError text, its type lost (`vitpool.pool.start_errors`); the pool then
            stops the actor.
    """

    def __init__(
        self,
        actor_index: int,
        spec: ActorSpec,
        gpu_ids: Sequence[str] | None = None,
        encoder: GraphEncoder | None = None,
    ) -> None:
        self.actor_index = actor_index
        self._start_error: Exception | None = None
        try:
            self._start(spec, gpu_ids, encoder)
        except Exception as error:
            if _ray_context("get_actor_id") is None:
                raise  # built in this process (tests, benchmarks): fail as any constructor does
            logger.error("encoder actor %d failed to start: %s: %s", actor_index, type(error).__name__, error)
            self._start_error = error

    def _start(self, spec: ActorSpec, gpu_ids: Sequence[str] | None, encoder: GraphEncoder | None) -> None:
        start = time.perf_counter()
        torch.set_num_threads(spec.num_threads)
        actor_index = self.actor_index
        if encoder is None:
            from vitpool.graphs import GraphEncoder  # the engine: see the module's docstring

            encoder = GraphEncoder.from_spec(spec.encoder)
        self.encoder: GraphEncoder = encoder
        self._startup_seconds = time.perf_counter() - start
        if gpu_ids is None:  # Ray's, for an actor it gave GPUs (a standby is given its GPU ids)
            gpu_ids = (_ray_context("get_accelerator_ids") or {}).get("GPU", [])
        self._gpu_ids = [str(g) for g in gpu_ids]
        self._started_at = time.monotonic()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = 0
        self._busy_since = 0.0
        self._retiring = False
        self._stats = ActorStats(actor_index, self._device_name())
        # Batches from many callers that wait for the encoder run together (see combining.py).
        largest = self.encoder.budgets[-1].num_tokens
        max_tokens_per_run = min(largest, spec.max_tokens_per_run or largest)
        start = self._start_batches if spec.overlap_runs else finished(self._run_batches)
        self._combiner = BatchCombiner(start, max_tokens_per_run, spec.small_first_tokens)
        # Batches of at most `urgent_tokens` replay in the encoder's urgent lane, beside the run in
        # flight, combined among themselves up to the lane's largest budget.
        self._urgent_combiner: BatchCombiner | None = None
        self._urgent_tokens = spec.encoder.urgent_tokens
        if self.encoder.has_urgent_lane:
            urgent_start = functools.partial(self._start_batches, urgent=True)
            lane_tokens = max(budget.num_tokens for budget in self.encoder.urgent_budgets)
            self._urgent_combiner = BatchCombiner(
                urgent_start if spec.overlap_runs else finished(urgent_start),
                lane_tokens,
            )
        self._publisher = None
        if spec.embedding_cache is not None:
            from vitpool.actors.cache_publisher import CachePublisher  # Ray's, only where there is a cache

            self._publisher = CachePublisher(spec.embedding_cache)
        self._channel = (
            ChannelServer(
                self.run_batch,
                f"actor{actor_index}",
                self.encoder.device,
                spec.channel_spin_s,
                self.encoder.output_layout,
            )
            if spec.serve_channel and channel_supported()
            else None
        )
        logger.info(
            "encoder actor %d ready on %s in %.1f s", actor_index, self._stats.device, self._startup_seconds
        )

    def info(self) -> ActorInfo:
        """Who this actor is, once ready.

        Raises:
            Exception: the error the actor met as it started (see the class), as its own type.
        """
        if self._start_error is not None:
            raise self._start_error
        encoder_stats = self.encoder.stats()
        return ActorInfo(
            actor_index=self.actor_index,
            device=self._stats.device,
            node_id=_ray_context("get_node_id"),
            gpu_ids=list(self._gpu_ids),
            item_rules=self.encoder.adapter.item_rules,
            budgets=list(self.encoder.budgets),
            output_layout=self.encoder.output_layout,
            disabled_budgets=list(encoder_stats.disabled_budgets),
            startup_seconds=self._startup_seconds,
            pid=os.getpid(),
            placement_group_id=_placement_group_id(),
            channel=None if self._channel is None else self._channel.info,
            dtype_name=self.encoder.output_layout.dtype,
        )

    def encode_batch(self, plan: BatchPlan, *pixels: np.ndarray) -> tuple:
        """Run one planned batch sent through Ray: the plan, then per item its pixels (Ray resolves
        each pixel reference to a NumPy view of the object store before the call).

        Returns one value per item (its Embedding, or None if it failed; the receipt says why),
        then the BatchReceipt.
        """
        values, receipt = self.run_batch(plan, list(pixels))
        return (*values, receipt)

    def run_batch(
        self, plan: BatchPlan, pixels: list[np.ndarray], output_device: str | None = "cpu"
    ) -> tuple[list[Embedding | None], BatchReceipt]:
        """Run one planned batch, from Ray or the same-node channel: per-item values and the
        receipt. Outputs go to pinned host memory, or stay on the device for `output_device=None`.

        Raises:
            ValueError: the plan does not match its pixels or this encoder (the batch fails).
        """
        if not self._enter():
            return [None] * len(plan.specs), BatchReceipt(RETIRED)
        start = time.perf_counter()
        try:
            # Checked here, once, before it can share a run: a plan that does not hold fails its own
            # batch only, and the encoder runs what passed without checking it again.
            checked = self.encoder.check_plan(plan, pixels)
            outcomes = self._combiner_for(checked.plan)([checked], plan.num_tokens, output_device)[0]
        finally:
            self._leave()
        if plan.cache_keys and self._publisher is not None:
            self._publisher.publish(plan.cache_keys, outcomes)
        errors = {i: o.reason for i, o in enumerate(outcomes) if isinstance(o, InvalidItemError)}
        with self._lock:
            self._stats.batches += 1
            self._stats.items += len(plan.specs)
            self._stats.rejected_items += len(errors)
        values = [o if isinstance(o, Embedding) else None for o in outcomes]
        return values, BatchReceipt(OK, errors, time.perf_counter() - start)

    def encode_concatenated_arrays(self, specs: list[ItemSpec], *pixels: np.ndarray) -> list[np.ndarray]:
        """One call for every rank of an LLM deployment (`vitpool.pool.rank_delivery`): its outputs
        as host arrays in `OutputLayout` order, each the items' rows in order."""
        return [to_array(tensor) for tensor in self.concatenated_outputs(specs, pixels, output_device="cpu")]

    def concatenated_outputs(
        self, specs: Sequence[ItemSpec], pixels: Sequence[np.ndarray], output_device: str | None
    ) -> list[torch.Tensor]:
        """A call's outputs in `OutputLayout` order, each the items' rows in order. The items come
        checked (specs made by the caller's item rules) and are packed here, as one call.

        Raises:
            EncodeError: the actor is retiring.
            InvalidItemError: an item's pixels are not finite (the first such item).
        """
        if not self._enter():
            raise EncodeError(f"encoder actor {self.actor_index} refused the call (retiring); send it again")
        try:
            prepared = [PreparedItem(spec, tensor) for spec, tensor in zip(specs, _tensors(specs, pixels))]
            outcomes = self.encoder.encode_specs(prepared, output_device)
        finally:
            self._leave()
        errors = [outcome for outcome in outcomes if isinstance(outcome, InvalidItemError)]
        with self._lock:
            self._stats.batches += 1
            self._stats.items += len(specs)
            self._stats.rejected_items += len(errors)
        if errors:
            raise errors[0]
        num_outputs = len(self.encoder.output_layout.row_shapes)
        return [torch.cat([outcome.outputs[k] for outcome in outcomes]) for k in range(num_outputs)]

    def _combiner_for(self, plan: BatchPlan) -> BatchCombiner:
        """The urgent lane's combiner for a batch of at most `urgent_tokens` in one of its budgets,
        else the other."""
        if (
            self._urgent_combiner is not None
            and plan.num_tokens <= self._urgent_tokens
            and plan.budget in self.encoder.urgent_budgets
        ):
            return self._urgent_combiner
        return self._combiner

    def stats(self) -> ActorStats:
        encoder_stats = self.encoder.stats()
        with self._lock:
            stats = ActorStats(**vars(self._stats))
            if self._running:
                stats.busy_seconds += time.monotonic() - self._busy_since
        stats.graph_items = encoder_stats.graph_items
        stats.eager_items = encoder_stats.eager_items
        stats.padding_waste = encoder_stats.padding_waste
        stats.oom_splits = encoder_stats.oom_splits
        combiners = (
            [self._combiner] if self._urgent_combiner is None else [self._combiner, self._urgent_combiner]
        )
        stats.runs = sum(combiner.counters.runs for combiner in combiners)
        stats.combined_batches = sum(combiner.counters.combined_batches for combiner in combiners)
        stats.uptime_seconds = time.monotonic() - self._started_at
        return stats

    def retire(self, timeout_s: float) -> bool:
        """Refuse new batches (they come back RETIRED, for the pool to send elsewhere) and wait
        until the running ones are done. Returns whether they finished within `timeout_s`."""
        with self._lock:
            self._retiring = True
            return self._idle.wait_for(lambda: self._running == 0, timeout=timeout_s)

    def _enter(self) -> bool:
        """Count a batch as running; False (and nothing counted) once the actor is retiring."""
        with self._lock:
            if self._retiring:
                return False
            if self._running == 0:
                self._busy_since = time.monotonic()
            self._running += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._stats.busy_seconds += time.monotonic() - self._busy_since
                self._idle.notify_all()

    def _start_batches(
        self, groups: list[CheckedPlan], output_device: Hashable, urgent: bool = False
    ) -> Collect:
        """The encoder's `start_plans` (the combiner collects its result later). Running out of
        GPU memory is the encoder's to handle: it runs the batches in halves, down to single
        items, and a single item that does not fit comes back as that item's error."""
        return self.encoder.start_plans(groups, output_device, urgent).result

    def _run_batches(self, groups: list[CheckedPlan], output_device: Hashable) -> list:
        """`_start_batches`, collected at once: the batches have run when this returns."""
        return self._start_batches(groups, output_device)()

    def _device_name(self) -> str:
        device = self.encoder.device
        if device.type == "cuda":
            # Ray narrows CUDA_VISIBLE_DEVICES, so every actor sees its GPU as cuda:0: name the node's GPU id.
            where = f", GPU {','.join(self._gpu_ids)} of the node" if self._gpu_ids else ""
            return f"{device} ({torch.cuda.get_device_name(device)}{where})"
        return f"cpu ({counted(os.cpu_count() or 1, 'core')}, {counted(torch.get_num_threads(), 'thread')})"


def _tensors(specs: Sequence[ItemSpec], pixels: Sequence[np.ndarray | torch.Tensor]) -> list[torch.Tensor]:
    """The pixels as torch tensors of their specs' dtypes, sharing memory (`pixel_tensor`).

    Raises:
        ValueError: not one array per spec, or an array that does not travel as its spec says.
    """
    from vitpool.graphs.inputs import pixel_tensor  # the engine is loaded once the actor is built

    if len(pixels) != len(specs):
        raise ValueError(
            f"a batch of {counted(len(specs), 'item spec')} came with {counted(len(pixels), 'pixel array')}"
        )
    return [pixel_tensor(position, spec, array) for position, (spec, array) in enumerate(zip(specs, pixels))]


def _placement_group_id() -> str | None:
    group = _ray_context("get_placement_group_id")
    return group.hex() if hasattr(group, "hex") else group


def _ray_context(method: str):
    """A value from Ray's runtime context, or None outside Ray (the class runs in-process in tests)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return getattr(ray.get_runtime_context(), method)()
    except (ImportError, AttributeError):
        return None
