"""Embeddings published where vLLM's encoder-cache connectors read them.

`FilePublisher` writes `<root>/<key>/encoder_cache.safetensors` holding one tensor "ec_cache", the
layout of vLLM's `ECExampleConnector` (and of `VitpoolFileConnector`, which also checks each entry's
digest). `StorePublisher` puts them in the pool's embedding store (`store.py`), where
`VitpoolECConnector` reads them with no shared disk. Both bound the bytes they keep, evicting the
least recently used entry, but never one younger than `min_age_s`: vLLM may have been told an entry
exists and not have loaded it yet. When nothing can be evicted the publish is refused (False), and
the caller lets vLLM run its own encoder for that item.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save, save_file

from vitpool.integrations.vllm.bounded import BoundedEntries, PublisherStats

logger = logging.getLogger(__name__)

FILE_NAME = "encoder_cache.safetensors"
TENSOR_NAME = "ec_cache"
DIGEST_KEY = "vitpool_xxh3_128"
STALE_PARTIAL_S = 3600.0
_KEY = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,199}")

# Copies of a request's embeddings (into files or Ray's object store) run side by side: each is a
# memcpy that releases the GIL, and one request's 8 × 448² Qwen3-VL-8B images are 51 MB.
COPY_THREADS = 8
_In = TypeVar("_In")
_Out = TypeVar("_Out")


def copy_threads() -> ThreadPoolExecutor:
    """A publisher's threads for copying (started on first use)."""
    return ThreadPoolExecutor(max_workers=COPY_THREADS, thread_name_prefix="vitpool-publish")


def in_parallel(
    threads: ThreadPoolExecutor, function: Callable[[_In], _Out], values: Sequence[_In]
) -> list[_Out]:
    """`[function(v) for v in values]`, on `threads` when there are several."""
    if len(values) < 2:
        return [function(value) for value in values]
    return list(threads.map(function, values))


def check_key(key: str) -> str:
    """A key is a directory name on every platform: letters, digits, '_', '-', '.', at most 200,
    not starting with '.'."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"embedding key {key!r} must be 1-200 of [A-Za-z0-9_.-], not starting with '.'")
    return key


def digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def payload_of(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy where it is contiguous."""
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def entry_bytes(tensor: torch.Tensor) -> bytes:
    """The safetensors file of one entry, its payload's digest in the header's metadata."""
    tensor = tensor.detach().to("cpu").contiguous()
    return save({TENSOR_NAME: tensor}, metadata={DIGEST_KEY: digest(payload_of(tensor))})


def read_entry(path: str | os.PathLike, device: str | torch.device = "cpu") -> torch.Tensor | None:
    """An entry's tensor if the file is whole and its payload matches the digest it was written
    with; None for a missing, truncated, foreign or corrupted file."""
    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as entry:
            expected = (entry.metadata() or {}).get(DIGEST_KEY)
            tensor = entry.get_tensor(TENSOR_NAME)
    except Exception:  # noqa: BLE001 - any unreadable file is simply not an entry
        return None
    if expected is None or digest(payload_of(tensor)) != expected:
        return None
    return tensor.to(device)


class FilePublisher:
    """Writes entries under `root` for vLLM's file-based connectors, at most `max_bytes` of them.

    A file appears whole or not at all: it is written beside its final name and renamed into place.
    Entries found under `root` at start are counted, oldest first by modification time, and may be
    evicted at once. Thread-safe.
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int = 8 << 30, min_age_s: float = 30.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries = BoundedEntries(max_bytes, min_age_s)
        self._threads = copy_threads()
        self._adopt_existing()

    def path(self, key: str) -> Path:
        return self.root / check_key(key) / FILE_NAME

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[str]) -> list[bool]:
        """Whether each key is published (and marks it used)."""
        with self._lock:
            return self._entries.touch_many(keys)

    def publish(self, key: str, tensor: torch.Tensor) -> bool:
        """Write `tensor` as entry `key` (replacing one of the same key). Returns False, leaving
        nothing, if it cannot fit within `max_bytes` now."""
        final = self.path(key)
        tensor = tensor.detach().to("cpu").contiguous()
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = final.parent / f".{FILE_NAME}.{os.getpid()}.{uuid.uuid4().hex}.partial"
        try:
            save_file({TENSOR_NAME: tensor}, partial, metadata={DIGEST_KEY: digest(payload_of(tensor))})
            with self._lock:
                victims = self._entries.add(key, partial.stat().st_size)
            if victims is None:
                partial.unlink()
                with contextlib.suppress(OSError):  # only if it is empty: not another entry's
                    final.parent.rmdir()
                return False
            for victim in victims:
                shutil.rmtree(self.root / victim, ignore_errors=True)
            os.replace(partial, final)
        except BaseException:
            partial.unlink(missing_ok=True)
            with self._lock:
                self._entries.remove(key)
            raise
        with self._lock:
            self._entries.stats.published += 1
        return True

    def publish_many(self, entries: list[tuple[str, torch.Tensor]]) -> list[bool]:
        return in_parallel(self._threads, lambda entry: self.publish(*entry), entries)

    def remove(self, key: str) -> None:
        with self._lock:
            self._entries.remove(key)
        shutil.rmtree(self.root / check_key(key), ignore_errors=True)

    def stats(self) -> PublisherStats:
        with self._lock:
            return self._entries.snapshot()

    def _adopt_existing(self) -> None:
        # a partial file an hour old is a writer's that died midway (another gateway may share root)
        for partial in self.root.glob(f"*/.{FILE_NAME}.*.partial"):
            with contextlib.suppress(OSError):
                if time.time() - partial.stat().st_mtime > STALE_PARTIAL_S:
                    partial.unlink()
                    partial.parent.rmdir()  # only if it is empty: not another entry's
        found = []
        for file in self.root.glob(f"*/{FILE_NAME}"):
            try:
                check_key(file.parent.name)
                found.append((file.stat().st_mtime, file.parent.name, file.stat().st_size))
            except (OSError, ValueError):
                continue
        old = time.monotonic() - self._entries.min_age_s
        evicted = []
        with self._lock:
            for _, key, size in sorted(found):
                victims = self._entries.add(key, size, added_at=old)
                evicted += [key] if victims is None else victims
        for key in evicted:
            shutil.rmtree(self.root / key, ignore_errors=True)
        if found:
            logger.info(
                "publisher at %s adopted %d entries (%d bytes), evicted %d over its bound",
                self.root,
                len(found) - len(evicted),
                self._entries.stats.bytes,
                len(evicted),
            )
