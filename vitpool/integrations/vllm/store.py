"""The pool's embedding store: a named Ray actor that knows the published embeddings (kept in Ray's
object store), so that vLLM's processes on any node read them through Ray (`VitpoolECConnector`)
with no shared disk.

One store per pool, named "<pool>.embeddings" in the namespace "vitpool"; `open_store` creates it
or finds it. It lives as long as the process that created it (the first gateway): when it is gone,
vLLM's connector answers "not here" and vLLM encodes the images itself, and the next publisher to
call opens a new (empty) one.
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
# Errors that mean the store actor is gone (its owner, a gateway, exited), not that a call was bad.
STORE_GONE_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def store_name(pool_name: str) -> str:
    return f"{pool_name}.embeddings"


class EmbeddingStore:
    """Keyed embeddings, at most `max_bytes`, least recently used evicted first (`BoundedEntries`).

    The store holds references, not bytes: a publisher puts each tensor into Ray's object store
    (as a NumPy array, read without a copy) and hands the store its reference; readers fetch the
    objects straight from the object store of their node.
    """

    def __init__(self, max_bytes: int, min_age_s: float) -> None:
        self._lock = threading.Lock()
        self._entries = BoundedEntries(max_bytes, min_age_s)
        self._refs: dict[str, StoredRef] = {}

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
        """Whether each key is published (and marks it used)."""
        with self._lock:
            return self._entries.touch_many(keys)

    def get_many(self, keys: list[str]) -> list[StoredRef | None]:
        with self._lock:
            return [self._refs.get(key) for key in keys]

    def remove(self, key: str) -> None:
        with self._lock:
            if self._entries.remove(key):
                del self._refs[key]

    def stats(self) -> PublisherStats:
        with self._lock:
            return self._entries.snapshot()


@dataclass(frozen=True)
class StoredRef:
    """One entry: its key, the object holding it (in a list, so that Ray passes the reference
    itself), what the object is, and its size. An "array" is a tensor already in vLLM's layout
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
    """The store of pool `pool_name`: this process creates it if none runs (and owns it), else
    finds the running one (whose bounds stay as they were). Needs Ray initialised."""
    actor = ray.remote(EmbeddingStore).options(
        name=store_name(pool_name), namespace=STORE_NAMESPACE, get_if_exists=True, num_cpus=0,
        max_concurrency=16,
    )
    return actor.remote(max_bytes, min_age_s)


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
    gone (its owner, another gateway, exited) is opened anew, owned by this process, and the call
    made there once.
    """

    def __init__(self, pool_name: str = "vitpool", max_bytes: int = 8 << 30, min_age_s: float = 30.0,
                 timeout_s: float = 10.0, start_timeout_s: float = 60.0) -> None:
        self.pool_name = pool_name
        self.max_bytes = max_bytes
        self.min_age_s = min_age_s
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._threads = copy_threads()
        self._store = self._open()

    def _open(self) -> Any:
        store = open_store(self.pool_name, self.max_bytes, self.min_age_s)
        ray.get(store.stats.remote(), timeout=self.start_timeout_s)
        return store

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self._store, method).remote(*args), timeout=self.timeout_s)
        except STORE_GONE_ERRORS as error:
            logger.warning("vitpool: pool %r's embedding store is gone (%s); opening a new one",
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
            StoredRef(check_key(key), [ref], "array", array.nbytes, wire_dtype_name(tensor.dtype))
            for (key, tensor), array, ref in zip(entries, arrays, in_parallel(self._threads, ray.put, arrays))
        ]
        return self._call("put_many", stored)

    def publish_embeddings(self, entries: list[tuple[str, Embedding]]) -> list[bool]:
        """Pool results as they came back: each is put into the object store once, as it is (this
        process owns it, so it outlives the encoder actor that made it), and vLLM's connector lays
        it out for its model on the rank's device."""
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
    """What vLLM's processes ask of the store (`VitpoolECConnector`): joins Ray on first use, finds
    the store again after it was gone, and answers "not here" while it is unreachable, so that vLLM
    encodes the item itself.

    `ask_timeout_s` bounds "is it here" (asked from vLLM's scheduler loop, which must not stall);
    `timeout_s` bounds fetching what the scheduler was told is there. After a failure the store is
    not asked again for `RETRY_S`: the answer is "not here" meanwhile.
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
        self._lock = threading.Lock()

    def _connected(self) -> Any | None:
        with self._lock:
            if self._store is not None or time.monotonic() < self._next_try:
                return self._store
            self._next_try = time.monotonic() + self.RETRY_S
            try:
                if not ray.is_initialized():
                    ray.init(address=self.address or "auto", namespace=STORE_NAMESPACE, log_to_driver=False)
                self._store = find_store(self.pool_name)
            except Exception as error:  # noqa: BLE001 - no cluster: vLLM encodes itself
                logger.warning("vitpool: cannot reach the Ray cluster for pool %r's store: %s", self.pool_name, error)
            if self._store is None:
                logger.warning("vitpool: no embedding store for pool %r runs; vLLM encodes images itself",
                               self.pool_name)
            return self._store

    def _lost(self, error: BaseException) -> None:
        logger.warning("vitpool: pool %r's embedding store is unreachable (%s); vLLM encodes images itself",
                       self.pool_name, error)
        with self._lock:
            self._store = None
            self._next_try = time.monotonic() + self.RETRY_S

    def contains(self, key: str) -> bool:
        store = self._connected()
        if store is None:
            return False
        try:
            return bool(ray.get(store.contains.remote(key), timeout=self.ask_timeout_s))
        except Exception as error:  # noqa: BLE001
            self._lost(error)
            return False

    def get_many(self, keys: list[str]) -> list[torch.Tensor | Embedding | None]:
        """What was published under `keys` (None where absent): a tensor in vLLM's layout or a pool
        result to lay out, read-only views of the node's shared memory; raises if the store cannot
        be reached, since vLLM was told they exist."""
        store = self._connected()
        if store is None:
            raise RuntimeError(f"vitpool: pool {self.pool_name!r}'s embedding store is gone")
        entries = ray.get(store.get_many.remote(keys), timeout=self.timeout_s)
        present = [entry for entry in entries if entry is not None]
        with shared_results():
            values = iter(ray.get([entry.object[0] for entry in present], timeout=self.timeout_s))
        return [None if entry is None else entry.value(next(values)) for entry in entries]
