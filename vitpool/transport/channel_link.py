"""The same-node channel to an encoder actor, as an `ActorLink`, with the Ray call behind it.

Batches whose pixels are arrays go through the actor's channel (`vitpool.transport.channel`);
batches whose pixels are already object references go through Ray. When the channel breaks
(`ChannelClosed`: the connection dropped or timed out), the link closes it, warns once, and sends
that batch and every later one through Ray instead. That is not a failure of the batch: the actor
may be alive (a dropped socket, a full segment directory), and if it is not, the Ray call tells
a dead actor apart (`ActorGone`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from vitpool.specs import BatchPlan
from vitpool.transport.channel_client import ChannelClient, ChannelReply, Exchange
from vitpool.transport.channel_protocol import ChannelClosed, RemoteBatchError
from vitpool.transport.link import OK, RETIRED, BatchFailed, Done, Outcome, OutcomeCallback, Refused
from vitpool.transport.ray_link import RayLink

logger = logging.getLogger(__name__)


class ChannelLink:
    """Batches to one actor on this node: through its channel while that works, else by Ray.

    Outcomes: `Done` with an `Embedding` per item (None for a failed item), `Refused` when the
    actor is retiring, `BatchFailed(RemoteBatchError)` when it failed on the batch; a batch that
    fell back to Ray has the Ray link's outcomes (its values are references).

    Args:
        channel: the caller's end of the actor's channel; the link owns it from now on.
        ray_link: the same actor through Ray, for references and after the channel broke.
        name: the actor in messages, e.g. "encoder actor 3".
    """

    def __init__(self, channel: ChannelClient, ray_link: RayLink, name: str = "the encoder actor") -> None:
        self._channel: ChannelClient | None = channel  # None once broken or closed
        self._ray = ray_link
        self._name = name
        self._lock = threading.Lock()

    @property
    def is_local(self) -> bool:
        return self._channel is not None

    def send(self, plan: BatchPlan, pixels: list[Any], on_outcome: OutcomeCallback) -> None:
        """Send through the channel (the outcome comes from the connection's thread) or through
        Ray (see `RayLink.send`: the outcome may come inside this call). Never raises."""
        channel = self._channel_for(pixels)
        if channel is None:
            self._ray.send(plan, pixels, on_outcome)
            return
        try:
            channel.submit(plan, pixels, lambda reply: self._on_reply(plan, pixels, on_outcome, reply))
        except ChannelClosed as error:  # closed since we looked
            self._fall_back(error)
            self._ray.send(plan, pixels, on_outcome)

    def exchange(
        self, plan: BatchPlan, pixels: list[Any], on_outcome: OutcomeCallback
    ) -> _ChannelExchange | None:
        """The batch for the calling thread to carry over the channel (no I/O here); None when
        the channel is down or the pixels are references (use `send`)."""
        channel = self._channel_for(pixels)
        if channel is None:
            return None
        try:
            exchange = channel.exchange(plan, pixels)
        except ChannelClosed:
            return None
        return _ChannelExchange(self, exchange, plan, pixels, on_outcome)

    def close(self) -> None:
        """Idle connections close now, busy ones when their batch is done; later batches go by Ray."""
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        self._ray.close()

    def _channel_for(self, pixels: list[Any]) -> ChannelClient | None:
        channel = self._channel
        if channel is None or not all(isinstance(array, np.ndarray) for array in pixels):
            return None
        return channel

    def _on_reply(
        self,
        plan: BatchPlan,
        pixels: list[Any],
        on_outcome: OutcomeCallback,
        reply: ChannelReply | BaseException,
    ) -> None:
        if isinstance(reply, ChannelClosed):
            self._fall_back(reply)
            self._ray.send(plan, pixels, on_outcome)
            return
        on_outcome(self._outcome_of(reply))

    def _fall_back(self, error: ChannelClosed) -> None:
        """Stop using the channel; the first batch to find it broken says so."""
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            logger.warning("%s (%s); its batches go through Ray from now on", error, self._name)
            channel.close()

    def _outcome_of(self, reply: ChannelReply | BaseException) -> Outcome:
        if not isinstance(reply, ChannelReply):
            return BatchFailed(reply)  # RemoteBatchError, or the batch could not be sent
        status = reply.receipt.status
        if status == OK:
            return Done(reply.values, reply.receipt, through_channel=True)
        if status == RETIRED:
            return Refused(f"{self._name} is leaving the pool")
        return BatchFailed(RemoteBatchError(f"{self._name} answered a batch with status {status!r}"))


class _ChannelExchange:
    """One batch the calling thread carries over the channel (`InlineExchange`): `send`, then
    `finish`, which waits for the reply and calls the outcome callback in this thread. If the
    channel broke, `finish` sends the batch through Ray instead; its outcome then comes as
    `RayLink.send` gives it. Neither raises."""

    def __init__(
        self,
        link: ChannelLink,
        exchange: Exchange,
        plan: BatchPlan,
        pixels: list[Any],
        on_outcome: OutcomeCallback,
    ) -> None:
        self._link = link
        self._exchange = exchange
        self._plan = plan
        self._pixels = pixels
        self._on_outcome = on_outcome

    def send(self) -> None:
        self._exchange.send()

    def finish(self) -> None:
        self._link._on_reply(self._plan, self._pixels, self._on_outcome, self._exchange.receive())
