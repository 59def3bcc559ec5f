"""The pool's embedding store: a named Ray actor that knows the published embeddings (kept in Ray's
object store), so that vLLM's processes on any node read them through Ray (`VitpoolECConnector`)
with no shared disk.

One store per pool, named "<pool>.embeddings" in the namespace "vitpool"; `open_store` finds it or
creates it, detached: it outlives the gateway that opened it, so that a gateway's restart leaves
vLLM's connector nothing to reconnect to. `stop_store` (or the cluster's end) ends it. Its bytes
stay owned by the process that published them: an entry whose publisher exited is dropped (the
store checks its publishers' jobs, and readers report what they could not fetch), and vLLM encodes
that image itself. Every side finds the store again by name when a call says it is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from vitpool.integrations.vllm.bounded import BoundedEntries, PublisherStats
from vitpool.integrations.vllm.publisher import check_key, copy_threads, in_parallel
from vitpool.items import Embedding, shared_results
from vitpool.transport.wire import from_array, to_array, wire_dtype_name

logger = logging.getLogger(__name__)

# Fixed, so that publishers and vLLM's processes (other Ray jobs) find a store by its pool's name.
# The pool's own actors live in a namespace of the same name; the store does not depend on that.
STORE_NAMESPACE = "vitpool"
# Errors that mean the store actor is gone (stopped, or its node lost), not that a call was bad.
STORE_GONE_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
# Errors that mean an entry's bytes are gone: its publisher (their owner) exited.
ENTRY_LOST_ERRORS = (ray.exceptions.ObjectLostError, ray.exceptions.ObjectFetchTimedOutError)
OWNER_CHECK_S = 1.0  # how often the store asks the cluster which publishers' jobs ended


def store_name(pool_name: str) -> str:
    return f"{pool_name}.embeddings"


class EmbeddingStore:
    """Keyed embeddings, at most `max_bytes`, least recently used evicted first (`BoundedEntries`).

    The store holds references, not bytes: a publisher puts each tensor into Ray's object store
    (as a NumPy array, read without a copy) and hands the store its reference; readers fetch the
    objects straight from the object store of their node. The publisher's process owns the bytes:
    entries of a publisher whose job ended are dropped before any answer (checked every
    `OWNER_CHECK_S`).
    """

    def __init__(self, max_bytes: int, min_age_s: float) -> None:
        self._lock = threading.Lock()
        self._entries = BoundedEntries(max_bytes, min_age_s)
        self._refs: dict[str, StoredRef] = {}
        self._next_owner_check = 0.0

    def put_many(self, entries: list[StoredRef]) -> list[bool]:
        """Hold each entry (replacing one of its key); False for one that cannot fit now."""
        accepted = []
        with self._lock:
            for entry in entries:
                victims = self._entries.add(check_key(entry.key), entry.nbytes)
                if victims is None:
                    accepted.append(False)
                    continue
                for victim in victims:
                    del self._refs[victim]
                self._refs[entry.key] = entry
                self._entries.stats.published += 1
                accepted.append(True)
        return accepted

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Whether each key is published by a publisher still running (and marks it used)."""
        self._drop_orphans()
        with self._lock:
            return self._entries.touch_many(keys)

    def get_many(self, keys: list[str]) -> list[StoredRef | None]:
        """The entries of `keys` (None where absent), each counted as loaded by vLLM."""
        with self._lock:
            entries = [self._refs.get(key) for key in keys]
            self._entries.stats.loaded += sum(entry is not None for entry in entries)
            return entries

    def remove(self, key: str) -> None:
        with self._lock:
            if self._entries.remove(key):
                del self._refs[key]

    def drop(self, keys: list[str]) -> None:
        """Forget entries whose bytes a reader could not fetch (their publisher exited): counted as
        dropped, no longer as loaded."""
        with self._lock:
            for key in keys:
                if self._entries.remove(key):
                    del self._refs[key]
                    self._entries.stats.dropped += 1
                    self._entries.stats.loaded -= 1

    def stats(self) -> PublisherStats:
        with self._lock:
            return self._entries.snapshot()

    def _drop_orphans(self) -> None:
        """Drop the entries of publishers whose job ended (their bytes went with them)."""
        now = time.monotonic()
        with self._lock:
            if now < self._next_owner_check or not self._refs:
                return
            self._next_owner_check = now + OWNER_CHECK_S
            owners = {entry.owner for entry in self._refs.values()}
        ended = owners & ended_jobs()
        if not ended:
            return
        with self._lock:
            orphans = [key for key, entry in self._refs.items() if entry.owner in ended]
            for key in orphans:
                self._entries.remove(key)
                del self._refs[key]
            self._entries.stats.dropped += len(orphans)
        logger.warning("vitpool: dropped %d embeddings whose publishers exited (jobs %s)", len(orphans),
                       ", ".join(sorted(ended)))


def ended_jobs() -> set[str]:
    """The hex ids of the cluster's jobs that ended (none where Ray's job table cannot be read)."""
    try:
        from ray._private import state

        return {job["JobID"] for job in state.state.job_table() if job["IsDead"]}
    except Exception as error:  # noqa: BLE001 - Ray's table moved: readers still report lost entries
        logger.debug("could not read Ray's job table: %s", error)
        return set()


@dataclass(frozen=True)
class StoredRef:
    """One entry: its key, the object holding it (in a list, so that Ray passes the reference
    itself), what the object is, its size and the publisher's job. An "array" is a tensor already in vLLM's layout
    (a NumPy array, as `vitpool.transport.wire` carries tensors); an "embedding" is a pool result (an
    `Embedding`), which the reader lays out for vLLM itself."""

    key: str
    object: list[Any]  # [ray.ObjectRef]
    kind: str  # "array" (with dtype) or "embedding"
    nbytes: int
    dtype: str = ""
    owner: str = ""  # the publisher's Ray job (hex): the bytes end with it

    def value(self, fetched: Any) -> torch.Tensor | Embedding:
        return from_array(fetched, self.dtype, copy_read_only=False) if self.kind == "array" else fetched


def open_store(pool_name: str = "vitpool", max_bytes: int = 8 << 30, min_age_s: float = 30.0) -> Any:
    """The store of pool `pool_name`: the running one (whose bounds stay as they were), else a new
    one, detached: it runs until `stop_store` (or the cluster's end), whichever process opened it.
    Needs Ray initialised."""
    actor = ray.remote(EmbeddingStore).options(
        name=store_name(pool_name), namespace=STORE_NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_concurrency=16,
    )
    return actor.remote(max_bytes, min_age_s)


def stop_store(pool_name: str = "vitpool") -> bool:
    """End pool `pool_name`'s store and the entries it holds (vLLM's connectors answer "not here"
    until a publisher opens a new one). Returns whether one ran. Needs Ray initialised."""
    store = find_store(pool_name)
    if store is None:
        return False
    ray.kill(store)
    return True


def find_store(pool_name: str = "vitpool") -> Any | None:
    """The running store of pool `pool_name`, or None."""
    try:
        return ray.get_actor(store_name(pool_name), namespace=STORE_NAMESPACE)
    except ValueError:
        return None


class StorePublisher:
    """Publishes into the pool's embedding store; the same calls as `FilePublisher`.

    Opening waits until the store answers (at most `start_timeout_s`: a new actor is a new worker
    process); then each call waits at most `timeout_s` (GetTimeoutError past it). A store that is
    gone (stopped) is found again by name, or opened anew, and the call made there once. What this
    process publishes ends with its job: the bytes are its own.
    """

    # What it publishes ends with this process (`Gateway` then keys its entries per process).
    entries_outlive_publisher = False

    def __init__(self, pool_name: str = "vitpool", max_bytes: int = 8 << 30, min_age_s: float = 30.0,
                 timeout_s: float = 10.0, start_timeout_s: float = 60.0) -> None:
        self.pool_name = pool_name
        self.max_bytes = max_bytes
        self.min_age_s = min_age_s
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._threads = copy_threads()
        self._store = self._open()
        self._owner = ray.get_runtime_context().get_job_id()

    def _open(self) -> Any:
        store = open_store(self.pool_name, self.max_bytes, self.min_age_s)
        ray.get(store.stats.remote(), timeout=self.start_timeout_s)
        return store

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self._store, method).remote(*args), timeout=self.timeout_s)
        except STORE_GONE_ERRORS as error:
            logger.warning("vitpool: pool %r's embedding store is gone (%s); opening it again",
                           self.pool_name, error)
            self._store = self._open()
            return ray.get(getattr(self._store, method).remote(*args), timeout=self.timeout_s)

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Whether each key is published, in one call to the store."""
        return self._call("contains_many", keys) if keys else []

    def publish(self, key: str, tensor: torch.Tensor) -> bool:
        return self.publish_many([(key, tensor)])[0]

    def publish_many(self, entries: list[tuple[str, torch.Tensor]]) -> list[bool]:
        """Tensors already in vLLM's layout; each is put into the object store once, and the store
        is called once for all of them."""
        arrays = [to_array(tensor.contiguous()) for _, tensor in entries]
        stored = [
            StoredRef(check_key(key), [ref], "array", array.nbytes, wire_dtype_name(tensor.dtype), self._owner)
            for (key, tensor), array, ref in zip(entries, arrays, in_parallel(self._threads, ray.put, arrays))
        ]
        return self._call("put_many", stored)

    def publish_embeddings(self, entries: list[tuple[str, Embedding]]) -> list[bool]:
        """Pool results as they came back: each is put into the object store once, as it is (this
        process owns it, so it outlives the encoder actor that made it), and vLLM's connector lays
        it out for its model on the rank's device."""
        refs = in_parallel(self._threads, ray.put, [embedding for _, embedding in entries])
        stored = [
            StoredRef(check_key(key), [ref], "embedding", sum(t.nbytes for t in embedding.outputs),
                      owner=self._owner)
            for (key, embedding), ref in zip(entries, refs)
        ]
        return self._call("put_many", stored)

    def remove(self, key: str) -> None:
        self._call("remove", key)

    def stats(self) -> PublisherStats:
        return self._call("stats")


class StoreReader:
    """What vLLM's processes ask of the store (`VitpoolECConnector`). Joining Ray and finding the
    store run on a thread of their own (`connect_in_background`), never on the caller's: vLLM's
    engine loop must not wait out Ray's connect retries. Until the store is found, and for
    `RETRY_S` after a failed try, "is it here" answers None (unreachable: vLLM encodes itself);
    a failure is logged once per cause.

    `ask_timeout_s` bounds "is it here" (asked from vLLM's scheduler loop, which must not stall);
    `timeout_s` bounds fetching what the scheduler was told is there.
    """

    RETRY_S = 5.0

    def __init__(self, pool_name: str = "vitpool", address: str | None = None, timeout_s: float = 10.0,
                 ask_timeout_s: float = 1.0) -> None:
        self.pool_name = pool_name
        self.address = address
        self.timeout_s = timeout_s
        self.ask_timeout_s = ask_timeout_s
        self._store: Any = None
        self._next_try = 0.0
        self._attempt: threading.Thread | None = None
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def connect_in_background(self) -> None:
        """Start joining Ray and finding the store now, on a thread of its own."""
        self._start_attempt()

    def _start_attempt(self) -> threading.Thread | None:
        """The running try to find the store, a new one if none runs and `RETRY_S` passed, else None."""
        with self._lock:
            if self._store is not None:
                return None
            if self._attempt is not None and self._attempt.is_alive():
                return self._attempt
            if time.monotonic() < self._next_try:
                return None
            self._next_try = time.monotonic() + self.RETRY_S
            self._attempt = threading.Thread(target=self._find, name="vitpool-store-connect", daemon=True)
            self._attempt.start()
            return self._attempt

    def _find(self) -> None:
        try:
            if not ray.is_initialized():
                from vitpool.pool.cluster import join_ray

                join_ray(self.address or "auto")  # in the cluster's authentication mode, or says what to set
            store = find_store(self.pool_name)
        except Exception as error:  # noqa: BLE001 - no cluster: vLLM encodes itself meanwhile
            self._log_once(f"vitpool: cannot reach the Ray cluster of pool {self.pool_name!r}'s embedding store "
                           f"({error}); vLLM encodes images itself until it can (retried every {self.RETRY_S:g} s)")
            return
        if store is None:
            self._log_once(f"vitpool: no embedding store for pool {self.pool_name!r} runs (a gateway with "
                           "--publish store opens it); vLLM encodes images itself until one does")
            return
        with self._lock:
            self._store = store
            self._logged.clear()
        logger.info("vitpool: found pool %r's embedding store", self.pool_name)

    def _log_once(self, message: str) -> None:
        with self._lock:
            first = message not in self._logged
            self._logged.add(message)
        logger.log(logging.WARNING if first else logging.DEBUG, "%s", message)

    def _connected(self, wait_s: float) -> Any | None:
        """The store if found; else starts a try and waits up to `wait_s` for it, but only where
        Ray is already joined (finding an actor by name takes milliseconds; joining can take 20 s)."""
        store = self._store
        if store is not None:
            return store
        attempt = self._start_attempt()
        if attempt is not None and wait_s > 0 and ray.is_initialized():
            attempt.join(wait_s)
        return self._store

    def _lost(self, error: BaseException) -> None:
        self._log_once(f"vitpool: pool {self.pool_name!r}'s embedding store did not answer ({type(error).__name__}); "
                       "finding it again, vLLM encodes images itself meanwhile")
        with self._lock:
            self._store = None
            if isinstance(error, STORE_GONE_ERRORS):
                self._next_try = 0.0  # gone, not slow: look it up by name at once

    def contains(self, key: str) -> bool | None:
        """Whether `key` is published; None where the store cannot be asked now (not found yet,
        or no answer in `ask_timeout_s`)."""
        store = self._connected(self.ask_timeout_s)
        if store is None:
            return None
        try:
            return bool(ray.get(store.contains.remote(key), timeout=self.ask_timeout_s))
        except Exception as error:  # noqa: BLE001 - slow or gone: not here, vLLM encodes itself
            self._lost(error)
            return None

    def _entries(self, keys: list[str]) -> list[StoredRef | None]:
        """The store's entries of `keys`; a store that is gone is found again by name and asked once more."""
        store = self._connected(self.timeout_s)
        if store is None:
            raise ConnectionError(f"pool {self.pool_name!r}'s embedding store cannot be reached")
        try:
            return ray.get(store.get_many.remote(keys), timeout=self.timeout_s)
        except STORE_GONE_ERRORS as error:
            self._lost(error)
            store = self._connected(self.timeout_s)
            if store is None:
                raise
            return ray.get(store.get_many.remote(keys), timeout=self.timeout_s)

    def get_many(self, keys: list[str]) -> list[torch.Tensor | Embedding | None]:
        """What was published under `keys`: a tensor in vLLM's layout or a pool result to lay out,
        read-only views of the node's shared memory; None for each that cannot be had (absent, its
        bytes gone with its publisher, the store unreachable). Never raises: the caller decides."""
        try:
            entries = self._entries(keys)
        except Exception as error:  # noqa: BLE001 - none of them can be had
            self._lost(error)
            return [None] * len(keys)
        present = [entry for entry in entries if entry is not None]
        values: dict[str, Any] = {}
        with shared_results():
            try:
                fetched = ray.get([entry.object[0] for entry in present], timeout=self.timeout_s)
                values = {entry.key: entry.value(value) for entry, value in zip(present, fetched)}
            except Exception:  # noqa: BLE001 - one lost: find which, one by one
                for entry in present:
                    try:
                        values[entry.key] = entry.value(ray.get(entry.object[0], timeout=self.timeout_s))
                    except Exception as error:  # noqa: BLE001 - lost, late or bad: not loaded
                        logger.warning("vitpool: embedding %r cannot be fetched (%s)", entry.key, type(error).__name__)
        lost = [entry.key for entry in present if entry.key not in values]
        if lost and self._store is not None:
            self._store.drop.remote(lost)  # not waited for: no one is told it exists again
        return [values.get(key) for key in keys]
