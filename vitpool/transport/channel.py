"""The same-node channel: a batch's pixels and embeddings go between a caller's process and an
encoder actor on the same node through a shared-memory segment, with small msgpack messages
over a Unix socket.

Why it exists: on the GPU host one Ray actor call costs about 1 ms, and carrying a batch's pixels
and embeddings through the object store 3-4 ms: more than the encode of a small image. Here a
batch costs one copy in and two small socket messages; the results view the memory the actor
wrote them into.

A connection carries one batch at a time. The caller owns its segments (`vitpool.actors.segments`):
it writes the pixels into one, sends a request saying where each item's pixels are and where its
outputs go (an output segment, or after the pixels); the actor encodes, writes the outputs there
and answers with the batch's receipt. A caller opens as many connections to an actor as it keeps
batches in flight there. Both sides poll briefly around the moment a message is due, since a
sleeping thread pays for its wake-up.

Nothing is unpickled: messages are msgpack of plain values. The actor maps only files in the
shared-memory directory whose names carry the channel's prefix, and serves only its own user.
"""

from __future__ import annotations

import collections
import logging
import math
import mmap
import os
import queue
import select
import socket
import struct
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from vitpool.actors.reports import OK, BatchReceipt
from vitpool.actors.segments import (
    MappedSegments,
    OutputSegments,
    OwnedSegment,
    aligned,
    array_at,
    segment_size,
    shm_directory,
)
from vitpool.items import Embedding, ItemMetadata
from vitpool.transport.wire import WIRE_DTYPES, to_array, wire_dtype_name

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20
_LENGTH = struct.Struct("<I")
# A sleeping thread takes 0.2-0.4 ms to wake on a GPU VM: a caller wakes this long before its
# reply is due, then polls.
_WAKE_LEAD_S = 0.0005
ERROR = "error"  # a reply status besides the receipt's: the actor failed on the batch itself

# One batch as the actor's encoder takes it: per item its metadata and its pixels, and where the
# outputs should be (None: on the encoder's device).
BatchFunction = Callable[
    [list[ItemMetadata], list[np.ndarray], str | None], tuple[list[Embedding | None], BatchReceipt]
]


class ChannelClosed(ConnectionError):
    """The connection broke (the actor may have died); the batch was not answered."""


class RemoteBatchError(RuntimeError):
    """The actor failed on the batch as a whole (not on one bad item)."""


@dataclass(frozen=True)
class ChannelInfo:
    """How to reach an actor's channel, and the shape of what it returns."""

    address: str  # an abstract Unix socket name
    output_width: int
    num_deepstack: int
    output_dtype: str  # a vitpool.transport.wire dtype name

    def output_bytes(self, num_tokens: int) -> int:
        """Room for one item's outputs: tokens and deepstack maps, each aligned."""
        itemsize = WIRE_DTYPES[self.output_dtype][1].itemsize
        return (1 + self.num_deepstack) * aligned(num_tokens * self.output_width * itemsize)


def channel_supported() -> bool:
    """Abstract Unix sockets and /dev/shm: Linux only. Elsewhere batches go through Ray."""
    return sys.platform == "linux" and os.path.isdir(shm_directory())


# framing: a little-endian length, then msgpack


def _send_message(connection: socket.socket, message: dict) -> None:
    payload = msgpack.packb(message, use_bin_type=True)
    connection.sendall(_LENGTH.pack(len(payload)) + payload)


def _receive_exactly(connection: socket.socket, size: int) -> bytes | None:
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = connection.recv_into(view[received:])
        if count == 0:
            return None
        received += count
    return bytes(buffer)


def _receive_message(connection: socket.socket) -> dict | None:
    """The next message, or None when the peer closed the connection."""
    header = _receive_exactly(connection, _LENGTH.size)
    if header is None:
        return None
    (length,) = _LENGTH.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise ValueError(f"channel message of {length} bytes is over the {MAX_MESSAGE_BYTES} limit")
    payload = _receive_exactly(connection, length)
    if payload is None:
        return None
    message = msgpack.unpackb(payload, raw=False)
    if not isinstance(message, dict):
        raise ValueError("channel message is not a map")
    return message


def _sleep_until_due(connection: socket.socket, due_at: float) -> None:
    """Sleep until `due_at` (a perf_counter time) or until `connection` is readable."""
    remaining = due_at - time.perf_counter()
    if remaining > 0:
        select.select([connection], [], [], remaining)


def _spin_until_readable(connection: socket.socket, spin_s: float) -> None:
    """Poll `connection` for up to `spin_s` before the caller blocks on it: a thread that stays
    awake sees the message at once, where a sleeping one pays for its wake-up."""
    deadline = time.perf_counter() + spin_s
    while time.perf_counter() < deadline:
        readable, _, _ = select.select([connection], [], [], 0)
        if readable:
            return
        os.sched_yield()


# the actor's side


class ChannelServer:
    """Serves batches to same-node callers from the actor's process, one thread per connection."""

    def __init__(
        self, run_batch: BatchFunction, name: str = "", device: torch.device | None = None, spin_s: float = 0.0
    ) -> None:
        self._run_batch = run_batch
        self._spin_s = spin_s  # after each reply, poll this long for the next request before sleeping
        # On a GPU the segments are registered with CUDA: pixels go to the device and outputs
        # come back by DMA, with no staging copy.
        self._cuda_device = device if device is not None and device.type == "cuda" else None
        self.address = f"\0vitpool-{name}-{uuid.uuid4().hex}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(64)
        self._thread = threading.Thread(target=self._accept_loop, name="vitpool-channel-accept", daemon=True)
        self._thread.start()

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            if not _same_user(connection):
                connection.close()
                continue
            threading.Thread(target=self._serve, args=(connection,), name="vitpool-channel", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        segments = MappedSegments(self._cuda_device)
        try:
            with connection:
                while True:
                    _spin_until_readable(connection, self._spin_s)
                    request = _receive_message(connection)
                    if request is None:
                        break
                    segments.forget(request.get("closed"))
                    pixel_segment = segments.get(request.get("segment"), request.get("size"))
                    output_path = request.get("output_segment")
                    output_segment = (
                        pixel_segment if output_path is None else segments.get(output_path, request.get("output_size"))
                    )
                    _send_message(connection, self._handle(pixel_segment.buffer, output_segment.buffer, request))
        except (OSError, ValueError, msgpack.UnpackException) as error:
            logger.warning("channel connection dropped: %s", error)
        finally:
            segments.close()

    def _handle(self, pixel_buffer: mmap.mmap, output_buffer: mmap.mmap, request: dict) -> dict:
        try:
            metadata, pixels = [], []
            for is_video, grid, dtype_name, offset, shape in request["items"]:
                metadata.append((bool(is_video), tuple(grid), dtype_name))
                pixels.append(array_at(pixel_buffer, dtype_name, offset, shape))
            output_offsets = request["outputs"]
            if len(output_offsets) != len(metadata):
                raise ValueError("one output offset per item is needed")
            values, receipt = self._run_batch(metadata, pixels, None if self._cuda_device else "cpu")
            del pixels  # views of the segment: it can be unmapped once they are gone
            for value, offset in zip(values, output_offsets):
                if value is not None:
                    for tensor in (value.tokens, *value.deepstack):
                        target = array_at(output_buffer, wire_dtype_name(tensor.dtype), offset, tuple(tensor.shape))
                        _write(target, tensor)
                        offset = aligned(offset + target.nbytes)
            if self._cuda_device is not None:
                torch.cuda.current_stream(self._cuda_device).synchronize()
            return {
                "status": receipt.status,
                "errors": [[position, reason] for position, reason in receipt.item_errors.items()],
                "busy": receipt.busy_seconds,
            }
        except Exception as error:  # the caller gets the error as the batch's outcome
            logger.exception("channel batch failed")
            return {"status": ERROR, "message": f"{type(error).__name__}: {error}"}


def _write(target: np.ndarray, tensor: torch.Tensor) -> None:
    """Copy `tensor` into the segment: by DMA from a GPU (complete once the stream is
    synchronised), else with NumPy (one thread: torch's copy would wake its CPU thread pool)."""
    if tensor.device.type == "cuda":
        torch.from_numpy(target).view(tensor.dtype).copy_(tensor, non_blocking=True)
    else:
        np.copyto(target, to_array(tensor))


def _same_user(connection: socket.socket) -> bool:
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", credentials)
    return uid == os.getuid()


# the caller's side


@dataclass(frozen=True)
class ChannelReply:
    values: list[Embedding | None]  # per item, None where the receipt names an error
    receipt: BatchReceipt


ChannelItem = tuple[ItemMetadata, np.ndarray, int]  # metadata, pixels, output tokens
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
            through the reply costs a wake-up (0.2-0.4 ms on a VM).
    """

    def __init__(self, info: ChannelInfo, reply_timeout_s: float | None = None, spin_s: float = 0.0) -> None:
        self.info = info
        self.reply_timeout_s = reply_timeout_s
        self.spin_s = spin_s
        self.round_trips = RoundTrips()
        self._idle: list[_Connection] = []
        self._all: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def exchange(self, items: list[ChannelItem]) -> Exchange:
        """A batch for the calling thread to `send` and then `receive` itself; no I/O here."""
        return Exchange(self, self._take(), items)

    def submit(self, items: list[ChannelItem], on_reply: ReplyCallback) -> None:
        self._take().run_in_thread(Exchange(self, None, items), on_reply)

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

    def __init__(self, client: ChannelClient, connection: _Connection | None, items: list[ChannelItem]) -> None:
        self._client = client
        self.connection = connection
        self._items = items
        self._outcome: ChannelReply | BaseException | None = None

    def send(self) -> None:
        try:
            self.connection.send(self._items)
        except Exception as error:  # noqa: BLE001 - kept as the outcome
            self._outcome = _as_outcome(error)

    def receive(self) -> ChannelReply | BaseException:
        if self._outcome is None:
            try:
                self._outcome = self.connection.receive(self._items)
            except Exception as error:  # noqa: BLE001 - kept as the outcome
                self._outcome = _as_outcome(error)
        self._client._release(self.connection, healthy=not isinstance(self._outcome, ChannelClosed))
        return self._outcome


def _as_outcome(error: Exception) -> BaseException:
    """A broken connection (the actor may have died) becomes ChannelClosed; other errors stay."""
    if isinstance(error, (OSError, ValueError, msgpack.UnpackException)):
        return ChannelClosed(f"channel to the encoder actor broke: {type(error).__name__}: {error}")
    return error


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
        self._output_offsets: list[int] = []
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
                on_reply(exchange.receive())
        finally:
            self._close()

    def send(self, items: list[ChannelItem]) -> None:
        """Copy the pixels into the segment and send the request. The outputs go to an output
        segment that the results will view, if one is free; else after the pixels."""
        try:
            self._send(items)
        except BaseException:
            if self._output_segment is not None:  # no reply will come to hand it out
                self._output_segment.release()
                self._output_segment = None
            raise

    def _send(self, items: list[ChannelItem]) -> None:
        info = self._client.info
        layout, offset = [], 0
        for metadata, pixels, _ in items:
            layout.append((metadata, pixels, offset))
            offset = aligned(offset + pixels.nbytes)
        output_bytes = [info.output_bytes(num_tokens) for _, _, num_tokens in items]
        self._output_segment = self._outputs.take(sum(output_bytes))
        output_offset = 0 if self._output_segment is not None else offset
        self._output_offsets = []
        for nbytes in output_bytes:
            self._output_offsets.append(output_offset)
            output_offset += nbytes
        segment = self._segment_of(offset if self._output_segment is not None else output_offset)
        request_items = []
        for (is_video, grid, dtype_name), pixels, pixel_offset in layout:
            np.copyto(array_at(segment.buffer, dtype_name, pixel_offset, pixels.shape), pixels)
            request_items.append([is_video, list(grid), dtype_name, pixel_offset, list(pixels.shape)])
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._socket.settimeout(self._client.reply_timeout_s)
            self._socket.connect(info.address)
        message = {
            "segment": segment.path, "size": segment.size, "items": request_items, "outputs": self._output_offsets,
        }
        if self._output_segment is not None:
            message.update(output_segment=self._output_segment.path, output_size=self._output_segment.size)
        closed = self._closed_paths + self._outputs.closed_paths
        if closed:
            message["closed"] = closed
        _send_message(self._socket, message)
        self._closed_paths, self._outputs.closed_paths = [], []
        self._sent_at = time.perf_counter()

    def receive(self, items: list[ChannelItem]) -> ChannelReply | RemoteBatchError:
        """Wait for the reply to `send`; the results view the output segment (held until they are
        gone), or are copied out of the batch's segment."""
        output_segment, self._output_segment = self._output_segment, None
        handed_out = False
        try:
            num_tokens = sum(tokens for _, _, tokens in items)
            self._await_reply(num_tokens)
            reply = _receive_message(self._socket)
            if reply is None:
                raise ConnectionResetError("the actor closed the channel")
            self._client.round_trips.record(num_tokens, time.perf_counter() - self._sent_at)
            self._segment.unlink()  # the actor has mapped them
            if output_segment is not None:
                output_segment.unlink()
            if reply.get("status") == ERROR:
                return RemoteBatchError(str(reply.get("message")))
            errors = {int(position): str(reason) for position, reason in reply.get("errors", [])}
            receipt = BatchReceipt(str(reply["status"]), errors, float(reply.get("busy", 0.0)))
            values: list[Embedding | None] = [None] * len(items)
            if receipt.status == OK:
                block = self._output_block(items, output_segment)
                handed_out = output_segment is not None
                values = self._views_of(block, items, errors)
            return ChannelReply(values, receipt)
        finally:
            if output_segment is not None and not handed_out:
                output_segment.release()

    def _await_reply(self, num_tokens: int) -> None:
        """Sleep until shortly before the reply is due, then poll for it (at most `spin_s`), so
        that the thread is awake when it comes."""
        client = self._client
        if client.spin_s > 0:
            expected_s = client.round_trips.expected_s(num_tokens)
            if expected_s is not None:
                _sleep_until_due(self._socket, self._sent_at + expected_s - _WAKE_LEAD_S)
            _spin_until_readable(self._socket, client.spin_s)

    def _output_block(self, items: list[ChannelItem], output_segment: OwnedSegment | None) -> torch.Tensor:
        """The batch's outputs as one block of bytes, from its first output to the end of its last.

        In an output segment: a view of it, and the segment stays held until the last tensor that
        views it is gone. Else a copy out of the batch's segment, in one piece into one block: fresh
        memory costs a page fault per 4 KiB on first touch, and the allocator keeps one recurring
        block mapped where it would give back many. That block is pinned when this process already
        uses CUDA (torch caches pinned blocks, and the caller's copy to its GPU can then be
        asynchronous). An output segment is not pinned here: an asynchronous copy from it could
        still be reading when the results are dropped and the segment is written again."""
        start = self._output_offsets[0]
        end = self._output_offsets[-1] + self._client.info.output_bytes(items[-1][2])
        if output_segment is not None:
            view = np.frombuffer(output_segment.buffer, dtype=np.uint8, count=end - start, offset=start)
            weakref.finalize(view, output_segment.release)
            return torch.from_numpy(view)
        block = torch.empty(end - start, dtype=torch.uint8, pin_memory=torch.cuda.is_initialized())
        np.copyto(block.numpy(), np.frombuffer(self._segment.buffer, dtype=np.uint8, count=end - start, offset=start))
        return block

    def _views_of(self, block: torch.Tensor, items: list[ChannelItem], errors: dict) -> list[Embedding | None]:
        """Each item's tensors, as views of the batch's output block (None for a failed item)."""
        info = self._client.info
        torch_dtype = WIRE_DTYPES[info.output_dtype][0]
        start = self._output_offsets[0]
        values: list[Embedding | None] = []
        for position, ((_, _, num_tokens), offset) in enumerate(zip(items, self._output_offsets)):
            if position in errors:
                values.append(None)
                continue
            tensor_bytes = num_tokens * info.output_width * torch_dtype.itemsize
            tensors = []
            for _ in range(1 + info.num_deepstack):
                raw = block[offset - start : offset - start + tensor_bytes]
                tensors.append(raw.view(torch_dtype).view(num_tokens, info.output_width))
                offset = aligned(offset + tensor_bytes)  # where the actor put the next one
            values.append(Embedding(tensors[0], tensors[1:]))
        return values

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
