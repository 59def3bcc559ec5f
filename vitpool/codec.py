"""A versioned msgpack format for requests (items) and results (embeddings), for bytes that come
from outside the Ray cluster: a client that is not a Ray worker, a socket, a queue.

Tensors are maps of dtype name, shape and raw little-endian bytes (bfloat16 as its 16-bit
pattern). Nothing is ever unpickled. Decoding checks every field and raises `ValueError` for
bytes that are malformed, truncated or of a version this vitpool does not read; it never raises
anything else. It knows no model: an item's grid is whatever integers its family's processor
emitted (checked against the model later, by `encode`, like any caller's items).

Version 2 (written, for requests whose items are one tensor each, and for results):

    request = {"format": "vitpool", "version": 2, "kind": "request",
               "items": [{"modality": "image" | "video", "grid": GRID, "pixels": TENSOR}, ...]}
    results = {"format": "vitpool", "version": 2, "kind": "results",
               "embeddings": [{"outputs": [TENSOR, ...]}, ...]}   # tokens first, then extras
    GRID    = nil | [int | GRID, ...]                              # e.g. [t, h, w]; nil for tiles
    TENSOR  = {"dtype": "float32" | "float16" | "bfloat16" | "float64",
               "shape": [int, ...] (1 to 5 dimensions), "data": bytes}

Version 3 (written for requests with an item of several inputs; results stay version 2): a
version 2 request whose items may also carry `"inputs": {name: TENSOR, ...}`, the item's further
pixel tensors (`Image.inputs`: Step-3.7's and DeepSeek-OCR-2's crops). A reader of version 2
refuses it by its version rather than drop the crops.

Version 1 (still read): items {"type": "image" | "video", "grid_thw": [t, h, w], "pixels": TENSOR},
embeddings {"tokens": TENSOR, "deepstack": [TENSOR, ...]}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from vitpool.items import Embedding, Image, Item, Video
from vitpool.specs import is_int
from vitpool.transport.wire import WIRE_DTYPES, from_array, to_array, wire_dtype_name

FORMAT = "vitpool"
VERSION = 2  # written (requests with items of several inputs: INPUTS_VERSION)
INPUTS_VERSION = 3
READ_VERSIONS = (1, 2, 3)
MAX_MESSAGE_BYTES = 1 << 31  # what one message may carry (2 GiB)
MAX_DIMENSIONS = 5
MAX_GRID_DEPTH = 4  # lists in lists: per-image grids of a tiled item, and so on
_ITEM_TYPES = {"image": Image, "video": Video}


def encode_request(items: Sequence[Item]) -> bytes:
    """Bytes (version 2) for a list of Image / Video items (pixels as torch tensors or NumPy
    arrays; grids as integers, nested sequences of them, tensors, arrays, or None)."""
    encoded = []
    for index, item in enumerate(items):
        modality = "video" if isinstance(item, Video) else "image"
        pixels = _pack_tensor(torch.as_tensor(item.pixel_values))
        grid = _grid_to_wire(item.grid_thw, f"item {index}")
        entry = {"modality": modality, "grid": grid, "pixels": pixels}
        if item.inputs:
            entry["inputs"] = {
                str(name): _pack_tensor(torch.as_tensor(tensor)) for name, tensor in item.inputs.items()
            }
        encoded.append(entry)
    several = any("inputs" in entry for entry in encoded)
    return _pack("request", {"items": encoded}, INPUTS_VERSION if several else VERSION)


def decode_request(data: bytes) -> list[Item]:
    """The items in `data` (a version 1 or 2 request). Raises ValueError for anything else.
    The items' shapes against the model are checked later, by `encode`, like any caller's."""
    message, version = _unpack(data, "request")
    items = _field(message, "items", list)
    if version == 1:
        return [_item_v1(entry, f"item {index}") for index, entry in enumerate(items)]
    return [_item_v2(entry, f"item {index}", version) for index, entry in enumerate(items)]


def encode_results(embeddings: Sequence[Embedding]) -> bytes:
    """Bytes (version 2) for a list of Embeddings."""
    encoded = [{"outputs": [_pack_tensor(tensor) for tensor in e.outputs]} for e in embeddings]
    return _pack("results", {"embeddings": encoded})


def decode_results(data: bytes) -> list[Embedding]:
    """The embeddings in `data` (version 1 or 2 results). Raises ValueError for anything else."""
    message, version = _unpack(data, "results")
    if version > VERSION:
        raise ValueError(f"results of version {version}; results are written as version {VERSION} or 1")
    decoded = []
    for index, entry in enumerate(_field(message, "embeddings", list)):
        where = f"embedding {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not a map")  # noqa: TRY004 - decoding raises only ValueError
        if version == 2:
            outputs = _tensors(_field(entry, "outputs", list, where), f"{where} output")
            if not outputs:
                raise ValueError(f"{where}: 'outputs' is empty; the tokens come first")
            decoded.append(Embedding.from_outputs(outputs))
        else:
            tokens = _unpack_tensor(_field(entry, "tokens", dict, where), f"{where} tokens")
            deepstack = _tensors(_field(entry, "deepstack", list, where), f"{where} deepstack")
            decoded.append(Embedding(tokens, deepstack))
    return decoded


# items of each version


def _item_v2(entry: Any, where: str, version: int = 2) -> Item:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not a map")  # noqa: TRY004 - decoding raises only ValueError
    modality = _field(entry, "modality", str, where)
    if modality not in _ITEM_TYPES:
        raise ValueError(f"{where}: modality {modality!r} is not one of {sorted(_ITEM_TYPES)}")
    if "grid" not in entry:
        raise ValueError(f"{where}: missing 'grid' (nil for an item without one)")
    grid = _grid_from_wire(entry["grid"], where)
    pixels = _unpack_tensor(_field(entry, "pixels", dict, where), f"{where} pixels")
    inputs = None
    if "inputs" in entry:
        if version < INPUTS_VERSION:
            raise ValueError(
                f"{where}: 'inputs' need version {INPUTS_VERSION}; this message is version {version}"
            )
        named = _field(entry, "inputs", dict, where)
        if not all(isinstance(name, str) for name in named):
            raise ValueError(f"{where}: 'inputs' must map names (strings) to tensors")
        inputs = {
            name: _unpack_tensor(_field(named, name, dict, where), f"{where} input {name!r}")
            for name in named
        }
    return _ITEM_TYPES[modality](pixels, grid, inputs)


def _item_v1(entry: Any, where: str) -> Item:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not a map")  # noqa: TRY004 - decoding raises only ValueError
    kind = _field(entry, "type", str, where)
    if kind not in _ITEM_TYPES:
        raise ValueError(f"{where}: type {kind!r} is not one of {sorted(_ITEM_TYPES)}")
    grid = _field(entry, "grid_thw", list, where)
    if len(grid) != 3 or not all(is_int(n) for n in grid):
        raise ValueError(f"{where}: grid_thw must be three integers, got {grid!r}")
    pixels = _unpack_tensor(_field(entry, "pixels", dict, where), f"{where} pixels")
    return _ITEM_TYPES[kind](pixels, tuple(grid))


def _grid_to_wire(grid: Any, where: str, depth: int = 0) -> Any:
    if grid is None and depth == 0:
        return None
    if hasattr(grid, "tolist"):  # a tensor or an array (or a NumPy integer)
        grid = grid.tolist()
    if is_int(grid) and depth > 0:
        return int(grid)
    if isinstance(grid, (list, tuple)) and depth < MAX_GRID_DEPTH:
        return [_grid_to_wire(value, where, depth + 1) for value in grid]
    raise ValueError(
        f"{where}: a grid is None or a list of integers (nested at most {MAX_GRID_DEPTH} deep), got {grid!r}"
    )


def _grid_from_wire(grid: Any, where: str, depth: int = 0) -> Any:
    """nil, or the lists of integers as tuples (nested as they came)."""
    if grid is None and depth == 0:
        return None
    if is_int(grid) and depth > 0:
        return grid
    if isinstance(grid, list) and depth < MAX_GRID_DEPTH:
        return tuple(_grid_from_wire(value, where, depth + 1) for value in grid)
    raise ValueError(
        f"{where}: 'grid' must be nil or a list of integers (nested at most {MAX_GRID_DEPTH} deep)"
    )


# internals


def _pack(kind: str, body: dict, version: int = VERSION) -> bytes:
    return msgpack.packb({"format": FORMAT, "version": version, "kind": kind, **body}, use_bin_type=True)


def _unpack(data: Any, kind: str) -> tuple[dict, int]:
    """The message and its version."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"expected bytes, got {type(data).__name__}")  # noqa: TRY004 - as all decoding errors
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        message = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_bin_len=len(data))
    except Exception as error:  # noqa: BLE001 - msgpack raises several types for bad bytes; callers get one
        raise ValueError(f"not a vitpool message: {type(error).__name__}: {error}") from None
    if not isinstance(message, dict) or message.get("format") != FORMAT:
        raise ValueError("not a vitpool message")
    version = message.get("version")
    if not is_int(version) or version not in READ_VERSIONS:  # True == 1 in Python: not a version
        raise ValueError(
            f"vitpool message version {version!r}; this vitpool reads versions "
            f"{', '.join(map(str, READ_VERSIONS))} and writes version {VERSION}"
        )
    if message.get("kind") != kind:
        raise ValueError(f"expected a vitpool {kind}, got {message.get('kind')!r}")
    return message, version


def _field(message: dict, name: str, kind: type, where: str = "message") -> Any:
    if name not in message:
        raise ValueError(f"{where}: missing {name!r}")
    value = message[name]
    if not isinstance(value, kind):
        raise ValueError(  # noqa: TRY004 - decoding raises only ValueError
            f"{where}: {name!r} must be a {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _tensors(entries: list, where: str) -> list[torch.Tensor]:
    tensors = []
    for number, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{where} {number} is not a map")  # noqa: TRY004 - decoding raises ValueError
        tensors.append(_unpack_tensor(entry, f"{where} {number}"))
    return tensors


def _pack_tensor(tensor: torch.Tensor) -> dict:
    dtype_name = wire_dtype_name(tensor.dtype)
    array = to_array(tensor)
    if not 1 <= array.ndim <= MAX_DIMENSIONS:  # what the decoder would refuse
        raise ValueError(f"a tensor of shape {tuple(array.shape)}: 1 to {MAX_DIMENSIONS} dimensions travel")
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {"dtype": dtype_name, "shape": list(array.shape), "data": little.tobytes()}


def _unpack_tensor(entry: dict, where: str) -> torch.Tensor:
    dtype_name = _field(entry, "dtype", str, where)
    if dtype_name not in WIRE_DTYPES:
        raise ValueError(f"{where}: dtype {dtype_name!r} is not one of {sorted(WIRE_DTYPES)}")
    shape = _field(entry, "shape", list, where)
    if not 1 <= len(shape) <= MAX_DIMENSIONS or not all(is_int(n) and n >= 0 for n in shape):
        raise ValueError(f"{where}: shape must be 1 to {MAX_DIMENSIONS} non-negative integers, got {shape!r}")
    data = _field(entry, "data", bytes, where)
    wire_dtype = WIRE_DTYPES[dtype_name][1]
    expected = int(np.prod(shape, dtype=object)) * wire_dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"{where}: {len(data)} bytes of data for shape {shape} of {dtype_name} ({expected} expected)"
        )
    array = (
        np.frombuffer(data, dtype=wire_dtype.newbyteorder("<")).astype(wire_dtype, copy=True).reshape(shape)
    )
    return from_array(array, dtype_name)  # a fresh, writable array: no further copy
