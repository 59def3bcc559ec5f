"""The pool's embedding store: a named Ray actor that holds the published embeddings (in Ray's
object store), so that vLLM's processes on any node read them through Ray (`VitpoolECConnector`)
with no shared disk.

One store per pool, named "<pool>.embeddings" in the namespace "vitpool"; `open_store` finds it or
creates it, detached: it outlives the gateway that opened it, so that a gateway's restart leaves
vLLM's connector nothing to reconnect to. `stop_store` (or the cluster's end) ends it. The store
owns its entries' bytes (it copies what a publisher hands it into objects of its own): an entry
lives as long as the store, not as long as its publisher, so an entry vLLM was told is there stays
loadable after its gateway exits. Every side finds the store again by name when a call says it is
gone; a new store is a new `scope`, and the gateway's keys change with it (`StorePublisher.scope`).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
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
OWN_TIMEOUT_S = 10.0  # the bound of the store's read of a publisher's object (the publisher waits for it)


def store_name(pool_name: str) -> str:
    return f"{pool_name}.embeddings"


class EmbeddingStore:
    """Keyed embeddings, at most `max_bytes`, least recently used evicted first (`BoundedEntries`).

    A publisher puts each tensor into Ray's object store (as a NumPy array, read without a copy)
    and hands the store its reference; the store copies the bytes into an object it owns (the
    publisher's may end with its process) and keeps that reference. Readers fetch the objects
    straight from the object store of the store's node. `scope` names this store: a store opened
    anew (the old one stopped, or lost with its node) has another.
    """

    def __init__(self, max_bytes: int, min_age_s: float) -> None:
        self._lock = threading.Lock()
        self._entries: BoundedEntries[StoredRef] = BoundedEntries(max_bytes, min_age_s)
        self.scope = secrets.token_hex(4)

    def get_scope(self) -> str:
        return self.scope

    def put_many(self, entries: list[StoredRef]) -> list[bool]:
        """Hold each entry (replacing one of its key); False for one that cannot fit now or whose
        bytes cannot be read from its publisher."""
        owned = self._own(entries)
        accepted = []
        with self._lock:
            for entry in owned:
                held = (
                    entry is not None
                    and self._entries.put(check_key(entry.key), entry, entry.nbytes) is not None
                )
                if held:
                    self._entries.stats.published += 1
                accepted.append(held)
        return accepted

    @staticmethod
    def _own(entries: list[StoredRef]) -> list[StoredRef | None]:
        """The entries with their bytes in objects of this process: read (without a copy, the
        publisher's object store is shared memory of the node) and put once more. None for one
        that cannot be read."""
        owned: list[StoredRef | None] = []
        with shared_results():
            for entry in entries:
                try:
                    value = ray.get(entry.object[0], timeout=OWN_TIMEOUT_S)
                except Exception as error:  # noqa: BLE001 - its publisher gone meanwhile: not held
                    logger.warning(
                        "vitpool: embedding %r could not be read from its publisher (%s)",
                        entry.key,
                        type(error).__name__,
                    )
                    owned.append(None)
                    continue
                owned.append(dataclasses.replace(entry, object=[ray.put(value)]))
        return owned

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Whether each key is held (and marks it used)."""
        with self._lock:
            return self._entries.touch_many(keys)

    def get_many(self, keys: list[str], consumer_dtype: str | None = None) -> list[StoredRef | None]:
        """The entries of `keys` (None where absent), each counted as loaded by vLLM, whose
        workers run `consumer_dtype` (kept for the gateway's stats)."""
        with self._lock:
            entries = [self._entries.peek(key) for key in keys]
            self._entries.stats.loaded += sum(entry is not None for entry in entries)
            if consumer_dtype is not None:
                self._entries.stats.consumer_dtype = consumer_dtype
            return entries

    def remove(self, key: str) -> None:
        with self._lock:
            self._entries.remove(key)

    def drop(self, keys: list[str]) -> None:
        """Forget entries a reader could not load (their bytes lost with a node, or unreadable):
        counted as dropped, no longer as loaded."""
        with self._lock:
            for key in keys:
                if self._entries.remove(key):
                    self._entries.stats.dropped += 1
                    self._entries.stats.loaded -= 1

    def stats(self) -> PublisherStats:
        with self._lock:
            return self._entries.snapshot()


@dataclasses.dataclass(frozen=True)
class StoredRef:
    """One entry: its key, the object holding it (in a list, so that Ray passes the reference
    itself), what the object is and its size. An "array" is a tensor already in vLLM's layout
    (a NumPy array, as `vitpool.transport.wire` carries tensors); an "embedding" is a pool result (an
    `Embedding`), which the reader lays out for vLLM itself."""

    key: str
    object: list[Any]  # [ray.ObjectRef]
    kind: str  # "array" (with dtype) or "embedding"
    nbytes: int
    dtype: str = ""

    def value(self, fetched: Any) -> torch.Tensor | Embedding:
        return from_array(fetched, self.dtype, copy_read_only=False) if self.kind == "array" else fetched


def open_store(pool_name: str = "vitpool", max_bytes: int = 8 << 30, min_age_s: float = 30.0) -> Any:
    """The store of pool `pool_name`: the running one (whose bounds stay as they were), else a new
    one, detached: it runs until `stop_store` (or the cluster's end), whichever process opened it.
    Needs Ray initialised."""
    actor = ray.remote(EmbeddingStore).options(
        name=store_name(pool_name),
        namespace=STORE_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=16,
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
    gone (stopped) is found again by name, or opened anew, and the call made there once. What it
    publishes outlives this process: the store keeps its own copy.

    `scope` names the store published into: a gateway puts it in its keys, so that the keys change
    when the store does (vLLM keeps a stand-in under the key of an entry it was told is there and
    could not load, which only a store's loss causes).
    """

    def __init__(
        self,
        pool_name: str = "vitpool",
        max_bytes: int = 8 << 30,
        min_age_s: float = 30.0,
        timeout_s: float = 10.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.pool_name = pool_name
        self.max_bytes = max_bytes
        self.min_age_s = min_age_s
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._threads = copy_threads()
        self.scope = ""
        self._store = self._open()

    def _open(self) -> Any:
        store = open_store(self.pool_name, self.max_bytes, self.min_age_s)
        self.scope = ray.get(store.get_scope.remote(), timeout=self.start_timeout_s)
        return store

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self._store, method).remote(*args), timeout=self.timeout_s)
        except STORE_GONE_ERRORS as error:
            logger.warning(
                "vitpool: pool %r's embedding store is gone (%s); opening it again", self.pool_name, error
            )
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
            StoredRef(check_key(key), [ref], "array", array.nbytes, wire_dtype_name(tensor.dtype))
            for (key, tensor), array, ref in zip(entries, arrays, in_parallel(self._threads, ray.put, arrays))
        ]
        return self._call("put_many", stored)

    def publish_embeddings(self, entries: list[tuple[str, Embedding]]) -> list[bool]:
        """Pool results as they came back: each is put into the object store as it is (the store
        copies it into an object of its own, which outlives both the encoder actor that made it and
        this process), and vLLM's connector lays it out for its model on the rank's device."""
        refs = in_parallel(self._threads, ray.put, [embedding for _, embedding in entries])
        stored = [
            StoredRef(check_key(key), [ref], "embedding", sum(t.nbytes for t in embedding.outputs))
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

    def __init__(
        self,
        pool_name: str = "vitpool",
        address: str | None = None,
        timeout_s: float = 10.0,
        ask_timeout_s: float = 1.0,
        consumer_dtype: str | None = None,
    ) -> None:
        self.pool_name = pool_name
        self.consumer_dtype = consumer_dtype  # what vLLM's workers run, told to the store as they read
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
            self._log_once(
                f"vitpool: cannot reach the Ray cluster of pool {self.pool_name!r}'s embedding store "
                f"({error}); vLLM encodes images itself until it can (retried every {self.RETRY_S:g} s)"
            )
            return
        if store is None:
            self._log_once(
                f"vitpool: no embedding store for pool {self.pool_name!r} runs (a gateway with "
                "--publish store opens it); vLLM encodes images itself until one does"
            )
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
        self._log_once(
            f"vitpool: pool {self.pool_name!r}'s embedding store did not answer ({type(error).__name__}); "
            "finding it again, vLLM encodes images itself meanwhile"
        )
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
            return ray.get(store.get_many.remote(keys, self.consumer_dtype), timeout=self.timeout_s)
        except STORE_GONE_ERRORS as error:
            self._lost(error)
            store = self._connected(self.timeout_s)
            if store is None:
                raise
            return ray.get(store.get_many.remote(keys, self.consumer_dtype), timeout=self.timeout_s)

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
                        logger.warning(
                            "vitpool: embedding %r cannot be fetched (%s)", entry.key, type(error).__name__
                        )
        lost = [entry.key for entry in present if entry.key not in values]
        if lost and self._store is not None:
            self._store.drop.remote(lost)  # not waited for: no one is told it exists again
        return [values.get(key) for key in keys]
