"""The caller's end of the same-node channel to one actor: a connection per batch in flight, each
with its own shared-memory segments (`vitpool.transport.shared_memory`).

A batch's pixels are copied into the connection's segment; its outputs come back into an output
segment that the results view in place (held until the last result tensor is gone), or, when
none is free, after the pixels, and are copied out (`vitpool.transport.output_blocks` cuts them
into the items' tensors). The messages and the output layout are in
`vitpool.transport.channel_protocol`.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np

from vitpool.specs import BatchPlan, plan_to_wire
from vitpool.transport.channel_protocol import (
    ERROR,
    ChannelClosed,
    ChannelInfo,
    RemoteBatchError,
    item_output_offsets,
    receive_message,
    send_message,
    sleep_until_due,
    spin_until_readable,
)
from vitpool.transport.embedding import Embedding
from vitpool.transport.link import OK, BatchReceipt
from vitpool.transport.output_blocks import OutputCuts, output_block
from vitpool.transport.shared_memory import OutputSegments, OwnedSegment, aligned, array_at, segment_size
from vitpool.transport.wire import WIRE_DTYPES

logger = logging.getLogger(__name__)

# A sleeping thread is slow to wake on a GPU VM (`benchmarks/HISTORY.md`, "Fourth pass: one call's
# phases, results viewed in place, brief polling"): a caller wakes this long before its reply is
# due, then polls.
_WAKE_LEAD_S = 0.0005


@dataclass(frozen=True)
class ChannelReply:
    values: list[Embedding | None]  # per item, None where the receipt names an error (all None unless OK)
    receipt: BatchReceipt


# The reply, or the error: ChannelClosed (the connection broke), RemoteBatchError (the actor
# failed on the batch), or another exception (the batch could not be sent, e.g. pixels unlike
# their specs).
ReplyCallback = Callable[[ChannelReply | BaseException], None]


class ChannelClient:
    """The caller's side of the channel to one actor: a connection per batch in flight, opened
    when first needed. A batch goes either through `exchange` (sent and received by the calling
    thread, which waits anyway: no thread hand-off) or `submit` (never blocks; the reply, or the
    error, goes to its callback on the connection's own thread).

    Args:
        info: the actor's channel.
        reply_timeout_s: how long a reply may take before the connection counts as broken.
        spin_s: how long a wait for the reply polls before it sleeps. The wait sleeps first until
            shortly before the reply is due (as long as recent batches of its size took), so a
            batch costs at most about `spin_s` of polling; 0 never polls. A thread that sleeps
            through the reply costs a wake-up (measured where `_WAKE_LEAD_S` says).
    """

    def __init__(self, info: ChannelInfo, reply_timeout_s: float | None = None, spin_s: float = 0.0) -> None:
        self.info = info
        self.reply_timeout_s = reply_timeout_s
        self.spin_s = spin_s
        self.round_trips = RoundTrips()
        self.output_cuts = OutputCuts(info.output_layout)  # how each batch shape's output block is cut
        self._idle: list[_Connection] = []
        self._all: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def exchange(self, plan: BatchPlan, pixels: list[np.ndarray]) -> Exchange:
        """A batch for the calling thread to `send` and then `receive` itself; no I/O here.
        Raises ChannelClosed if the client is closed."""
        return Exchange(self, self._take(), plan, pixels)

    def submit(self, plan: BatchPlan, pixels: list[np.ndarray], on_reply: ReplyCallback) -> None:
        """Send a batch from a connection's thread; `on_reply` gets its reply or error there.
        Raises ChannelClosed if the client is closed (then `on_reply` is never called)."""
        self._take().run_in_thread(Exchange(self, None, plan, pixels), on_reply)

    def close(self) -> None:
        """Close the idle connections now; those carrying a batch close when it is done (closing
        them under it would turn a clean requeue into a confusing error)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._all = [connection for connection in self._all if connection not in idle]
        for connection in idle:
            connection.stop()

    def _take(self) -> _Connection:
        with self._lock:
            if self._closed:
                raise ChannelClosed("the channel is closed")
            if self._idle:
                return self._idle.pop()
            connection = _Connection(self)
            self._all.append(connection)
            return connection

    def _release(self, connection: _Connection, healthy: bool) -> None:
        """A connection is done with its batch. A broken one is dropped (and closed)."""
        with self._lock:
            if healthy and not self._closed:
                self._idle.append(connection)
                return
            if connection in self._all:
                self._all.remove(connection)
        connection.stop()


class RoundTrips:
    """Recent round trips (request sent to reply readable) per batch size, so that a caller can
    sleep until shortly before its reply is due. Sizes are grouped by quarter octaves of output
    tokens; the estimate is the shortest of the last few, the time with nothing queued ahead."""

    KEEP = 8

    def __init__(self) -> None:
        self._recent: dict[int, collections.deque] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _size_class(num_tokens: int) -> int:
        return round(4 * math.log2(max(num_tokens, 1)))

    def expected_s(self, num_tokens: int) -> float | None:
        with self._lock:
            recent = self._recent.get(self._size_class(num_tokens))
            return min(recent) if recent else None

    def record(self, num_tokens: int, seconds: float) -> None:
        with self._lock:
            size_class = self._size_class(num_tokens)
            if size_class not in self._recent:
                self._recent[size_class] = collections.deque(maxlen=self.KEEP)
            self._recent[size_class].append(seconds)


class Exchange:
    """One batch on one connection: `send`, then `receive` (which never raises: it returns the
    reply or the error, and gives the connection back)."""

    def __init__(
        self, client: ChannelClient, connection: _Connection | None, plan: BatchPlan, pixels: list[np.ndarray]
    ) -> None:
        self._client = client
        self.connection = connection
        self._plan = plan
        self._pixels = pixels
        self._outcome: ChannelReply | BaseException | None = None

    def send(self) -> None:
        try:
            self.connection.send(self._plan, self._pixels)
        except Exception as error:  # noqa: BLE001 - kept as the outcome
            self._outcome = _as_outcome(error)

    def receive(self) -> ChannelReply | BaseException:
        if self._outcome is None:
            try:
                self._outcome = self.connection.receive(self._plan)
            except Exception as error:  # noqa: BLE001 - kept as the outcome
                self._outcome = _as_outcome(error)
        self._client._release(self.connection, healthy=not isinstance(self._outcome, ChannelClosed))
        return self._outcome


def _as_outcome(error: Exception) -> BaseException:
    """A broken connection (the actor may have died) becomes ChannelClosed; other errors stay."""
    if isinstance(error, (OSError, ValueError, msgpack.UnpackException)):
        return ChannelClosed(f"channel to the encoder actor broke: {type(error).__name__}: {error}")
    return error


def _check_pixels(plan: BatchPlan, pixels: list[np.ndarray]) -> None:
    """The pixels must be what their specs say, since the actor rebuilds them from the specs.
    TypeError (the caller's mistake, not a broken channel) otherwise."""
    if not plan.specs:
        raise TypeError("a batch needs at least one item")
    if len(pixels) != len(plan.specs):
        raise TypeError(f"{len(pixels)} pixel arrays for a plan of {len(plan.specs)} items")
    for position, (spec, array) in enumerate(zip(plan.specs, pixels)):
        wire_dtype = WIRE_DTYPES[spec.pixel_dtype][1] if spec.pixel_dtype in WIRE_DTYPES else None
        if not isinstance(array, np.ndarray) or array.shape != spec.pixel_shape or array.dtype != wire_dtype:
            got = f"{type(array).__name__} {getattr(array, 'shape', '')} {getattr(array, 'dtype', '')}"
            raise TypeError(
                f"item {position}'s pixels are {got}; its spec says an array of {spec.pixel_shape} "
                f"travelling as {spec.pixel_dtype}"
            )


class _Connection:
    """One socket and one segment: one batch at a time, sent and received by the thread that
    took it, or by the connection's own thread (started on first use) for `submit`."""

    def __init__(self, client: ChannelClient) -> None:
        self._client = client
        self._jobs: queue.SimpleQueue | None = None
        self._socket: socket.socket | None = None
        self._segment: OwnedSegment | None = None  # pixels (and outputs that are copied out)
        self._outputs = OutputSegments()
        self._output_segment: OwnedSegment | None = None  # the batch in flight's, if it has one
        self._output_offsets: list[int] = []  # per item of the batch in flight, its output block
        self._closed_paths: list[str] = []  # pixel segments replaced since the actor was last told
        self._sent_at = 0.0

    def run_in_thread(self, exchange: Exchange, on_reply: ReplyCallback) -> None:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._run, name="vitpool-channel-client", daemon=True).start()
        exchange.connection = self
        self._jobs.put((exchange, on_reply))

    def stop(self) -> None:
        """Close now if no thread serves the connection; else once its queued batches are done."""
        if self._jobs is None:
            self._close()
        else:
            self._jobs.put(None)

    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                exchange, on_reply = job
                exchange.send()
                outcome = exchange.receive()
                try:
                    on_reply(outcome)
                except Exception:  # the thread must live on for the next batches
                    logger.exception("a channel reply callback failed")
        finally:
            self._close()

    def send(self, plan: BatchPlan, pixels: list[np.ndarray]) -> None:
        """Copy the pixels into the segment and send the request. The outputs go to an output
        segment that the results will view, if one is free; else after the pixels."""
        try:
            self._send(plan, pixels)
        except BaseException:
            if self._output_segment is not None:  # no reply will come to hand it out
                self._output_segment.release()
                self._output_segment = None
            raise

    def _send(self, plan: BatchPlan, pixels: list[np.ndarray]) -> None:
        _check_pixels(plan, pixels)
        layout = self._client.info.output_layout
        pixel_offsets, offset = [], 0
        for array in pixels:
            pixel_offsets.append(offset)
            offset = aligned(offset + array.nbytes)
        output_bytes = [item_output_offsets(layout, spec.num_tokens)[1] for spec in plan.specs]
        self._output_segment = self._outputs.take(sum(output_bytes))
        output_offset = 0 if self._output_segment is not None else offset
        self._output_offsets = []
        for nbytes in output_bytes:
            self._output_offsets.append(output_offset)
            output_offset += nbytes
        segment = self._segment_of(offset if self._output_segment is not None else output_offset)
        for spec, array, pixel_offset in zip(plan.specs, pixels, pixel_offsets):
            np.copyto(array_at(segment.buffer, spec.pixel_dtype, pixel_offset, spec.pixel_shape), array)
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._socket.settimeout(self._client.reply_timeout_s)
            self._socket.connect(self._client.info.address)
        message = {
            "segment": segment.path,
            "size": segment.size,
            "plan": plan_to_wire(plan),
            "pixels": pixel_offsets,
            "outputs": self._output_offsets,
        }
        if self._output_segment is not None:
            message.update(output_segment=self._output_segment.path, output_size=self._output_segment.size)
        closed = self._closed_paths + self._outputs.closed_paths
        if closed:
            message["closed"] = closed
        send_message(self._socket, message)
        self._closed_paths, self._outputs.closed_paths = [], []
        self._sent_at = time.perf_counter()

    def receive(self, plan: BatchPlan) -> ChannelReply | RemoteBatchError:
        """Wait for the reply to `send`; the results view the output segment (held until they are
        gone), or are copied out of the batch's segment.

        The results' tensors are made before the reply comes, while the actor encodes: nothing in
        them depends on the reply, and the first NumPy and torch calls of a thread that wakes from
        its wait are slow (cold caches: `benchmarks/HISTORY.md`, "What a call adds, fourth
        session"). The reply decides whether they are handed out."""
        output_segment, self._output_segment = self._output_segment, None
        handed_out = False
        early = results = values = None
        try:
            num_tokens = plan.num_tokens
            try:
                early = self._results(plan, output_segment)
            except Exception:  # noqa: BLE001 - made again once the reply is read (the connection stays in step)
                early = None
            self._await_reply(num_tokens)
            reply = receive_message(self._socket)
            if reply is None:
                raise ConnectionResetError("the actor closed the channel")
            self._client.round_trips.record(num_tokens, time.perf_counter() - self._sent_at)
            self._segment.unlink()  # the actor has mapped them
            if output_segment is not None:
                output_segment.unlink()
            if reply.get("status") == ERROR:
                return RemoteBatchError(str(reply.get("message")))
            reported = reply.get("errors")
            errors = {int(position): str(reason) for position, reason in reported} if reported else {}
            receipt = BatchReceipt(str(reply["status"]), errors, float(reply.get("busy", 0.0)))
            if receipt.status != OK:
                return ChannelReply([None] * len(plan.specs), receipt)
            results = early if early is not None else self._results(plan, output_segment)
            values, copy = results
            if copy is not None:
                np.copyto(*copy)
            handed_out = output_segment is not None
            if errors:
                values = [None if position in errors else value for position, value in enumerate(values)]
            return ChannelReply(values, receipt)
        finally:
            early = results = values = (
                None  # results not handed out are gone before the segment is free again
            )
            if output_segment is not None and not handed_out:
                output_segment.release()

    def _results(
        self, plan: BatchPlan, output_segment: OwnedSegment | None
    ) -> tuple[list[Embedding], tuple[np.ndarray, np.ndarray] | None]:
        """Every item's Embedding, viewing the batch's output block, and the copy that fills the
        block once the outputs are there (None where they view the output segment)."""
        layout = self._client.info.output_layout
        block, copy = output_block(layout, plan, self._output_offsets, output_segment, self._segment)
        return self._client.output_cuts.views(block, plan), copy

    def _await_reply(self, num_tokens: int) -> None:
        """Sleep until shortly before the reply is due, then poll for it (at most `spin_s`), so
        that the thread is awake when it comes."""
        client = self._client
        if client.spin_s > 0:
            expected_s = client.round_trips.expected_s(num_tokens)
            if expected_s is not None:
                sleep_until_due(self._socket, self._sent_at + expected_s - _WAKE_LEAD_S)
            spin_until_readable(self._socket, client.spin_s)

    def _segment_of(self, size: int) -> OwnedSegment:
        if self._segment is None or self._segment.size < size:
            if self._segment is not None:
                self._segment.close()
                self._closed_paths.append(self._segment.path)
            self._segment = None
            self._segment = OwnedSegment(segment_size(size))
        return self._segment

    def _close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._outputs.close()
