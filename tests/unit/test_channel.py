"""The same-node channel between a caller and an actor's batch function, in one process (no Ray,
no model): results equal what the function returned, for pixels and outputs of any shape; bad
items fail alone; segments are held, reused and released as documented; and a hostile or broken
peer harms nothing."""

from __future__ import annotations

import concurrent.futures
import glob
import os
import pickle
import socket
import struct

import msgpack
import numpy as np
import pytest
import torch

from vitpool.items import Embedding
from vitpool.specs import BatchPlan, ItemSpec, OutputLayout, plan_to_wire
from vitpool.transport import shared_memory as segments
from vitpool.transport.channel import (
    ChannelClient,
    ChannelClosed,
    ChannelReply,
    ChannelServer,
    RemoteBatchError,
    channel_supported,
    item_output_offsets,
)
from vitpool.transport.link import OK, RETIRED, BatchReceipt
from vitpool.transport.shared_memory import OUTPUT_SEGMENTS_PER_CONNECTION, SEGMENT_PREFIX, OwnedSegment
from vitpool.transport.wire import WIRE_DTYPES, from_array, to_array

pytestmark = pytest.mark.skipif(not channel_supported(), reason="the same-node channel needs Linux")

ROW_WIDTH = 48
# Qwen-like: tokens and two deepstack maps of the same width
QWEN_LIKE = ((ROW_WIDTH,), (ROW_WIDTH,), (ROW_WIDTH,))
# several differently shaped outputs per token
MIXED = ((ROW_WIDTH,), (3, 5), (7,), (2, 2, 2))


def fake_outputs(spec: ItemSpec, pixels: torch.Tensor, layout: OutputLayout) -> list[torch.Tensor]:
    """What the fake encoder returns for an item: a function of its pixels only."""
    seed = int(abs(float(pixels.double().sum())) * 1000) % 2**31 + spec.num_tokens
    generator = torch.Generator().manual_seed(seed)
    dtype = WIRE_DTYPES[layout.dtype][0]
    return [torch.randn(shape, generator=generator).to(dtype) for shape in layout.shapes(spec.num_tokens)]


class FakeEncoder:
    """`run_batch` as the actor has it: non-finite pixels fail their item, `retiring` refuses
    the batch, `broken` fails it as a whole."""

    def __init__(self, layout: OutputLayout) -> None:
        self.layout = layout
        self.retiring = False
        self.broken = False
        self.output_devices: list[str | None] = []

    def run_batch(self, plan: BatchPlan, pixels: list[np.ndarray], output_device: str | None):
        self.output_devices.append(output_device)
        if self.broken:
            raise RuntimeError("the encoder broke")
        if self.retiring:
            return [None] * len(plan.specs), BatchReceipt(RETIRED)
        values, errors = [], {}
        for position, (spec, array) in enumerate(zip(plan.specs, pixels, strict=True)):
            assert array.shape == spec.pixel_shape
            tensor = from_array(array, spec.pixel_dtype)
            if not torch.isfinite(tensor.float()).all():
                values.append(None)
                errors[position] = "pixel_values contain NaN or infinite values"
            else:
                values.append(Embedding.from_outputs(fake_outputs(spec, tensor, self.layout)))
        return values, BatchReceipt(OK, errors, 0.001)


@pytest.fixture(params=["float32", "bfloat16"])
def server(request):
    layout = OutputLayout(QWEN_LIKE, request.param)
    encoder = FakeEncoder(layout)
    server = ChannelServer(encoder.run_batch, "test", None, 0.0, layout)
    server.encoder = encoder
    yield server
    server.close()


def item(
    shape: tuple[int, ...], num_tokens: int, dtype: str = "float32", seed: int = 0, modality: str = "image"
) -> tuple[ItemSpec, np.ndarray]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(shape, generator=generator).to(WIRE_DTYPES[dtype][0])
    return ItemSpec(modality, tuple(shape), dtype, (), num_tokens), to_array(pixels)


def rows(num_rows: int, seed: int = 0, dtype: str = "float32") -> tuple[ItemSpec, np.ndarray]:
    """A Qwen-style item: flattened patch rows, a quarter as many output tokens."""
    return item((num_rows, ROW_WIDTH), num_rows // 4, dtype, seed)


def batch(*items: tuple[ItemSpec, np.ndarray]) -> tuple[BatchPlan, list[np.ndarray]]:
    return BatchPlan(None, tuple(spec for spec, _ in items)), [pixels for _, pixels in items]


def submit(client: ChannelClient, plan_and_pixels, timeout_s: float = 30.0):
    future: concurrent.futures.Future = concurrent.futures.Future()
    client.submit(*plan_and_pixels, future.set_result)
    return future.result(timeout_s)


def expected(layout: OutputLayout, plan: BatchPlan, pixels: list[np.ndarray]) -> list[list[torch.Tensor]]:
    return [
        fake_outputs(spec, from_array(array, spec.pixel_dtype), layout)
        for spec, array in zip(plan.specs, pixels)
    ]


def assert_results(reply, layout: OutputLayout, plan: BatchPlan, pixels: list[np.ndarray]) -> None:
    assert isinstance(reply, ChannelReply), reply
    assert reply.receipt.status == OK
    for value, want, spec in zip(reply.values, expected(layout, plan, pixels), plan.specs, strict=True):
        assert [tuple(t.shape) for t in value.outputs] == layout.shapes(spec.num_tokens)
        for got, wanted in zip(value.outputs, want, strict=True):
            assert got.dtype == wanted.dtype and torch.equal(got, wanted)


def own_segments() -> list[str]:
    return glob.glob(f"/dev/shm/{SEGMENT_PREFIX}*")


def test_results_equal_the_encoders_own(server):
    layout = server.encoder.layout
    client = ChannelClient(server.info)
    try:
        for plan_and_pixels in (
            batch(rows(32)),
            batch(rows(16, 1), item((64, ROW_WIDTH), 16, seed=2, modality="video"), rows(256, 3)),
        ):
            assert_results(submit(client, plan_and_pixels), layout, *plan_and_pixels)
        assert server.encoder.output_devices[-1] == "cpu"  # no CUDA device: outputs on the host
    finally:
        client.close()


@pytest.mark.parametrize("pixel_dtype", ["float32", "bfloat16", "float16"])
def test_tiles_of_any_shape_and_outputs_of_several_shapes(pixel_dtype):
    """A tiled tower: 4-D pixels [tiles, 3, P, P] and no grid; outputs of differently shaped rows."""
    layout = OutputLayout(MIXED, "bfloat16")
    encoder = FakeEncoder(layout)
    server = ChannelServer(encoder.run_batch, "tiles", None, 0.0, layout)
    client = ChannelClient(server.info)
    try:
        plan_and_pixels = batch(
            item((2, 3, 14, 14), 2 * 16, pixel_dtype, seed=1),
            item((7, 3, 14, 14), 7 * 16, pixel_dtype, seed=2),
            item((5,), 1, pixel_dtype, seed=3),  # 1-D: anything the specs say travels
            item((1, 2, 3, 4, 5), 3, pixel_dtype, seed=4),  # 5-D
        )
        reply = submit(client, plan_and_pixels)
        assert_results(reply, layout, *plan_and_pixels)
        # the inline path (the calling thread carries the batch) reads the same layout
        exchange = client.exchange(*plan_and_pixels)
        exchange.send()
        assert_results(exchange.receive(), layout, *plan_and_pixels)
    finally:
        client.close()
        server.close()


def test_the_output_layout_is_aligned_and_packed():
    layout = OutputLayout(MIXED, "float32")
    offsets, nbytes = item_output_offsets(layout, 3)
    sizes = [3 * 48 * 4, 3 * 15 * 4, 3 * 7 * 4, 3 * 8 * 4]
    assert offsets == (
        0,
        segments.aligned(sizes[0]),
        segments.aligned(sizes[0]) + segments.aligned(sizes[1]),
        segments.aligned(sizes[0]) + segments.aligned(sizes[1]) + segments.aligned(sizes[2]),
    )
    assert nbytes == sum(segments.aligned(size) for size in sizes)
    assert item_output_offsets(layout, 0) == ((0, 0, 0, 0), 0)


def test_a_bad_item_fails_alone(server):
    good, bad = rows(32, 1), rows(16, 2)
    bad[1][3, 5] = to_array(torch.tensor([float("nan")]))[0]
    plan, pixels = batch(good, bad)
    client = ChannelClient(server.info)
    try:
        reply = submit(client, (plan, pixels))
    finally:
        client.close()
    assert list(reply.receipt.item_errors) == [1] and "NaN" in reply.receipt.item_errors[1]
    assert reply.values[1] is None
    (want,) = expected(server.encoder.layout, BatchPlan(None, plan.specs[:1]), pixels[:1])
    assert torch.equal(reply.values[0].tokens, want[0])


def test_a_retiring_actor_refuses_with_no_values(server):
    server.encoder.retiring = True
    client = ChannelClient(server.info)
    try:
        reply = submit(client, batch(rows(16), rows(32, 1)))
        assert reply.receipt.status == RETIRED and reply.values == [None, None]
        (connection,) = client._idle
        assert not any(segment.held for segment in connection._outputs._segments)
    finally:
        client.close()


def test_a_batch_that_fails_as_a_whole_is_a_remote_batch_error(server):
    server.encoder.broken = True
    client = ChannelClient(server.info)
    try:
        reply = submit(client, batch(rows(16)))
        assert isinstance(reply, RemoteBatchError) and "the encoder broke" in str(reply)
        (connection,) = client._idle  # the connection is fine
        assert not any(segment.held for segment in connection._outputs._segments)
    finally:
        client.close()


@pytest.mark.parametrize("output_shape", [(4, ROW_WIDTH + 1), (5, ROW_WIDTH)], ids=["width", "tokens"])
def test_outputs_unlike_the_layout_fail_the_batch(output_shape):
    layout = OutputLayout(((ROW_WIDTH,),), "float32")

    def run_batch(plan, pixels, output_device):
        return [Embedding(torch.zeros(output_shape))], BatchReceipt(OK)

    server = ChannelServer(run_batch, "bad-outputs", None, 0.0, layout)
    client = ChannelClient(server.info)
    try:
        reply = submit(client, batch(rows(16)))
        assert isinstance(reply, RemoteBatchError) and "the layout says" in str(reply)
    finally:
        client.close()
        server.close()


def test_pixels_unlike_their_specs_are_refused_before_sending(server):
    spec, pixels = rows(16)
    client = ChannelClient(server.info)
    try:
        reply = submit(client, (BatchPlan(None, (spec,)), [pixels[:8]]))
        assert isinstance(reply, TypeError) and "its spec says" in str(reply)
        reply = submit(client, (BatchPlan(None, (spec,)), [pixels.astype(np.float64)]))
        assert isinstance(reply, TypeError)
        assert_results(
            submit(client, batch(rows(16))), server.encoder.layout, *batch(rows(16))
        )  # still usable
    finally:
        client.close()


def test_concurrent_batches_use_their_own_connections(server):
    batches = [batch(rows(16 + n % 3 * 16, n)) for n in range(12)]
    client = ChannelClient(server.info)
    try:
        futures = []
        for plan_and_pixels in batches:
            future: concurrent.futures.Future = concurrent.futures.Future()
            client.submit(*plan_and_pixels, future.set_result)
            futures.append(future)
        for plan_and_pixels, future in zip(batches, futures):
            assert_results(future.result(30), server.encoder.layout, *plan_and_pixels)
        assert len(client._idle) > 1
    finally:
        client.close()


def test_segments_are_unlinked_once_mapped(server):
    before = set(own_segments())
    client = ChannelClient(server.info)
    try:
        submit(client, batch(rows(32)))
        assert set(own_segments()) - before == set()
    finally:
        client.close()


def test_results_view_output_segments_that_are_used_again_once_dropped(server):
    layout = server.encoder.layout
    batches = [batch(rows(32, seed)) for seed in range(OUTPUT_SEGMENTS_PER_CONNECTION + 2)]
    client = ChannelClient(server.info)
    try:
        # Held results keep their segments: later batches take others, then (all held) are copied out.
        held = [submit(client, plan_and_pixels).values[0] for plan_and_pixels in batches]
        for result, (plan, pixels) in zip(held, batches):
            assert torch.equal(result.tokens, expected(layout, plan, pixels)[0][0])
        addresses = {result.tokens.data_ptr() for result in held}
        assert len(addresses) == len(batches)
        (connection,) = client._idle
        owned = connection._outputs._segments
        assert len(owned) == OUTPUT_SEGMENTS_PER_CONNECTION and all(s.held for s in owned)

        # Dropped results free their segments: the next batch's results view one of those.
        first_addresses = {result.tokens.data_ptr() for result in held[:OUTPUT_SEGMENTS_PER_CONNECTION]}
        del result
        held.clear()
        assert not any(s.held for s in owned)
        again = submit(client, batches[0]).values[0]
        assert again.tokens.data_ptr() in first_addresses
        assert torch.equal(again.tokens, expected(layout, *batches[0])[0][0])
    finally:
        client.close()


def test_a_held_output_segment_stays_mapped_while_others_come_and_go(monkeypatch, server):
    """Growing batches replace the connection's other segments many times while results hold one;
    the actor must keep that one mapped (it is unlinked, so it could not be mapped again)."""
    monkeypatch.setattr(segments, "MIN_SEGMENT_BYTES", 4096)  # so that segments grow often
    layout = server.encoder.layout
    client = ChannelClient(server.info)
    try:
        first = batch(rows(4, 100))
        held = submit(client, first)
        for side in (4, 6, 8, 10, 12, 14, 16, 18, 20):
            assert isinstance(submit(client, batch(rows(side * side, side))), ChannelReply)
        (connection,) = client._idle
        held_segment = next(s for s in connection._outputs._segments if s.held)
        del held
        again = submit(client, first)  # takes the segment the results held
        assert isinstance(again, ChannelReply), again
        offset = again.values[0].tokens.data_ptr() - np.frombuffer(held_segment.buffer, np.uint8).ctypes.data
        assert 0 <= offset < held_segment.size
        assert torch.equal(again.values[0].tokens, expected(layout, *first)[0][0])
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


def test_a_failed_batch_does_not_hold_its_output_segment(server):
    spec, pixels = rows(16)
    pixels[0, 0] = to_array(torch.tensor([float("inf")]))[0]
    client = ChannelClient(server.info)
    try:
        for _ in range(OUTPUT_SEGMENTS_PER_CONNECTION + 1):
            reply = submit(client, (BatchPlan(None, (spec,)), [pixels]))
            assert reply.values == [None] and list(reply.receipt.item_errors) == [0]
        (connection,) = client._idle
        assert not any(segment.held for segment in connection._outputs._segments)
    finally:
        client.close()


@pytest.mark.parametrize(
    "shape, ok",
    [
        ((2, 3), True),
        ((1, 2, 3, 4, 5), True),
        ((0, 4), True),  # empty: nothing to view, still inside
        ((), False),  # a scalar: pixels have at least one dimension
        ((1,) * (segments.MAX_ARRAY_DIMENSIONS + 1), False),  # too many dimensions
        ((2, -1), False),
        ((2, True), False),  # booleans are not sizes
        ((1 << 40, 1 << 40), False),  # far past the segment
    ],
)
def test_array_at_checks_every_shape(shape, ok):
    segment = OwnedSegment(1 << 20)
    try:
        if ok:
            assert segments.array_at(segment.buffer, "float32", 64, shape).shape == shape
        else:
            with pytest.raises(ValueError):
                segments.array_at(segment.buffer, "float32", 64, shape)
    finally:
        segment.close()


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
        framed(
            {
                "segment": "/etc/passwd",
                "size": 16,
                "plan": {"budget": None, "specs": []},
                "pixels": [],
                "outputs": [],
            }
        ),
        framed({"segment": "/dev/shm/../etc/passwd", "size": 16, "pixels": [], "outputs": []}),
        framed(
            {
                "segment": "/dev/shm/../etc/passwd",
                "size": 16,
                "pixels": [],
                "outputs": [],
                "output_segment": "/etc/passwd",
                "output_size": 16,
            }
        ),
        framed([1, 2, 3]),
        struct.pack("<I", 1 << 30) + b"x",
        struct.pack("<I", 8) + b"\xc1" * 8,
        b"\x05\x00",
    ],
    ids=[
        "outside-shm",
        "dot-dot",
        "output-outside-shm",
        "not-a-map",
        "huge-length",
        "bad-msgpack",
        "truncated",
    ],
)
def test_hostile_bytes_close_only_their_connection(server, payload):
    assert raw_exchange(server.address, payload) == b""  # dropped without an answer
    client = ChannelClient(server.info)
    try:
        assert submit(client, batch(rows(16))).receipt.status == OK  # the actor serves others as before
    finally:
        client.close()


def request(segment: OwnedSegment, spec: ItemSpec, pixel_offset, output_offset, **extra) -> bytes:
    message = {
        "segment": segment.path,
        "size": segment.size,
        "plan": plan_to_wire(BatchPlan(None, (spec,))),
        "pixels": [pixel_offset],
        "outputs": [output_offset],
        **extra,
    }
    return framed(message)


def error_of(address: str, payload: bytes) -> str:
    answer = msgpack.unpackb(raw_exchange(address, payload)[4:])
    assert answer["status"] == "error"
    return answer["message"]


@pytest.mark.parametrize(
    "plan, pixel_offsets, words",
    [
        ({"budget": None, "specs": [["image", [2, 2], "float32", [], 1, []]]}, [1 << 20], "do not fit"),
        (
            {"budget": None, "specs": [["image", [2, 2], "float32", [], 1, []]]},
            [0, 0],
            "one pixels offset per item",
        ),
        (
            {"budget": None, "specs": [["image", [2, 2], "float32", [], 1, []]]},
            ["0"],
            "one pixels offset per item",
        ),
        ({"budget": None, "specs": [["image", [2, 2], "int8", [], 1, []]]}, [0], "unknown dtype"),
        ({"budget": None, "specs": [["audio", [2, 2], "float32", [], 1, []]]}, [0], "not an item spec"),
        ("not a plan", [0], "not a batch plan"),
    ],
    ids=["pixels-past-the-end", "too-many-offsets", "text-offset", "bad-dtype", "bad-modality", "bad-plan"],
)
def test_malformed_requests_fail_the_batch_not_the_actor(server, plan, pixel_offsets, words):
    segment = OwnedSegment(1 << 20)
    try:
        message = {
            "segment": segment.path,
            "size": segment.size,
            "plan": plan,
            "pixels": pixel_offsets,
            "outputs": [0],
        }
        assert words in error_of(server.address, framed(message))
    finally:
        segment.close()


def test_outputs_past_the_output_segment_fail_the_batch_not_the_actor(server):
    pixels, outputs = OwnedSegment(1 << 20), OwnedSegment(1 << 20)
    try:
        spec, array = rows(64, dtype=server.encoder.layout.dtype)
        np.copyto(segments.array_at(pixels.buffer, spec.pixel_dtype, 0, spec.pixel_shape), array)
        payload = request(
            pixels, spec, 0, outputs.size - 8, output_segment=outputs.path, output_size=outputs.size
        )
        assert "do not fit" in error_of(server.address, payload)
    finally:
        pixels.close()
        outputs.close()


def test_a_closed_server_gives_channel_closed():
    layout = OutputLayout(QWEN_LIKE, "float32")
    server = ChannelServer(FakeEncoder(layout).run_batch, "closing", None, 0.0, layout)
    client = ChannelClient(server.info)
    assert isinstance(submit(client, batch(rows(16))), ChannelReply)
    server.close()
    os.sched_yield()
    # the open connection still works until its server thread ends; a new one cannot connect
    fresh = ChannelClient(server.info)
    outcome = submit(fresh, batch(rows(16)))
    assert isinstance(outcome, ChannelClosed)
    client.close()
    fresh.close()
    with pytest.raises(ChannelClosed):  # a closed client takes no batch
        fresh.submit(*batch(rows(16)), lambda reply: None)


def test_channel_info_pickles():
    layout = OutputLayout(MIXED, "bfloat16")
    server = ChannelServer(FakeEncoder(layout).run_batch, "pickle", None, 0.0, layout)
    try:
        assert pickle.loads(pickle.dumps(server.info)) == server.info
    finally:
        server.close()
