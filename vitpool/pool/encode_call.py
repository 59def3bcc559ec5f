"""One encode call's way through a pool handle, the same for `EncoderPool.encode`, `encode_async`
and `encode_refs`:

    check → cache lookup → queue → wait → fetch → join → serve from the cache

They differ only in how they wait (a thread blocks; a coroutine awaits, and does what blocks on a
worker thread) and in what they return (Embeddings; or references to them in Ray's object store,
for callers that pass them on without fetching them).

Items are checked and sized once, here in the caller's process: a bad item costs no hop and harms
no one, and the specs travel with the pixels. Results that came over the same-node channel are
Embeddings already; those that came through a Ray call are references, fetched here (or, for
`encode_refs`, handed back as they are).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from vitpool.errors import InvalidItemError, PoolUnavailableError
from vitpool.items import Item
from vitpool.pool.calls import Call, PartResults, QueuedItem
from vitpool.pool.dispatcher import Dispatcher
from vitpool.pool.embedding_cache import CacheAnswer, CacheClient
from vitpool.pool.item_checks import checked_items, each_checked
from vitpool.pool.results import fetched, joined, joined_ref, lost_with_its_node, put_back, refs_among
from vitpool.pool.settings import PoolSettings
from vitpool.specs import ItemRules
from vitpool.transport.wire import to_array

logger = logging.getLogger(__name__)

# the slot of an item the cache serves, until the call's own items are in
_SERVED = object()


@dataclass(frozen=True)
class EncodePipeline:
    """What every encode call of one pool handle goes through."""

    pool_name: str
    dispatcher: Dispatcher
    rules: ItemRules
    settings: PoolSettings
    cache: CacheClient | None
    # the handle's account of a call that found no actor left (say, its pool's controller is gone)
    explained: Callable[[PoolUnavailableError], PoolUnavailableError]

    def encode(
        self,
        items: Sequence[Item],
        timeout_s: float | None,
        return_exceptions: bool = False,
        want_refs: bool = False,
    ) -> list[Any]:
        """Embeddings (or, with `want_refs`, references to them), one per item, in input order."""
        return EncodeCall(self, items, timeout_s, return_exceptions, want_refs, self.cache).run()

    async def encode_async(
        self, items: Sequence[Item], timeout_s: float | None, return_exceptions: bool
    ) -> list[Any]:
        return await EncodeCall(self, items, timeout_s, return_exceptions, False, self.cache).run_async()


class EncodeCall:
    """One call on its way through the pipeline; `run` (or `run_async`) takes it through once.

    `cache`: None for what a call encodes again (results lost with a node, items the cache was to
    serve and did not): the cache had its say. `attempts_left`: how often its items may still be
    encoded (default the pool's `max_attempts_per_item`).
    """

    def __init__(
        self,
        pipeline: EncodePipeline,
        items: Sequence[Item],
        timeout_s: float | None,
        return_exceptions: bool,
        want_refs: bool,
        cache: CacheClient | None,
        attempts_left: int | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.items = items
        self.timeout_s = timeout_s
        self.return_exceptions = return_exceptions
        self.want_refs = want_refs
        self.cache = cache
        self.attempts_left = (
            pipeline.settings.max_attempts_per_item if attempts_left is None else attempts_left
        )
        self.answer: CacheAnswer | None = None
        self.call: Call | None = None
        self.queued: list[QueuedItem] = []

    # the two ways through

    def run(self) -> list[Any]:
        outcomes = self._checked()
        self.answer = self.cache.lookup(outcomes) if self.cache is not None else None
        self._make_call(outcomes)
        with self._claims_given_up_on_error():
            if self.queued:  # else every item was refused here or served by the cache: the call is complete
                # Without a timeout this thread may carry its own batches over the same-node channel
                # (it waits for them anyway); with one it must stay free to give up, so connection
                # threads carry them.
                inline = self.timeout_s is None and not self.want_refs
                self.pipeline.dispatcher.submit(self.call, self.queued, self.timeout_s, inline)
            try:
                results = self.call.future.result(self.timeout_s)
            except concurrent.futures.TimeoutError:
                raise self._timed_out() from None
            except PoolUnavailableError as error:
                raise self.pipeline.explained(error) from None
            results = self._collected(results)
        return self._with_cached(results)

    async def run_async(self) -> list[Any]:
        """`run` without blocking the event loop: what waits on Ray or a lock goes to a worker thread."""
        outcomes = self._checked()
        self.answer = await self.cache.lookup_async(outcomes) if self.cache is not None else None
        self._make_call(outcomes)
        dispatcher = self.pipeline.dispatcher
        with self._claims_given_up_on_error():
            if self.queued:
                try:
                    dispatcher.submit(self.call, self.queued, timeout_s=0)
                except TimeoutError:  # the queue is full: wait for room off the event loop
                    await asyncio.to_thread(dispatcher.submit, self.call, self.queued, self.timeout_s)
            try:
                results = await asyncio.wait_for(
                    asyncio.shield(asyncio.wrap_future(self.call.future)), self.timeout_s
                )
            except asyncio.TimeoutError:
                raise self._timed_out() from None
            except PoolUnavailableError as error:
                raise await asyncio.to_thread(self.pipeline.explained, error) from None
            # only references need a fetch: results from the same-node channel are joined right here
            results = (
                await asyncio.to_thread(self._collected, results)
                if refs_among(results)
                else self._collected(results)
            )
        if self.answer is not None:
            results = await asyncio.to_thread(self._with_cached, results)
        return results

    # the steps

    def _checked(self) -> list[Any]:
        """Each item checked and sized. A refused item raises, or with `return_exceptions` is its
        InvalidItemError in the list."""
        settings, rules = self.pipeline.settings, self.pipeline.rules
        if self.return_exceptions:
            return each_checked(self.items, rules, settings.max_item_tokens, settings.max_queued_bytes)
        try:
            return checked_items(self.items, rules, settings.max_item_tokens, settings.max_queued_bytes)
        except InvalidItemError:
            self.pipeline.dispatcher.count_rejected(1)
            raise

    def _make_call(self, outcomes: list[Any]) -> None:
        """The call and its items to queue: a refused item fills its slot at once, as does one the
        cache serves (filled in once the call's own items are in)."""
        answer = self.answer
        served = answer.served if answer is not None else set()
        call = Call(
            len(outcomes),
            self.return_exceptions,
            [
                1 if isinstance(p, InvalidItemError) or i in served else len(p.parts)
                for i, p in enumerate(outcomes)
            ],
        )
        for index in served:
            call.complete_item(index, _SERVED)
        refused = [
            (index, error) for index, error in enumerate(outcomes) if isinstance(error, InvalidItemError)
        ]
        if refused:
            self.pipeline.dispatcher.count_rejected(len(refused))
        for index, error in refused:
            call.complete_item(index, error)
        # Arrays can take the same-node channel; references (put in the caller's thread, outside
        # the dispatcher's lock) go through Ray and give results that stay in the object store.
        keep_arrays = not self.want_refs and self.pipeline.dispatcher.has_channel
        self.call = call
        self.queued = [
            QueuedItem(
                call,
                index,
                part.spec,
                to_array(part.pixels) if keep_arrays else ray.put(to_array(part.pixels)),
                part.nbytes,
                part=number,
                cache_key=None
                if answer is None
                else answer.actor_publishes(index, len(p.parts), self.want_refs),
            )
            for index, p in enumerate(outcomes)
            if not isinstance(p, InvalidItemError) and index not in served
            for number, part in enumerate(p.parts)
        ]

    def _claims_given_up_on_error(self) -> contextlib.AbstractContextManager[None]:
        if self.cache is None or self.answer is None:
            return contextlib.nullcontext()
        return self.cache.claims_given_up_on_error(self.answer)

    def _timed_out(self) -> TimeoutError:
        error = TimeoutError(f"pool {self.pipeline.pool_name!r}: no result within {self.timeout_s} s")
        self.pipeline.dispatcher.cancel(self.call, error)
        return error

    def _collected(self, results: list[Any]) -> list[Any]:
        """The call's results as it returns them. Embeddings: references fetched and items of
        several inputs joined. References: an item of several inputs has its parts' embeddings
        fetched, joined here and put as one (a copy through this process, which references to
        single-input items do not make)."""
        if self.want_refs:
            return [
                joined_ref(index, result, self.timeout_s) if isinstance(result, PartResults) else result
                for index, result in enumerate(results)
            ]
        refs = refs_among(results)
        if refs:  # none when every batch took the same-node channel; ray.get costs even then
            self._fetch_refs(results, refs)
        return joined(results, self.return_exceptions)

    def _fetch_refs(self, results: list[Any], refs: dict[tuple[int, int | None], Any]) -> None:
        """Fetch the results that came as object references into `results`. One lost with its
        node (its actor answered, then the node went before the fetch) is encoded again, within
        the pool's attempts per item; another failure raises (`EncodeError` naming the item), or
        with `return_exceptions` fills the item's slot."""
        try:
            put_back(results, refs, ray.get(list(refs.values())))
            return
        except ray.exceptions.RayError:
            values = [fetched(where[0], ref) for where, ref in refs.items()]
        put_back(results, refs, values)
        lost = sorted({index for (index, _), value in zip(refs, values) if lost_with_its_node(value)})
        if lost and self.attempts_left > 1:
            logger.warning(
                "pool %r: the results of items %s were lost with their actor's node before they were "
                "fetched; encoding them again",
                self.pipeline.pool_name,
                lost,
            )
            self.pipeline.dispatcher.count_requeued(len(lost))
            again = EncodeCall(
                self.pipeline,
                [self.items[i] for i in lost],
                self.timeout_s,
                True,
                False,
                None,
                self.attempts_left - 1,
            ).run()
            for index, value in zip(lost, again):
                results[index] = value
        if not self.return_exceptions:
            for result in results:
                parts = result.parts if isinstance(result, PartResults) else [result]
                failure = next((part for part in parts if isinstance(part, BaseException)), None)
                if failure is not None:
                    raise failure

    def _with_cached(self, results: list[Any]) -> list[Any]:
        """`results` with the slots the cache serves filled (and what this call encoded published)."""
        if self.answer is not None:
            self.cache.finish(
                self.answer,
                results,
                self.want_refs,
                self.timeout_s,
                self.return_exceptions,
                self._encode_again,
            )
        return results

    def _encode_again(self, indices: list[int]) -> list[Any]:
        """Items the cache was to serve and did not (lost, or never published by their claimant),
        encoded now without it. Embeddings come back with each failure in its slot (the caller
        decides); references raise the first (`encode_refs` has no return_exceptions)."""
        logger.debug("pool %r: %d cached items encoded again", self.pipeline.pool_name, len(indices))
        items = [self.items[i] for i in indices]
        return EncodeCall(
            self.pipeline, items, self.timeout_s, not self.want_refs, self.want_refs, None
        ).run()
