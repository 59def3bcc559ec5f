"""An encoder actor's side of the pool's embedding cache: it publishes what it encoded.

A caller that missed an item in the cache claims its key and sends the key in the batch's plan
(`BatchPlan.cache_keys`); the actor that runs the batch puts the item's embedding in Ray's object
store and hands the reference to the cache's actor. Doing it here, not in the caller, keeps the
copy into the object store off the caller's path (in the caller, the put beside its next call made
a missed call several times slower), and the entries belong to a process that lives as long as the
pool's actor, not as long as a caller.

The work runs on one thread of its own, queued as the batch's results go back: outputs still on
the GPU are copied to the host on a stream of its own, so the encoder's next replay neither waits
for it nor is held up by it (a call right after a miss is not slower). Items whose batch refused
them give their claims up at once, so that callers waiting for them encode them themselves.

One thread, though under load it falls behind: publications wait for it far longer than each
takes, and callers waiting for those items wait with them. More threads empty that queue and cut
the tail of calls that repeat finished items, but raise the median call, likely because the
publishing then competes with the actor's encoding; a trade of the median for the tail is not
clearly better, so it stays one. Most of a publication is its `ray.put`. Figures:
`benchmarks/RESULTS.md`, "The embedding cache"; `benchmarks/HISTORY.md`, "Where the cache's p99
goes: the encoder actor's publishing under load" (`benchmarks/studies/cache_publish_lag.py`).

The cache actor's methods used (`vitpool.pool.cache_actor.EmbeddingCacheActor`):
`insert([(key, [reference], nbytes), ...])` and `abandon([key, ...])`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

import ray
import torch

from vitpool.items import Embedding

logger = logging.getLogger(__name__)


class CachePublisher:
    """Publishes the results of batches whose plan carries cache keys.

    Args:
        cache: the cache actor's handle.
    """

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vitpool-publish")
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.published = 0  # embeddings handed to the cache
        self.failures = 0  # publications that raised (their claims lapse in the cache)

    def publish(self, keys: Sequence[bytes | None], values: Sequence[Embedding | Any]) -> None:
        """Queue the publication of `values[i]` under `keys[i]` (each an Embedding, or anything
        else for an item that failed, whose claim is given up). Returns at once."""
        entries = [(key, value) for key, value in zip(keys, values) if key is not None]
        if entries:
            self._thread.submit(self._send, entries)

    def close(self) -> None:
        """Wait for the publications queued so far."""
        self._thread.shutdown(wait=True)

    def _send(self, entries: list[tuple[bytes, Any]]) -> None:
        try:
            stored, failed = [], []
            for key, value in entries:
                if isinstance(value, Embedding):
                    host = self._on_host(value)
                    stored.append((key, [ray.put(host)], host.nbytes))
                else:
                    failed.append(key)
            if stored:
                self._cache.insert.remote(stored)
                self.published += len(stored)
            if failed:
                self._cache.abandon.remote(failed)
        except Exception:  # the cache unreachable or Ray shutting down: the claims lapse on their own
            self.failures += 1
            logger.warning("could not publish %d embeddings to the pool's cache", len(entries), exc_info=True)

    def _on_host(self, embedding: Embedding) -> Embedding:
        """The embedding in host memory (a copy for outputs on a GPU, taken on this thread's stream;
        the encoder's results are complete when the batch returns them)."""
        device = embedding.tokens.device
        if device.type != "cuda":
            return embedding
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            return Embedding.from_outputs([tensor.to("cpu") for tensor in embedding.outputs])
