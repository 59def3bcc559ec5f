"""A versioned msgpack format for requests (items) and results (embeddings), for bytes that come
from outside the Ray cluster: a client that is not a Ray worker, a socket, a queue.

Tensors are maps of dtype name, shape and raw little-endian bytes (bfloat16 as its 16-bit
pattern). Nothing is ever unpickled. Decoding checks every field and raises `ValueError` for
bytes that are malformed, truncated or of another version; it never raises anything else.

    request = {"format": "vitpool", "version": 1, "kind": "request",
               "items": [{"type": "image" | "video", "grid_thw": [t, h, w], "pixels": TENSOR}, ...]}
    results = {"format": "vitpool", "version": 1, "kind": "results",
               "embeddings": [{"tokens": TENSOR, "deepstack": [TENSOR, ...]}, ...]}
    TENSOR  = {"dtype": "float32" | "float16" | "bfloat16" | "float64", "shape": [int, ...], "data": bytes}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from vitpool.items import Embedding, Image, Item, Video
from vitpool.transport.wire import WIRE_DTYPES, from_array, to_array, wire_dtype_name

FORMAT = "vitpool"
VERSION = 1
MAX_MESSAGE_BYTES = 1 << 31  # what one message may carry (2 GiB)
MAX_DIMENSIONS = 4
_ITEM_TYPES = {"image": Image, "video": Video}


def encode_request(items: Sequence[Item]) -> bytes:
    """Bytes for a list of Image / Video items (pixels as torch tensors or NumPy arrays)."""
    encoded = []
    for item in items:
        kind = "video" if isinstance(item, Video) else "image"
        grid = [int(n) for n in (item.grid_thw.tolist() if hasattr(item.grid_thw, "tolist") else item.grid_thw)]
        encoded.append({"type": kind, "grid_thw": grid, "pixels": _pack_tensor(torch.as_tensor(item.pixel_values))})
    return _pack("request", {"items": encoded})


def decode_request(data: bytes) -> list[Item]:
    """The items in `data`. Raises ValueError for anything but a well-formed version-1 request.
    The items' shapes against the model are checked later, by `encode`, like any caller's."""
    message = _unpack(data, "request")
    items = _field(message, "items", list)
    decoded: list[Item] = []
    for index, entry in enumerate(items):
        where = f"item {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not a map")
        kind = _field(entry, "type", str, where)
        if kind not in _ITEM_TYPES:
            raise ValueError(f"{where}: type {kind!r} is not one of {sorted(_ITEM_TYPES)}")
        grid = _field(entry, "grid_thw", list, where)
        if len(grid) != 3 or not all(_is_int(n) for n in grid):
            raise ValueError(f"{where}: grid_thw must be three integers, got {grid!r}")
        pixels = _unpack_tensor(_field(entry, "pixels", dict, where), f"{where} pixels")
        decoded.append(_ITEM_TYPES[kind](pixels, tuple(grid)))
    return decoded


def encode_results(embeddings: Sequence[Embedding]) -> bytes:
    """Bytes for a list of Embeddings."""
    encoded = [
        {"tokens": _pack_tensor(e.tokens), "deepstack": [_pack_tensor(d) for d in e.deepstack]} for e in embeddings
    ]
    return _pack("results", {"embeddings": encoded})


def decode_results(data: bytes) -> list[Embedding]:
    """The embeddings in `data`. Raises ValueError for anything but well-formed version-1 results."""
    message = _unpack(data, "results")
    decoded = []
    for index, entry in enumerate(_field(message, "embeddings", list)):
        where = f"embedding {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not a map")
        tokens = _unpack_tensor(_field(entry, "tokens", dict, where), f"{where} tokens")
        deepstack = []
        for number, feature in enumerate(_field(entry, "deepstack", list, where)):
            if not isinstance(feature, dict):
                raise ValueError(f"{where} deepstack {number} is not a map")
            deepstack.append(_unpack_tensor(feature, f"{where} deepstack {number}"))
        decoded.append(Embedding(tokens, deepstack))
    return decoded


# internals


def _pack(kind: str, body: dict) -> bytes:
    return msgpack.packb({"format": FORMAT, "version": VERSION, "kind": kind, **body}, use_bin_type=True)


def _unpack(data: Any, kind: str) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        message = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_bin_len=len(data))
    except Exception as error:  # noqa: BLE001 - msgpack raises several types for bad bytes; callers get one
        raise ValueError(f"not a vitpool message: {type(error).__name__}: {error}") from None
    if not isinstance(message, dict) or message.get("format") != FORMAT:
        raise ValueError("not a vitpool message")
    if message.get("version") != VERSION:
        raise ValueError(f"vitpool message version {message.get('version')!r}; this vitpool reads version {VERSION}")
    if message.get("kind") != kind:
        raise ValueError(f"expected a vitpool {kind}, got {message.get('kind')!r}")
    return message


def _field(message: dict, name: str, kind: type, where: str = "message") -> Any:
    if name not in message:
        raise ValueError(f"{where}: missing {name!r}")
    value = message[name]
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {name!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pack_tensor(tensor: torch.Tensor) -> dict:
    dtype_name = wire_dtype_name(tensor.dtype)
    array = to_array(tensor)
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {"dtype": dtype_name, "shape": list(array.shape), "data": little.tobytes()}


def _unpack_tensor(entry: dict, where: str) -> torch.Tensor:
    dtype_name = _field(entry, "dtype", str, where)
    if dtype_name not in WIRE_DTYPES:
        raise ValueError(f"{where}: dtype {dtype_name!r} is not one of {sorted(WIRE_DTYPES)}")
    shape = _field(entry, "shape", list, where)
    if not 1 <= len(shape) <= MAX_DIMENSIONS or not all(_is_int(n) and n >= 0 for n in shape):
        raise ValueError(f"{where}: shape must be 1 to {MAX_DIMENSIONS} non-negative integers, got {shape!r}")
    data = _field(entry, "data", bytes, where)
    wire_dtype = WIRE_DTYPES[dtype_name][1]
    expected = int(np.prod(shape, dtype=object)) * wire_dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"{where}: {len(data)} bytes of data for shape {shape} of {dtype_name} ({expected} expected)")
    array = np.frombuffer(data, dtype=wire_dtype.newbyteorder("<")).astype(wire_dtype, copy=True).reshape(shape)
    return from_array(array, dtype_name)  # a fresh, writable array: no further copy
