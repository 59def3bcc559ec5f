"""The same-node channel between a caller and an encoder actor, in one process (no Ray): results
equal the encoder's own, bad items fail alone, and a hostile or broken peer harms nothing."""

from __future__ import annotations

import concurrent.futures
import glob
import os
import socket
import struct

import msgpack
import numpy as np
import pytest
import torch
from conftest import image, video

from vitpool.actors import EncoderActor
from vitpool.actors.local_channel import ChannelClient, ChannelClosed, ChannelReply, channel_supported
from vitpool.actors import segments
from vitpool.actors.segments import OUTPUT_SEGMENTS_PER_CONNECTION, SEGMENT_PREFIX, OwnedSegment
from vitpool.items import Video
from vitpool.transport.wire import to_array, wire_dtype_name

pytestmark = pytest.mark.skipif(not channel_supported(), reason="the same-node channel needs Linux")

BUDGETS = [16, 64]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def actor(request):
    actor = EncoderActor(0, None, BUDGETS, None, None, request.param, "cpu", num_threads=2)
    yield actor
    actor._channel.close()


def channel_items(items) -> list:
    return [
        (
            (isinstance(item, Video), tuple(item.grid_thw), wire_dtype_name(item.pixel_values.dtype)),
            to_array(item.pixel_values),
            int(np.prod(item.grid_thw)) // 4,
        )
        for item in items
    ]


def exchange(client: ChannelClient, items, timeout_s: float = 60.0):
    future: concurrent.futures.Future = concurrent.futures.Future()
    client.submit(channel_items(items), future.set_result)
    return future.result(timeout_s)


def own_segments() -> list[str]:
    return glob.glob(f"/dev/shm/{SEGMENT_PREFIX}*")


def test_results_equal_the_encoders_own(actor):
    generator = torch.Generator().manual_seed(0)
    client = ChannelClient(actor.info().channel)
    try:
        for items in ([image(8, 8, generator)], [image(4, 6, generator), video(2, 4, 4, generator), image(16, 16, generator)]):
            items = [type(i)(i.pixel_values.to(actor.encoder.dtype), i.grid_thw) for i in items]
            reply = exchange(client, items)
            assert isinstance(reply, ChannelReply) and reply.receipt.status == "ok"
            expected = actor.encoder.encode(items)
            for got, want in zip(reply.values, expected, strict=True):
                assert got.tokens.dtype == want.tokens.dtype == actor.encoder.dtype
                assert torch.equal(got.tokens, want.tokens)
                assert len(got.deepstack) == len(want.deepstack) > 0
                for g, w in zip(got.deepstack, want.deepstack):
                    assert torch.equal(g, w)
                assert torch.isfinite(got.tokens.float()).all()
    finally:
        client.close()


def test_a_bad_item_fails_alone(actor):
    good, bad = image(8, 8), image(4, 4)
    bad.pixel_values[3, 5] = float("nan")
    items = [type(i)(i.pixel_values.to(actor.encoder.dtype), i.grid_thw) for i in (good, bad)]
    client = ChannelClient(actor.info().channel)
    try:
        reply = exchange(client, items)
    finally:
        client.close()
    assert list(reply.receipt.item_errors) == [1] and "NaN" in reply.receipt.item_errors[1]
    assert reply.values[1] is None
    assert torch.equal(reply.values[0].tokens, actor.encoder.encode(items[:1])[0].tokens)


def test_concurrent_batches_use_their_own_connections(actor):
    generator = torch.Generator().manual_seed(1)
    batches = [[image(4 + n % 3 * 4, 8, generator)] for n in range(12)]
    batches = [[type(i)(i.pixel_values.to(actor.encoder.dtype), i.grid_thw) for i in b] for b in batches]
    client = ChannelClient(actor.info().channel)
    try:
        futures = []
        for batch in batches:
            future: concurrent.futures.Future = concurrent.futures.Future()
            client.submit(channel_items(batch), future.set_result)
            futures.append(future)
        for batch, future in zip(batches, futures):
            reply = future.result(60)
            # Batches that wait for the encoder run together (actors/combining.py): other batch
            # mates than the batch alone, so equal only to rounding.
            tolerance = 1e-5 if actor.encoder.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(
                reply.values[0].tokens, actor.encoder.encode(batch)[0].tokens, rtol=tolerance, atol=tolerance
            )
    finally:
        client.close()


def test_segments_are_unlinked_once_mapped(actor):
    before = set(own_segments())
    client = ChannelClient(actor.info().channel)
    try:
        items = [type(i)(i.pixel_values.to(actor.encoder.dtype), i.grid_thw) for i in [image(8, 8)]]
        exchange(client, items)
        assert set(own_segments()) - before == set()
    finally:
        client.close()


def test_results_view_output_segments_that_are_used_again_once_dropped(actor):
    generator = torch.Generator().manual_seed(2)
    batches = [
        [type(i)(i.pixel_values.to(actor.encoder.dtype), i.grid_thw) for i in [image(8, 8, generator)]]
        for _ in range(OUTPUT_SEGMENTS_PER_CONNECTION + 2)
    ]
    client = ChannelClient(actor.info().channel)
    try:
        # Held results keep their segments: later batches take others, then (all held) are copied out.
        held = [exchange(client, batch).values[0] for batch in batches]
        for result, batch in zip(held, batches):
            assert torch.equal(result.tokens, actor.encoder.encode(batch)[0].tokens)
        addresses = {result.tokens.data_ptr() for result in held}
        assert len(addresses) == len(batches)
        (connection,) = client._idle
        segments = connection._outputs._segments
        assert len(segments) == OUTPUT_SEGMENTS_PER_CONNECTION and all(s.held for s in segments)

        # Dropped results free their segments: the next batch's results view one of those.
        first_addresses = {result.tokens.data_ptr() for result in held[:OUTPUT_SEGMENTS_PER_CONNECTION]}
        del result
        held.clear()
        assert not any(s.held for s in segments)
        again = exchange(client, batches[0]).values[0]
        assert again.tokens.data_ptr() in first_addresses
        assert torch.equal(again.tokens, actor.encoder.encode(batches[0])[0].tokens)
    finally:
        client.close()


def test_a_held_output_segment_stays_mapped_while_others_come_and_go(monkeypatch, actor):
    """Growing batches replace the connection's other segments many times while results hold one;
    the actor must keep that one mapped (it is unlinked, so it could not be mapped again)."""
    monkeypatch.setattr(segments, "MIN_SEGMENT_BYTES", 4096)  # so that segments grow often
    generator = torch.Generator().manual_seed(3)

    def batch(side: int) -> list:
        item = image(side, side, generator)
        return [type(item)(item.pixel_values.to(actor.encoder.dtype), item.grid_thw)]

    client = ChannelClient(actor.info().channel)
    try:
        first = batch(2)
        held = exchange(client, first)
        for side in (4, 6, 8, 10, 12, 14, 16, 18, 20):
            assert isinstance(exchange(client, batch(side)), ChannelReply)
        (connection,) = client._idle
        held_segment = next(s for s in connection._outputs._segments if s.held)
        del held
        again = exchange(client, first)  # takes the segment the results held
        assert isinstance(again, ChannelReply), again
        offset = again.values[0].tokens.data_ptr() - np.frombuffer(held_segment.buffer, np.uint8).ctypes.data
        assert 0 <= offset < held_segment.size
        assert torch.equal(again.values[0].tokens, actor.encoder.encode(first)[0].tokens)
    finally:
        client.close()


def test_an_actor_maps_a_bounded_number_of_segments(monkeypatch):
    monkeypatch.setattr(segments, "MAX_MAPPED_PER_CONNECTION", 2)
    owned = [OwnedSegment(1 << 20) for _ in range(3)]
    mapped = segments.MappedSegments(None)
    try:
        for segment in owned:
            mapped.get(segment.path, segment.size)
        assert list(mapped._mapped) == [owned[1].path, owned[2].path]  # the least recently used went
        mapped.forget([owned[1].path, "not mapped", 7])
        assert list(mapped._mapped) == [owned[2].path]
        mapped.forget("not a list")
        assert list(mapped._mapped) == [owned[2].path]
    finally:
        mapped.close()
        for segment in owned:
            segment.close()


def test_a_failed_batch_does_not_hold_its_output_segment(actor):
    bad = image(4, 4)
    bad.pixel_values[0, 0] = float("inf")
    items = [type(bad)(bad.pixel_values.to(actor.encoder.dtype), bad.grid_thw)]
    client = ChannelClient(actor.info().channel)
    try:
        for _ in range(OUTPUT_SEGMENTS_PER_CONNECTION + 1):
            reply = exchange(client, items)
            assert reply.values == [None] and list(reply.receipt.item_errors) == [0]
        (connection,) = client._idle
        assert not any(segment.held for segment in connection._outputs._segments)
    finally:
        client.close()


def raw_exchange(address: str, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(10)
        connection.connect(address)
        connection.sendall(payload)
        connection.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := connection.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:  # closed with our bytes unread
            pass
    return b"".join(chunks)


def framed(message) -> bytes:
    payload = msgpack.packb(message)
    return struct.pack("<I", len(payload)) + payload


@pytest.mark.parametrize(
    "payload",
    [
        framed({"segment": "/etc/passwd", "size": 16, "items": [], "outputs": []}),
        framed({"segment": "/dev/shm/../etc/passwd", "size": 16, "items": [], "outputs": []}),
        framed({"segment": "/dev/shm/../etc/passwd", "size": 16, "items": [], "outputs": [],
                "output_segment": "/etc/passwd", "output_size": 16}),
        framed([1, 2, 3]),
        struct.pack("<I", 1 << 30) + b"x",
        struct.pack("<I", 8) + b"\xc1" * 8,
        b"\x05\x00",
    ],
    ids=["outside-shm", "dot-dot", "output-outside-shm", "not-a-map", "huge-length", "bad-msgpack", "truncated"],
)
def test_hostile_bytes_close_only_their_connection(actor, payload):
    address = actor.info().channel.address
    assert raw_exchange(address, payload) == b""  # dropped without an answer
    items = [type(i)(i.pixel_values.to(actor.encoder.dtype), i.grid_thw) for i in [image(8, 8)]]
    client = ChannelClient(actor.info().channel)
    try:
        assert exchange(client, items).receipt.status == "ok"  # the actor serves others as before
    finally:
        client.close()


def test_out_of_bounds_offsets_fail_the_batch_not_the_actor(actor):
    segment = OwnedSegment(1 << 20)
    try:
        message = {
            "segment": segment.path, "size": segment.size,
            "items": [[False, [1, 8, 8], "float32", segment.size - 8, [64, 1536]]],
            "outputs": [0],
        }
        reply = raw_exchange(actor.info().channel.address, framed(message))
        answer = msgpack.unpackb(reply[4:])
        assert answer["status"] == "error" and "do not fit" in answer["message"]
    finally:
        segment.close()


def test_outputs_past_the_output_segment_fail_the_batch_not_the_actor(actor):
    pixels, outputs = OwnedSegment(1 << 20), OwnedSegment(1 << 20)
    try:
        item = type(image(8, 8))(image(8, 8).pixel_values.to(actor.encoder.dtype), (1, 8, 8))
        np.copyto(np.frombuffer(pixels.buffer, dtype=to_array(item.pixel_values).dtype, count=64 * 1536),
                  to_array(item.pixel_values).reshape(-1))
        message = {
            "segment": pixels.path, "size": pixels.size,
            "items": [[False, [1, 8, 8], wire_dtype_name(actor.encoder.dtype), 0, [64, 1536]]],
            "outputs": [outputs.size - 8], "output_segment": outputs.path, "output_size": outputs.size,
        }
        reply = raw_exchange(actor.info().channel.address, framed(message))
        answer = msgpack.unpackb(reply[4:])
        assert answer["status"] == "error" and "do not fit" in answer["message"]
    finally:
        pixels.close()
        outputs.close()


def test_a_closed_server_gives_channel_closed():
    actor = EncoderActor(1, None, BUDGETS, None, None, "float32", "cpu", num_threads=1)
    client = ChannelClient(actor.info().channel)
    items = [image(8, 8)]
    assert isinstance(exchange(client, items), ChannelReply)
    actor._channel.close()
    os.sched_yield()
    # the open connection still works until its server thread ends; a new one cannot connect
    fresh = ChannelClient(actor.info().channel)
    outcome = exchange(fresh, items)
    assert isinstance(outcome, ChannelClosed)
    client.close()
    fresh.close()
