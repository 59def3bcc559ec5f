"""The pool's embedding cache: an item encoded once is served to every caller from then on. This
module is the caller's side (`CacheClient`, and the handle's own tier); the keys are in
`vitpool.pool.cache_keys`, the shared actor in `vitpool.pool.cache_actor`.

Where it lives, and why: one async Ray actor per pool (`cache_actor.EmbeddingCacheActor`, started by
the pool's controller and gone with it) maps content keys to references to embeddings in Ray's
object store. Every handle of the pool, in any process or deployment, asks the same actor, so a hit
from any caller is a hit for all; the embeddings never pass through the actor, which only answers
small messages and is never busy copying. The alternatives were worse: a cache in the encoder actors
would need items routed to an actor by key, against the least-loaded dispatch that keeps GPUs busy;
a tier in each caller's process alone is not shared.

Who publishes: the encoder actor that computed an item (`vitpool.actors.cache_publisher`), off
its GPU thread, after the reply. The caller that missed sends the key it claimed in the batch's
plan. A caller that put the embedding itself, beside its next call, made a missed 1x224 call 3.5x
slower on an H100; an actor that took the embedding and re-put it cost a copy through the actor
(`benchmarks/HISTORY.md`). An entry's object belongs to the encoder actor that put it (Ray's
ownership): when that actor exits, its entries are gone, and a caller that then gets one finds it
lost, drops it, and encodes the item (a clean miss). Two kinds of results are still published
by the caller: `encode_refs` results (already references, so nothing is copied) and items of
several inputs, whose parts may run on different actors.

Each handle also keeps the embeddings it served or encoded in a small tier of its own process
(`embedding_cache_local_bytes`): a key names its content for good, so an entry there is never
stale, and a hit on it costs no round trip. The price of the shared cache is one round trip to
its actor per call that the local tier does not serve (a call's keys go in one message); a hit
then costs that and a fetch from the object store instead of an encode. The cache is off by default
(`embedding_cache_bytes=0`): the round trip is more than the whole per-call cost of the pool on a
small image, which a workload without repeats would pay for nothing.

Keys (`cache_keys.item_key`): a 128-bit XXH3 digest of the pool's model identity (its config's and
weights' content and its dtype: `cache_keys.model_identity`, the vLLM gateway's idea of the same
model too) and, per part of the item, its spec (modality, pixel shape and dtype, grid or layout,
path) and its pixel bytes. A changed pixel is another key; among a billion distinct items the chance
that two share a key is about 1e-21 (a peer's 16-bit keys collided in practice).

Concurrent identical items are encoded once: the first caller to miss a key claims it; others
that ask meanwhile wait for its result (or, if it fails or its caller vanishes, for the claim to
lapse, and then encode it themselves). Duplicates within one call are encoded once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from vitpool.items import Embedding
from vitpool.pool.cache_actor import HIT, PENDING
from vitpool.pool.cache_keys import item_key, model_identity
from vitpool.pool.lru import ByteBoundedLRU
from vitpool.pool.stats import CacheStats
from vitpool.transport.wire import from_array, to_array, wire_dtype_name

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 10.0  # a cache that does not answer is skipped for the call (it is encoded)


@dataclass
class CacheAnswer:
    """What the cache said about one call's items, by index in the call."""

    owned: dict[int, bytes] = field(default_factory=dict)  # claimed: this call encodes them
    hits: dict[int, tuple[bytes, Any]] = field(default_factory=dict)  # key, reference
    local: dict[int, Embedding] = field(default_factory=dict)  # served by this process's tier
    waiting: dict[int, bytes] = field(default_factory=dict)  # another caller encodes them
    copies: dict[int, int] = field(default_factory=dict)  # a repeat in this call -> its first index
    keys: dict[int, bytes] = field(default_factory=dict)  # every checked item's key
    by_actor: set[int] = field(default_factory=set)  # owned items the encoder actor publishes

    @property
    def served(self) -> set[int]:
        """Items this call does not encode itself (unless their answer falls through)."""
        return set(self.hits) | set(self.local) | set(self.waiting) | set(self.copies)

    def actor_publishes(self, index: int, num_parts: int, want_refs: bool) -> bytes | None:
        """The key to send with an owned item's batch, for its encoder actor to publish the result
        (then recorded in `by_actor`); None where this caller publishes (see the module)."""
        key = self.owned.get(index)
        if key is None or want_refs or num_parts != 1:
            return None
        self.by_actor.add(index)
        return key


class _LocalTier:
    """A handle's own least-recently-used embeddings, bounded in bytes; thread-safe. It holds
    private copies and hands out copies."""

    def __init__(self, capacity_bytes: int) -> None:
        self._entries: ByteBoundedLRU[bytes, Embedding] = ByteBoundedLRU(capacity_bytes)
        self._lock = threading.Lock()

    def get(self, key: bytes) -> Embedding | None:
        with self._lock:
            embedding = self._entries.get(key)
        return None if embedding is None else _copied(embedding)

    def keep(self, key: bytes, embedding: Embedding) -> None:
        nbytes = embedding.nbytes
        if nbytes > self._entries.max_bytes:
            return  # not worth the copy: the bound refuses it
        copy = _copied(embedding)
        with self._lock:
            if key not in self._entries:
                self._entries.put(key, copy, nbytes)


class CacheClient:
    """One handle's way to the pool's cache. A cache that cannot be reached is skipped (its
    items are encoded, with a warning); what this caller publishes goes on a thread of its own,
    from copies taken before the call returns, so a caller that writes into its results cannot
    change an entry.

    Args:
        handle: the cache actor.
        model, dtype_name: the pool's model, for the keys (`model_identity`).
        local_bytes: bound on this handle's own tier (0: none).
    """

    def __init__(self, handle: Any, model: str | None, dtype_name: str, local_bytes: int = 0) -> None:
        self._handle = handle
        self._identity = model_identity(model, dtype_name)
        self._publisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vitpool-cache")
        self._local = _LocalTier(local_bytes) if local_bytes > 0 else None
        self._warned = False
        self.failures = 0  # lookups or publications that failed (the cache was skipped)
        self.local_hits = 0  # keys this handle's own tier served

    # lookup

    def keys(self, prepared: Sequence[Any]) -> CacheAnswer:
        """Keys of a call's checked items (an InvalidItemError in `prepared` is skipped); a repeat
        within the call is a copy of its first occurrence; an item in this handle's tier is served
        from it."""
        answer = CacheAnswer()
        first: dict[bytes, int] = {}
        for index, item in enumerate(prepared):
            if isinstance(item, Exception):
                continue
            key = item_key(self._identity, item.parts)
            answer.keys[index] = key
            if key in first:
                answer.copies[index] = first[key]
                continue
            first[key] = index
            local = self._local.get(key) if self._local is not None else None
            if local is not None:
                answer.local[index] = local
        self.local_hits += len(answer.local)
        return answer

    def lookup(self, prepared: Sequence[Any]) -> CacheAnswer:
        answer = self.keys(prepared)
        order = self._to_ask(answer)
        if order:
            try:
                replies = ray.get(
                    self._handle.lookup.remote([answer.keys[i] for i in order]), timeout=LOOKUP_TIMEOUT_S
                )
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as error:
                return self._skipped(answer, error)
            self._read(answer, order, replies)
        return answer

    async def lookup_async(self, prepared: Sequence[Any]) -> CacheAnswer:
        answer = self.keys(prepared)
        order = self._to_ask(answer)
        if order:
            try:
                replies = await asyncio.wait_for(
                    self._handle.lookup.remote([answer.keys[i] for i in order]), LOOKUP_TIMEOUT_S
                )
            except (ray.exceptions.RayError, asyncio.TimeoutError) as error:
                return self._skipped(answer, error)
            self._read(answer, order, replies)
        return answer

    @staticmethod
    def _to_ask(answer: CacheAnswer) -> list[int]:
        return [index for index in answer.keys if index not in answer.copies and index not in answer.local]

    @staticmethod
    def _read(answer: CacheAnswer, order: list[int], replies: list[tuple[str, list[Any]]]) -> None:
        for index, (state, refs) in zip(order, replies):
            key = answer.keys[index]
            if state == HIT:
                answer.hits[index] = (key, refs[0])
            elif state == PENDING:
                answer.waiting[index] = key
            else:
                answer.owned[index] = key

    def _skipped(self, answer: CacheAnswer, error: BaseException) -> CacheAnswer:
        """Encode everything but what this process holds, publish nothing: the cache did not answer."""
        self._failed("look up", error)
        return CacheAnswer(copies=answer.copies, local=answer.local)

    # after the call

    def served(
        self, answer: CacheAnswer, results: list[Any], want_refs: bool, timeout_s: float | None = None
    ) -> dict[int, bytes]:
        """Fill the served items' slots of `results` (Embeddings, or references with `want_refs`);
        returns {index: key} of those that fell through (lost, or never published by their
        claimant), which the caller encodes now.

        Raises:
            TimeoutError: another caller's result for a waiting item did not come within `timeout_s`.
        """
        fell_through: dict[int, bytes] = {}
        found = {index: (key, ref) for index, (key, ref) in answer.hits.items()}
        if answer.waiting:
            waited = list(answer.waiting.items())
            try:
                replies = ray.get(self._handle.wait_for.remote([key for _, key in waited]), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"items {sorted(answer.waiting)}: another caller encoding the same content did not "
                    f"finish within {timeout_s} s"
                ) from None
            except ray.exceptions.RayError as error:
                self._failed("wait for", error)
                replies = [[] for _ in waited]
            for (index, key), refs in zip(waited, replies):
                if refs:
                    found[index] = (key, refs[0])
                else:
                    fell_through[index] = key
        for index, embedding in answer.local.items():
            results[index] = ray.put(embedding) if want_refs else embedding
        if want_refs:
            for index, (_, ref) in found.items():
                results[index] = ref
        elif found:
            lost = []
            values = _fetched_each([ref for _, ref in found.values()])
            for (index, (key, _)), value in zip(found.items(), values):
                if isinstance(value, Embedding):
                    results[index] = value
                    if self._local is not None:
                        self._local.keep(key, value)
                else:
                    fell_through[index] = key
                    lost.append(key)
            if lost:
                self._handle.forget.remote(lost)
        return fell_through

    def finish(
        self,
        answer: CacheAnswer,
        results: list[Any],
        want_refs: bool,
        timeout_s: float | None,
        return_exceptions: bool,
        encode_again: Callable[[list[int]], list[Any]],
    ) -> None:
        """A call's results once its own items are in: publish what it encoded, then fill the
        slots the cache serves. Items that fell through (their entry lost, or never published by
        its claimant) are encoded now by `encode_again` (their indices; their results, in order);
        a failure among them raises unless `return_exceptions`.

        Raises:
            TimeoutError: another caller's result for a waiting item did not come within `timeout_s`.
        """
        self.publish(answer, results)  # first: another caller may wait for these while this one waits
        fell_through = sorted(self.served(answer, results, want_refs, timeout_s))
        if fell_through:
            for index, value in zip(fell_through, encode_again(fell_through)):
                if isinstance(value, BaseException) and not return_exceptions:
                    raise value
                results[index] = value
        self.copy_repeats(answer, results, want_refs)

    @contextlib.contextmanager
    def claims_given_up_on_error(self, answer: CacheAnswer) -> Iterator[None]:
        """A call that fails as a whole gives up its claims on the cache's keys (others that wait
        for them encode them themselves instead of waiting for the claims to lapse)."""
        try:
            yield
        except BaseException:
            self.abandon(answer)
            raise

    def copy_repeats(self, answer: CacheAnswer, results: list[Any], want_refs: bool) -> None:
        """Each repeat within the call gets its first occurrence's result (a copy of its own, so
        that writing into one does not change the other)."""
        for index, first in answer.copies.items():
            value = results[first]
            results[index] = _copied(value) if isinstance(value, Embedding) and not want_refs else value

    def publish(self, answer: CacheAnswer, results: Sequence[Any]) -> None:
        """Hand the owned items' results that their encoder actors did not publish to the cache
        (put in the object store from copies, on the publishing thread); give up the claims of
        those that failed. Keeps the call's new embeddings in this handle's tier."""
        entries, failed = [], []
        for index, key in answer.owned.items():
            value = results[index]
            if isinstance(value, Embedding) and self._local is not None:
                self._local.keep(key, value)
            if isinstance(value, BaseException) or value is None:
                failed.append(key)
            elif index in answer.by_actor:
                continue
            elif isinstance(value, Embedding):
                entries.append((key, _copied(value)))
            elif isinstance(value, ray.ObjectRef):
                entries.append((key, value))
            else:
                failed.append(key)
        if entries or failed:
            self._publisher.submit(self._send, entries, failed)

    def abandon(self, answer: CacheAnswer) -> None:
        """The call failed as a whole: give up its claims."""
        if answer.owned:
            self._publisher.submit(self._send, [], list(answer.owned.values()))

    def _send(self, entries: list[tuple[bytes, Any]], failed: list[bytes]) -> None:
        try:
            if entries:
                self._handle.insert.remote([_stored(key, value) for key, value in entries])
            if failed:
                self._handle.abandon.remote(failed)
        except Exception as error:  # noqa: BLE001 - Ray gone or the actor unreachable: the claims lapse on their own
            self._failed("publish to", error)

    def stats(self, timeout_s: float) -> CacheStats | None:
        try:
            stats = ray.get(self._handle.stats.remote(), timeout=timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as error:
            self._failed("read the stats of", error)
            return None
        stats.local_hits = self.local_hits
        return stats

    def close(self) -> None:
        self._publisher.shutdown(wait=True)

    def _failed(self, action: str, error: BaseException) -> None:
        self.failures += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "could not %s the embedding cache (%s); items are encoded without it until it answers "
                "(this is logged once per process)",
                action,
                error,
            )


def _fetched_each(refs: list[Any]) -> list[Any]:
    """Each reference's value, or the error fetching it raised."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayError:
        values = []
        for ref in refs:
            try:
                values.append(ray.get(ref))
            except ray.exceptions.RayError as error:
                values.append(error)
        return values


def _stored(key: bytes, value: Any) -> tuple[bytes, list[Any], int]:
    """What `insert` takes for one entry: its reference (put here for an Embedding; an
    `encode_refs` result already is one) and its bytes."""
    embedding = ray.get(value) if isinstance(value, ray.ObjectRef) else value
    ref = value if isinstance(value, ray.ObjectRef) else ray.put(embedding)
    return key, [ref], embedding.nbytes


def _copied(embedding: Embedding) -> Embedding:
    """A private host copy, made by NumPy on this thread: torch's copy of a tensor this size wakes
    its CPU thread pool, whose spinning threads took a missed call on an H100 from 5.8 to 40 ms."""
    dtype_name = wire_dtype_name(embedding.tokens.dtype)
    return Embedding.from_outputs(
        [from_array(to_array(tensor).copy(), dtype_name) for tensor in embedding.outputs]
    )
