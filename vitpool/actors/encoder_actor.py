"""The encoder actor: one GraphEncoder on one GPU (or a CPU), fed packed batches by the pool.

A plain class; the pool wraps it with `ray.remote`, so this module imports no Ray and the class
can be tested in-process. Batches come two ways. Through Ray (`encode_batch`), items arrive as
NumPy views of the object store and results leave as pinned host copies, one transfer per tensor
per batch. Through the same-node channel (`vitpool.actors.local_channel`), items arrive in a
caller's shared-memory segment and results go back into it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from vitpool.actors.combining import BatchCombiner
from vitpool.actors.local_channel import ChannelInfo, ChannelServer, channel_supported
from vitpool.actors.reports import OK, RETIRED, ActorInfo, ActorStats, BatchReceipt
from vitpool.errors import EncodeError, InvalidItemError
from vitpool.graphs import GraphEncoder
from vitpool.items import Embedding, ItemMetadata, item_from_wire
from vitpool.transport.wire import to_array, wire_dtype_name

logger = logging.getLogger(__name__)


class EncoderActor:
    """Owns one GraphEncoder. Its constructor returns once every graph is captured and checked.

    Args:
        actor_index: the actor's number in its pool, for logs and stats.
        model: local checkpoint directory, or None for the shipped tiny model.
        budgets, max_items_per_batch, max_frames_per_batch: as for GraphEncoder.
        dtype_name: "bfloat16", "float16", "float32", or None for the device's default.
        device: "cpu", "cuda", or None for the actor's GPU if it has one.
        num_threads: torch's CPU threads (Ray starts actors with OMP_NUM_THREADS=1).
        serve_channel: also take batches from callers on the same node through shared memory
            (`vitpool.actors.local_channel`), where the platform allows it.
        channel_spin_s: after answering on the channel, poll this long for the next batch.
        max_tokens_per_run: the most output tokens of batches combined into one run; None: the
            largest budget.
    """

    def __init__(
        self,
        actor_index: int,
        model: str | None,
        budgets: Sequence[int] | None,
        max_items_per_batch: int | None,
        max_frames_per_batch: int | None,
        dtype_name: str | None,
        device: str | None,
        num_threads: int,
        serve_channel: bool = True,
        channel_spin_s: float = 0.0,
        max_tokens_per_run: int | None = None,
    ) -> None:
        start = time.perf_counter()
        torch.set_num_threads(num_threads)
        self.actor_index = actor_index
        dtype = getattr(torch, dtype_name) if dtype_name else None
        self.encoder = GraphEncoder.from_pretrained(
            model, budgets, max_items_per_batch, max_frames_per_batch, device=device, dtype=dtype
        )
        self._startup_seconds = time.perf_counter() - start
        self._gpu_ids = [str(g) for g in (_ray_context("get_accelerator_ids") or {}).get("GPU", [])]
        self._started_at = time.monotonic()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = 0
        self._busy_since = 0.0
        self._retiring = False
        self._stats = ActorStats(actor_index, self._device_name())
        # Batches from many callers that wait for the encoder run together (see combining.py).
        largest = self.encoder.budgets[-1].num_tokens
        self._combiner = BatchCombiner(self._encode_splitting, min(largest, max_tokens_per_run or largest))
        self._channel = (
            ChannelServer(self.run_batch, f"actor{actor_index}", self.encoder.device, channel_spin_s)
            if serve_channel and channel_supported()
            else None
        )
        logger.info("encoder actor %d ready on %s in %.1f s", actor_index, self._stats.device, self._startup_seconds)

    def info(self) -> ActorInfo:
        encoder_stats = self.encoder.stats()
        return ActorInfo(
            actor_index=self.actor_index,
            device=self._stats.device,
            node_id=_ray_context("get_node_id"),
            gpu_ids=list(self._gpu_ids),
            item_rules=self.encoder.adapter.item_rules,
            budgets=list(self.encoder.budgets),
            disabled_budgets=list(encoder_stats.disabled_budgets),
            startup_seconds=self._startup_seconds,
            pid=os.getpid(),
            placement_group_id=_placement_group_id(),
            channel=self._channel_info(),
            dtype_name=wire_dtype_name(self.encoder.dtype),
        )

    def _channel_info(self) -> ChannelInfo | None:
        if self._channel is None:
            return None
        adapter = self.encoder.adapter
        return ChannelInfo(
            self._channel.address, adapter.output_width, adapter.num_deepstack, wire_dtype_name(self.encoder.dtype)
        )

    def encode_batch(self, metadata: list[ItemMetadata], *pixels: np.ndarray) -> tuple:
        """Encode one packed batch sent through Ray: per item its metadata and its pixels (Ray
        resolves each pixel reference to a NumPy view of the object store before the call).

        Returns one value per item (its Embedding, or None if it failed; the receipt says why),
        then the BatchReceipt.
        """
        values, receipt = self.run_batch(metadata, list(pixels))
        return (*values, receipt)

    def encode_concatenated_arrays(self, metadata: list[ItemMetadata], *pixels: np.ndarray) -> list[np.ndarray]:
        """One call for every rank of an LLM deployment (`vitpool.pool.rank_delivery`): its outputs
        as host arrays [tokens, *deepstack], each the items' rows in order."""
        return [to_array(tensor) for tensor in self.concatenated_outputs(metadata, pixels, output_device="cpu")]

    def concatenated_outputs(
        self, metadata: list[ItemMetadata], pixels: Sequence[np.ndarray], output_device: str | None
    ) -> list[torch.Tensor]:
        """A call's outputs as [tokens, *deepstack], each the items' rows in order. Raises if the
        actor is retiring or an item fails (naming the first such item)."""
        values, receipt = self.run_batch(metadata, list(pixels), output_device=output_device)
        if receipt.status != OK:
            raise EncodeError(f"encoder actor {self.actor_index} refused the call ({receipt.status}); send it again")
        if receipt.item_errors:
            position, reason = min(receipt.item_errors.items())
            raise InvalidItemError(position, reason)
        return [
            torch.cat([v.tokens for v in values]),
            *[torch.cat([v.deepstack[k] for v in values]) for k in range(len(values[0].deepstack))],
        ]

    def run_batch(
        self, metadata: list[ItemMetadata], pixels: list[np.ndarray], output_device: str | None = "cpu"
    ) -> tuple[list[Embedding | None], BatchReceipt]:
        """Encode one batch, from Ray or the same-node channel: per-item values and the receipt.
        Outputs go to pinned host memory, or stay on the device for `output_device=None`."""
        with self._lock:
            if self._retiring:
                return [None] * len(metadata), BatchReceipt(RETIRED)
            if self._running == 0:
                self._busy_since = time.monotonic()
            self._running += 1
        start = time.perf_counter()
        try:
            items = [item_from_wire(m, p) for m, p in zip(metadata, pixels, strict=True)]
            tokens = sum(_output_tokens(m, self.encoder.adapter.merge_unit) for m in metadata)
            outcomes = self._combiner(items, tokens, output_device)
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._stats.busy_seconds += time.monotonic() - self._busy_since
                    self._idle.notify_all()
        errors = {i: o.reason for i, o in enumerate(outcomes) if not isinstance(o, Embedding)}
        with self._lock:
            self._stats.batches += 1
            self._stats.items += len(metadata)
            self._stats.rejected_items += len(errors)
        values = [o if isinstance(o, Embedding) else None for o in outcomes]
        return values, BatchReceipt(OK, errors, time.perf_counter() - start)

    def _encode_splitting(self, items: list, output_device: str | None) -> list:
        """encode_each; on running out of GPU memory, free the cache and encode each half on its
        own (down to single items), so the batch is still answered and the actor stays up."""
        try:
            return self.encoder.encode_each(items, output_device=output_device)
        except torch.cuda.OutOfMemoryError:
            if self.encoder.device.type == "cuda":
                torch.cuda.empty_cache()
            with self._lock:
                self._stats.oom_splits += 1
            if len(items) == 1:
                logger.error("encoder actor %d: out of GPU memory on a single item", self.actor_index)
                raise
            logger.warning("encoder actor %d: out of GPU memory on %d items; encoding them in halves",
                           self.actor_index, len(items))
            half = len(items) // 2
            return self._encode_splitting(items[:half], output_device) + self._encode_splitting(items[half:], output_device)

    def stats(self) -> ActorStats:
        encoder_stats = self.encoder.stats()
        with self._lock:
            stats = ActorStats(**vars(self._stats))
            if self._running:
                stats.busy_seconds += time.monotonic() - self._busy_since
        stats.graph_items = encoder_stats.graph_items
        stats.eager_items = encoder_stats.eager_items
        stats.padding_waste = encoder_stats.padding_waste
        stats.runs = self._combiner.counters.runs
        stats.combined_batches = self._combiner.counters.combined_batches
        stats.uptime_seconds = time.monotonic() - self._started_at
        return stats

    def retire(self, timeout_s: float) -> bool:
        """Refuse new batches (they come back RETIRED, for the pool to send elsewhere) and wait
        until the running ones are done. Returns whether they finished within `timeout_s`."""
        with self._lock:
            self._retiring = True
            return self._idle.wait_for(lambda: self._running == 0, timeout=timeout_s)

    def _device_name(self) -> str:
        device = self.encoder.device
        if device.type == "cuda":
            # Ray narrows CUDA_VISIBLE_DEVICES, so every actor sees its GPU as cuda:0: name the node's GPU id.
            where = f", GPU {','.join(self._gpu_ids)} of the node" if self._gpu_ids else ""
            return f"{device} ({torch.cuda.get_device_name(device)}{where})"
        return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def _output_tokens(metadata: ItemMetadata, merge_unit: int) -> int:
    """An item's output tokens from its grid, for combining batches; 0 for a grid the encoder
    will reject anyway."""
    try:
        return max(0, int(np.prod([int(n) for n in metadata[1]]))) // merge_unit
    except (TypeError, ValueError, IndexError):
        return 0


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
