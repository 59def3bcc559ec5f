"""What both ends of the same-node channel agree on: how to reach an actor (`ChannelInfo`), the
messages and their framing, where an item's outputs lie (`item_output_offsets`), and the errors.

Messages are msgpack maps of plain values, each framed by its little-endian length:

    request = {"segment": PATH, "size": BYTES,            # the caller's segment with the pixels
               "plan": plan_to_wire(plan),                # the batch: budget and item specs
               "pixels": [OFFSET, ...],                   # per item, where its pixels start
               "outputs": [OFFSET, ...],                  # per item, where its outputs go
               "output_segment": PATH, "output_size": BYTES,  # optional: outputs go there, else
                                                              # into the pixels' segment
               "closed": [PATH, ...]}                     # optional: segments the caller closed
    reply   = {"status": "ok" | "retired", "errors": [[POSITION, REASON], ...], "busy": SECONDS}
            | {"status": "error", "message": TEXT}        # the actor failed on the batch itself

The actor rebuilds each item's pixels from its spec (`pixel_shape`, `pixel_dtype`) at its offset,
and writes its outputs at its output offset, laid out by `item_output_offsets`; the caller reads
them back with the same function. Nothing here knows a model.
"""

from __future__ import annotations

import functools
import math
import os
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass

import msgpack

from vitpool.specs import OutputLayout
from vitpool.transport.shared_memory import aligned, shm_directory
from vitpool.transport.wire import WIRE_DTYPES

MAX_MESSAGE_BYTES = 16 << 20
_LENGTH = struct.Struct("<I")
ERROR = "error"  # a reply status besides the receipt's: the actor failed on the batch itself


class ChannelClosed(ConnectionError):
    """The connection broke (the actor may have died); the batch was not answered."""


class RemoteBatchError(RuntimeError):
    """The actor failed on the batch as a whole (not on one bad item)."""


@dataclass(frozen=True)
class ChannelInfo:
    """How to reach an actor's channel, and the layout of what it returns (picklable: the actor
    reports it to the pool, which hands it to callers on the actor's node)."""

    address: str  # an abstract Unix socket name
    output_layout: OutputLayout


def channel_supported() -> bool:
    """Abstract Unix sockets and /dev/shm: Linux only. Elsewhere batches go through Ray."""
    return sys.platform == "linux" and os.path.isdir(shm_directory())


@functools.lru_cache(maxsize=4096)  # a few layouts, and the item sizes of the traffic
def item_output_offsets(layout: OutputLayout, num_tokens: int) -> tuple[tuple[int, ...], int]:
    """Where one item's output tensors lie in its block of output memory, and the block's size.

    The tensors of `layout.shapes(num_tokens)` follow each other, each starting at an aligned
    offset, so every block is a multiple of the alignment and blocks can follow each other too.
    The actor writes with this layout and the caller reads with it: it is defined here only.

    Returns:
        (per tensor its byte offset from the block's start, the block's size in bytes).
    """
    itemsize = WIRE_DTYPES[layout.dtype][1].itemsize
    offsets, offset = [], 0
    for shape in layout.shapes(num_tokens):
        offsets.append(offset)
        offset = aligned(offset + math.prod(shape) * itemsize)
    return tuple(offsets), offset


# framing: a little-endian length, then msgpack


def send_message(connection: socket.socket, message: dict) -> None:
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


def receive_message(connection: socket.socket) -> dict | None:
    """The next message, or None when the peer closed the connection. ValueError (or msgpack's
    errors) for a message that is too large or not a map."""
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
        raise ValueError("channel message is not a map")  # noqa: TRY004 - the server drops a peer on ValueError
    return message


# waiting: a sleeping thread pays for its wake-up, so both ends poll around the moment a message
# is due


def sleep_until_due(connection: socket.socket, due_at: float) -> None:
    """Sleep until `due_at` (a perf_counter time) or until `connection` is readable."""
    remaining = due_at - time.perf_counter()
    if remaining > 0:
        select.select([connection], [], [], remaining)


def spin_until_readable(connection: socket.socket, spin_s: float) -> None:
    """Poll `connection` for up to `spin_s` before the caller blocks on it: a thread that stays
    awake sees the message at once, where a sleeping one pays for its wake-up."""
    deadline = time.perf_counter() + spin_s
    while time.perf_counter() < deadline:
        readable, _, _ = select.select([connection], [], [], 0)
        if readable:
            return
        os.sched_yield()
