"""The msgpack codec for bytes from outside the cluster: exact round trips (version 2) for every
dtype, shape and grid; version 1 messages still decode; other versions are refused; and a decoder
that answers any other bytes with ValueError (fuzzed with hypothesis)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vitpool import Embedding, Image, Video
from vitpool.codec import decode_request, decode_results, encode_request, encode_results
from vitpool.transport.wire import to_array, wire_dtype_name

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(0, 4), (1, 1), (3, 7), (16, 1536), (5,), (2, 3, 4), (2, 3, 4, 5, 1)]


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


def test_outputs_of_several_shapes_round_trip_in_order():
    outputs = [torch.randn(4, 8), torch.randn(4, 3, 5), torch.randn(4), torch.randn(4, 2, 2, 2)]
    (decoded,) = decode_results(encode_results([Embedding.from_outputs(outputs)]))
    assert len(decoded.outputs) == len(outputs)
    for got, want in zip(decoded.outputs, outputs, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_requests_round_trip_exactly(dtype):
    items = [
        Image(torch.randn(64, 1536).to(dtype), (1, 8, 8)),
        Video(torch.randn(2 * 16, 1536).to(dtype), torch.tensor([2, 4, 4])),
        Image(np.random.default_rng(0).standard_normal((4, 1536)).astype(np.float32), [1, 2, 2]),
        Image(torch.randn(3, 3, 14, 14).to(dtype)),  # tiles, no grid
        Image(torch.randn(2, 3, 4, 4).to(dtype), [[1, 1, 1], [1, 2, np.int64(3)]]),  # nested grid
    ]
    decoded = decode_request(encode_request(items))
    assert [type(i) for i in decoded] == [Image, Video, Image, Image, Image]
    assert [i.grid_thw for i in decoded] == [(1, 8, 8), (2, 4, 4), (1, 2, 2), None, ((1, 1, 1), (1, 2, 3))]
    for got, want in zip(decoded, items):
        assert torch.equal(got.pixel_values, torch.as_tensor(want.pixel_values))


@pytest.mark.parametrize(
    "grid",
    [
        7,  # a bare integer: a grid is a list
        [1, 2.5],  # not integers
        [1, True],  # booleans are not integers
        [[[[[1]]]]],  # nested too deep
    ],
)
def test_a_bad_grid_is_not_encoded(grid):
    with pytest.raises(ValueError, match="grid"):
        encode_request([Image(torch.zeros(1, 2), grid)])


def test_tensors_of_more_than_five_dimensions_are_not_encoded():
    with pytest.raises(ValueError, match="1 to 5 dimensions"):
        encode_results([Embedding(torch.zeros(1, 1, 1, 1, 1, 1))])


def v1_request(items) -> bytes:
    return msgpack.packb(
        {"format": "vitpool", "version": 1, "kind": "request", "items": items}, use_bin_type=True
    )


def tensor_entry(tensor: torch.Tensor) -> dict:
    """A TENSOR map as every version writes it."""
    array = to_array(tensor)
    return {
        "dtype": wire_dtype_name(tensor.dtype),
        "shape": list(array.shape),
        "data": array.astype(array.dtype.newbyteorder("<")).tobytes(),
    }


def test_version_1_requests_decode_into_the_same_items():
    pixels = [torch.randn(16, 12), torch.randn(8, 12).bfloat16()]
    data = v1_request(
        [
            {"type": "image", "grid_thw": [1, 4, 4], "pixels": tensor_entry(pixels[0])},
            {"type": "video", "grid_thw": [2, 2, 2], "pixels": tensor_entry(pixels[1])},
        ]
    )
    decoded = decode_request(data)
    assert [type(i) for i in decoded] == [Image, Video]
    assert [i.grid_thw for i in decoded] == [(1, 4, 4), (2, 2, 2)]
    for got, want in zip(decoded, pixels):
        assert got.pixel_values.dtype == want.dtype and torch.equal(got.pixel_values, want)


def test_version_1_results_decode_into_the_same_embeddings():
    tokens, deepstack = torch.randn(3, 8).bfloat16(), [torch.randn(3, 8).bfloat16() for _ in range(2)]
    data = msgpack.packb(
        {
            "format": "vitpool",
            "version": 1,
            "kind": "results",
            "embeddings": [
                {"tokens": tensor_entry(tokens), "deepstack": [tensor_entry(d) for d in deepstack]}
            ],
        },
        use_bin_type=True,
    )
    (decoded,) = decode_results(data)
    assert torch.equal(decoded.tokens, tokens)
    assert len(decoded.deepstack) == 2 and all(
        torch.equal(g, w) for g, w in zip(decoded.deepstack, deepstack)
    )


def test_an_empty_list_round_trips():
    assert decode_request(encode_request([])) == []
    assert decode_results(encode_results([])) == []


PIXELS = {"dtype": "float32", "shape": [1, 2], "data": b"\0" * 8}


def message(**changes):
    base = {
        "format": "vitpool",
        "version": 2,
        "kind": "request",
        "items": [{"modality": "image", "grid": [1, 1, 1], "pixels": PIXELS}],
    }
    base.update(changes)
    return msgpack.packb(base, use_bin_type=True)


def item_message(**changes):
    item = {"modality": "image", "grid": [1, 1, 1], "pixels": PIXELS}
    item.update(changes)
    return message(items=[item])


def v1_item_message(**changes):
    item = {"type": "image", "grid_thw": [1, 1, 1], "pixels": PIXELS}
    item.update(changes)
    return message(version=1, items=[item])


def results_message(*embeddings, version=2):
    return msgpack.packb(
        {"format": "vitpool", "version": version, "kind": "results", "embeddings": list(embeddings)}
    )


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "not a vitpool message"),
        (b"\x93\x01\x02", "not a vitpool message"),
        (msgpack.packb({"format": "other"}), "not a vitpool message"),
        (message(version=9), "version 9; this vitpool reads versions 1, 2, 3 and writes version 2"),
        (message(version=0), "version 0"),
        (message(version=True), "version True"),  # True == 1, but not a version
        (message(version="2"), "version '2'"),
        (message(kind="results"), "expected a vitpool request"),
        (message(items="x"), "'items' must be a list"),
        (message(items=[7]), "item 0 is not a map"),
        (item_message(modality="audio"), "modality 'audio'"),
        (item_message(modality=None), "'modality' must be a str"),
        (item_message(grid=[1, 2.5]), "'grid' must be nil or a list of integers"),
        (item_message(grid=[1, True]), "'grid' must be nil or a list of integers"),
        (item_message(grid=7), "'grid' must be nil or a list of integers"),
        (item_message(grid=[[[[[1]]]]]), "nested at most 4 deep"),
        (message(items=[{"modality": "image", "pixels": PIXELS}]), "missing 'grid'"),
        (item_message(pixels={"dtype": "int8", "shape": [1], "data": b"\0"}), "dtype 'int8'"),
        (item_message(pixels={"dtype": "float32", "shape": [1, -2], "data": b""}), "non-negative"),
        (item_message(pixels={"dtype": "float32", "shape": [], "data": b""}), "1 to 5 non-negative"),
        (
            item_message(pixels={"dtype": "float32", "shape": [1] * 6, "data": b"\0" * 4}),
            "1 to 5 non-negative",
        ),
        (item_message(pixels={"dtype": "float32", "shape": [1, 2], "data": b"\0" * 7}), "7 bytes of data"),
        (
            item_message(pixels={"dtype": "float32", "shape": [1 << 40, 1 << 40], "data": b""}),
            "bytes of data",
        ),
        (item_message(pixels={"dtype": "float32", "shape": [2], "data": "text"}), "'data' must be a bytes"),
        (v1_item_message(type="audio"), "type 'audio'"),
        (v1_item_message(grid_thw=[1, 2]), "three integers"),
        (v1_item_message(grid_thw=[1, True, 1]), "three integers"),
        (message(version=1), "missing 'type'"),  # a version 2 item under version 1
        (message()[:-3], "not a vitpool message"),
        (message() + b"\x00", "not a vitpool message"),
    ],
)
def test_malformed_requests_raise_value_error_saying_what(data, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        decode_request(data)


@pytest.mark.parametrize(
    "data, words",
    [
        (results_message(version=3), "version 3"),
        (results_message(7), "embedding 0 is not a map"),
        (results_message({"outputs": []}), "'outputs' is empty"),
        (results_message({"outputs": [7]}), "embedding 0 output 0 is not a map"),
        (results_message({"tokens": PIXELS, "deepstack": []}), "missing 'outputs'"),  # version 1 under 2
        (results_message({"outputs": [PIXELS]}, version=1), "missing 'tokens'"),
        (
            results_message({"tokens": PIXELS, "deepstack": [1]}, version=1),
            "embedding 0 deepstack 0 is not a map",
        ),
    ],
)
def test_malformed_results_raise_value_error_saying_what(data, words):
    with pytest.raises(ValueError, match=words):
        decode_results(data)


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


VALID_REQUEST = encode_request(
    [
        Image(torch.randn(4, 3), (1, 2, 2)),
        Video(torch.randn(2, 3).bfloat16(), (2, 1, 1)),
        Image(torch.randn(1, 3, 2, 2)),
    ]
)
VALID_RESULTS = encode_results([Embedding(torch.randn(2, 3).bfloat16(), [torch.randn(2, 3, 2).bfloat16()])])


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
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=8)
        | st.binary(max_size=16),
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_fuzz_well_formed_msgpack_of_any_shape(value):
    envelopes = [value]
    for version in (1, 2):
        envelopes += [
            {"format": "vitpool", "version": version, "kind": "request", "items": value},
            {"format": "vitpool", "version": version, "kind": "results", "embeddings": value},
        ]
    # any value in each field of an otherwise valid item or embedding
    envelopes += [
        {
            "format": "vitpool",
            "version": 2,
            "kind": "request",
            "items": [{"modality": "image", "grid": value, "pixels": PIXELS}],
        },
        {
            "format": "vitpool",
            "version": 2,
            "kind": "request",
            "items": [{"modality": "video", "grid": None, "pixels": value}],
        },
        {"format": "vitpool", "version": 2, "kind": "results", "embeddings": [{"outputs": [PIXELS, value]}]},
    ]
    for envelope in envelopes:
        data = msgpack.packb(envelope, use_bin_type=True)
        only_value_errors(decode_request, data)
        only_value_errors(decode_results, data)


def test_an_item_of_several_inputs_travels_as_version_3_and_version_2_refuses_them():
    """Step-3.7's and DeepSeek-OCR-2's crops (`Image.inputs`) travel beside the global view; such a
    request is version 3, so a reader of version 2 refuses it rather than drop the crops."""
    crops = torch.randn(2, 3, 4, 4)
    data = encode_request(
        [Image(torch.randn(1, 3, 8, 8), None, {"pixel_values_local": crops}), Image(torch.randn(2, 3))]
    )
    assert msgpack.unpackb(data)["version"] == 3
    first, second = decode_request(data)
    assert torch.equal(first.inputs["pixel_values_local"], crops) and second.inputs is None
    assert msgpack.unpackb(encode_request([Image(torch.randn(2, 3))]))["version"] == 2  # as before
    entry = {
        "modality": "image",
        "grid": None,
        "pixels": msgpack.unpackb(data)["items"][0]["pixels"],
        "inputs": msgpack.unpackb(data)["items"][0]["inputs"],
    }
    with pytest.raises(ValueError, match="'inputs' need version 3; this message is version 2"):
        decode_request(message(items=[entry]))
