"""The same-node channel: a batch's pixels and outputs go between a caller's process and an
encoder actor on the same node through shared memory, with small msgpack messages over a Unix
socket. This module gathers its parts:

- `channel_protocol`: `ChannelInfo`, the messages, the per-item output layout, the errors;
- `channel_server`: the actor's end (`ChannelServer`);
- `channel_client`: the caller's end (`ChannelClient`);
- `segments`: the shared-memory segments both ends map.

Why it exists: on the GPU host one Ray actor call costs about 1 ms, and carrying a batch's pixels
and embeddings through the object store 3-4 ms: more than the encode of a small image. Here a
batch costs one copy in and two small socket messages; the results view the memory the actor
wrote them into.

A connection carries one batch at a time. The caller owns its segments: it writes the pixels
into one, sends a request with the batch's plan (its item specs), where each item's pixels are
and where its outputs go (an output segment, or after the pixels); the actor rebuilds the pixels
from the specs, runs the batch, writes the outputs there and answers with the batch's receipt.
A caller opens as many connections to an actor as it keeps batches in flight there. Both sides
poll briefly around the moment a message is due, since a sleeping thread pays for its wake-up.

The channel knows no model: pixels of any shape and wire dtype, as the specs say, and per item
the output tensors of the actor's `OutputLayout`.

Nothing is unpickled: messages are msgpack of plain values. The actor maps only files in the
shared-memory directory whose names carry the channel's prefix, and serves only its own user.
"""

from vitpool.transport.channel_client import ChannelClient, ChannelReply, Exchange, ReplyCallback, RoundTrips
from vitpool.transport.channel_protocol import (
    ChannelClosed,
    ChannelInfo,
    RemoteBatchError,
    channel_supported,
    item_output_offsets,
)
from vitpool.transport.channel_server import BatchFunction, ChannelServer

__all__ = [
    "BatchFunction",
    "ChannelClient",
    "ChannelClosed",
    "ChannelInfo",
    "ChannelReply",
    "ChannelServer",
    "Exchange",
    "RemoteBatchError",
    "ReplyCallback",
    "RoundTrips",
    "channel_supported",
    "item_output_offsets",
]
