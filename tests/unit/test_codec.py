"""The msgpack codec for bytes from outside the cluster: exact round trips for every dtype and
shape, and a decoder that answers any other bytes with ValueError (fuzzed with hypothesis)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vitpool import Embedding, Image, Video
from vitpool.codec import decode_request, decode_results, encode_request, encode_results

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(0, 4), (1, 1), (3, 7), (16, 1536), (5,), (2, 3, 4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_results_round_trip_exactly(dtype, shape):
    generator = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    tokens = torch.randn(shape, generator=generator).to(dtype)
    deepstack = [torch.randn(shape, generator=generator).to(dtype) for _ in range(3)]
    (decoded,) = decode_results(encode_results([Embedding(tokens, deepstack)]))
    assert decoded.tokens.dtype == dtype and decoded.tokens.shape == tokens.shape
    assert torch.equal(decoded.tokens, tokens)
    assert len(decoded.deepstack) == 3
    for got, want in zip(decoded.deepstack, deepstack):
        assert got.dtype == dtype and torch.equal(got, want)
    decoded.tokens.add_(1)  # the caller's own, writable memory


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_requests_round_trip_exactly(dtype):
    items = [
        Image(torch.randn(64, 1536).to(dtype), (1, 8, 8)),
        Video(torch.randn(2 * 16, 1536).to(dtype), torch.tensor([2, 4, 4])),
        Image(np.random.default_rng(0).standard_normal((4, 1536)).astype(np.float32), (1, 2, 2)),
    ]
    decoded = decode_request(encode_request(items))
    assert [type(i) for i in decoded] == [Image, Video, Image]
    assert [tuple(i.grid_thw) for i in decoded] == [(1, 8, 8), (2, 4, 4), (1, 2, 2)]
    for got, want in zip(decoded, items):
        assert torch.equal(got.pixel_values, torch.as_tensor(want.pixel_values))


def test_an_empty_list_round_trips():
    assert decode_request(encode_request([])) == []
    assert decode_results(encode_results([])) == []


def message(**changes):
    base = {
        "format": "vitpool", "version": 1, "kind": "request",
        "items": [{"type": "image", "grid_thw": [1, 1, 1], "pixels": {"dtype": "float32", "shape": [1, 2], "data": b"\0" * 8}}],
    }
    base.update(changes)
    return msgpack.packb(base, use_bin_type=True)


def item_message(**changes):
    item = {"type": "image", "grid_thw": [1, 1, 1], "pixels": {"dtype": "float32", "shape": [1, 2], "data": b"\0" * 8}}
    item.update(changes)
    return message(items=[item])


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "not a vitpool message"),
        (b"\x93\x01\x02", "not a vitpool message"),
        (msgpack.packb({"format": "other"}), "not a vitpool message"),
        (message(version=2), "version 2"),
        (message(kind="results"), "expected a vitpool request"),
        (message(items="x"), "'items' must be a list"),
        (message(items=[7]), "item 0 is not a map"),
        (item_message(type="audio"), "type 'audio'"),
        (item_message(grid_thw=[1, 2]), "three integers"),
        (item_message(grid_thw=[1, True, 1]), "three integers"),
        (item_message(pixels={"dtype": "int8", "shape": [1], "data": b"\0"}), "dtype 'int8'"),
        (item_message(pixels={"dtype": "float32", "shape": [1, -2], "data": b""}), "non-negative"),
        (item_message(pixels={"dtype": "float32", "shape": [1, 2], "data": b"\0" * 7}), "7 bytes of data"),
        (item_message(pixels={"dtype": "float32", "shape": [1 << 40, 1 << 40], "data": b""}), "bytes of data"),
        (item_message(pixels={"dtype": "float32", "shape": [2], "data": "text"}), "'data' must be a bytes"),
        (message()[:-3], "not a vitpool message"),
        (message() + b"\x00", "not a vitpool message"),
    ],
)
def test_malformed_requests_raise_value_error_saying_what(data, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        decode_request(data)


def test_a_request_does_not_decode_as_results():
    with pytest.raises(ValueError, match="expected a vitpool results"):
        decode_results(encode_request([Image(torch.zeros(1, 2), (1, 1, 1))]))


def only_value_errors(decode, data) -> None:
    try:
        decode(data)
    except ValueError:
        pass


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data):
    only_value_errors(decode_request, data)
    only_value_errors(decode_results, data)


VALID_REQUEST = encode_request([Image(torch.randn(4, 3), (1, 2, 2)), Video(torch.randn(2, 3).bfloat16(), (2, 1, 1))])
VALID_RESULTS = encode_results([Embedding(torch.randn(2, 3).bfloat16(), [torch.randn(2, 3).bfloat16()])])


@FUZZ
@given(st.data())
def test_fuzz_mutated_valid_messages(data):
    for valid, decode in ((VALID_REQUEST, decode_request), (VALID_RESULTS, decode_results)):
        mutated = bytearray(valid)
        for _ in range(data.draw(st.integers(1, 8))):
            action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
            position = data.draw(st.integers(0, max(0, len(mutated) - 1)))
            if action == "flip" and mutated:
                mutated[position] ^= 1 << data.draw(st.integers(0, 7))
            elif action == "cut":
                del mutated[position:]
            else:
                mutated[position:position] = data.draw(st.binary(min_size=1, max_size=8))
        only_value_errors(decode, bytes(mutated))


@FUZZ
@given(st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=16),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
))
def test_fuzz_well_formed_msgpack_of_any_shape(value):
    for envelope in (value, {"format": "vitpool", "version": 1, "kind": "request", "items": value},
                     {"format": "vitpool", "version": 1, "kind": "results", "embeddings": value}):
        data = msgpack.packb(envelope, use_bin_type=True)
        only_value_errors(decode_request, data)
        only_value_errors(decode_results, data)
