"""The pool's shared embedding cache actor: keys to references in Ray's object store, with the
claims that let concurrent callers encode an item once (see `vitpool.pool.embedding_cache`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from vitpool.pool.cluster import ON_HEAD_NODE
from vitpool.pool.lru import ByteBoundedLRU
from vitpool.pool.stats import CacheStats

HIT, CLAIMED, PENDING = "hit", "claimed", "pending"
# How long others wait for a claimed key's result before one of them encodes it: longer than an
# encode under load, short enough that a caller that died with a claim costs little.
CLAIM_TIMEOUT_S = 60.0


@dataclass
class _Claim:
    deadline: float
    done: asyncio.Event = field(default_factory=asyncio.Event)


class EmbeddingCacheActor:
    """Plain class; the controller runs it as an async Ray actor. Its methods never block: a
    caller waiting for another's result waits on an event, not a thread.

    Args:
        capacity_bytes: bound on the embeddings' bytes held; least recently used go first.
        claim_timeout_s: how long a claim holds (see `vitpool.pool.embedding_cache`).
    """

    def __init__(self, capacity_bytes: int, claim_timeout_s: float = CLAIM_TIMEOUT_S) -> None:
        self._entries: ByteBoundedLRU[bytes, Any] = ByteBoundedLRU(capacity_bytes)  # key -> reference
        self._claims: dict[bytes, _Claim] = {}
        self._claim_timeout_s = claim_timeout_s
        self._stats = CacheStats(capacity_bytes=capacity_bytes)

    async def lookup(self, keys: Sequence[bytes]) -> list[tuple[str, list[Any]]]:
        """Per key: (HIT, [reference]), (CLAIMED, []) — not held, and now claimed by this caller,
        who must `insert` or `abandon` it — or (PENDING, []) — another caller encodes it
        (`wait_for`). The reference sits in a list so that Ray passes it on unresolved."""
        answers: list[tuple[str, list[Any]]] = []
        now = time.monotonic()
        for key in keys:
            ref = self._entries.get(key)
            if ref is not None:
                self._stats.hits += 1
                answers.append((HIT, [ref]))
                continue
            self._stats.misses += 1
            claim = self._claims.get(key)
            if claim is not None and claim.deadline > now:
                self._stats.waits += 1
                answers.append((PENDING, []))
                continue
            if claim is not None:  # its caller never answered: the key is this caller's now
                self._stats.lapsed_claims += 1
                claim.done.set()
            self._claims[key] = _Claim(now + self._claim_timeout_s)
            answers.append((CLAIMED, []))
        return answers

    async def wait_for(self, keys: Sequence[bytes]) -> list[list[Any]]:
        """Per key, [reference] once its claimant published it, or [] if it did not in time (or
        gave it up): the caller then encodes it itself."""
        return list(await asyncio.gather(*(self._wait_one(key) for key in keys)))

    async def _wait_one(self, key: bytes) -> list[Any]:
        claim = self._claims.get(key)
        if claim is not None:
            try:
                await asyncio.wait_for(claim.done.wait(), max(0.0, claim.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass
        ref = self._entries.peek(key)
        return [ref] if ref is not None else []

    async def insert(self, entries: Sequence[tuple[bytes, list[Any], int]]) -> None:
        """Keep each (key, [reference to its Embedding], the embedding's bytes) and release its
        claim. Evicts the least recently used entries past the bound."""
        for key, refs, nbytes in entries:
            self._release(key)
            if key in self._entries:
                continue
            if self._entries.put(key, refs[0], nbytes) is not None:  # else larger than the whole cache
                self._stats.inserts += 1

    async def abandon(self, keys: Sequence[bytes]) -> None:
        """Give up claims (their items failed): waiters encode them themselves."""
        for key in keys:
            self._release(key)

    async def forget(self, keys: Sequence[bytes]) -> None:
        """Drop entries whose objects a caller could not fetch (lost with a node)."""
        for key in keys:
            if self._entries.pop(key) is not None:
                self._stats.lost_hits += 1

    async def stats(self) -> CacheStats:
        entries = self._entries
        # no entry is protected by age here, so the bound refuses only embeddings over the whole cache
        return replace(
            self._stats,
            entries=len(entries),
            bytes=entries.bytes,
            evictions=entries.evictions,
            too_large=entries.refusals,
        )

    def _release(self, key: bytes) -> None:
        claim = self._claims.pop(key, None)
        if claim is not None:
            claim.done.set()


def start_cache_actor(capacity_bytes: int) -> Any:
    """The pool's cache actor (restarted, empty, if it dies), created by the controller so that it
    lives as long as the pool."""
    # beside the controller, on the node a cluster keeps
    return (
        ray.remote(EmbeddingCacheActor)
        .options(num_cpus=0, max_restarts=-1, **ON_HEAD_NODE)
        .remote(capacity_bytes)
    )
