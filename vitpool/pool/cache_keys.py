"""The embedding cache's keys: what a model is (`model_identity`, its checkpoint's content and
dtype) and the key of one checked item under it (`item_key`)."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from vitpool.transport.wire import to_array

_SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "models" / "checkpoints" / "tiny-qwen3-vl"


def model_identity(model: str | Path | None, dtype_name: str) -> bytes:
    """What a model is, for every key that names its embeddings (this cache's; the vLLM gateway's
    image uuids, `vitpool.integrations.vllm.images.model_prefix`), as 16 bytes: a 128-bit XXH3
    digest of the dtype its embeddings come out in, its checkpoint's config.json, and its weights'
    content: of each tensor of its safetensors files (by name, whatever the shards), its dtype,
    shape and size and its first WEIGHT_SAMPLE_BYTES.

    Content, not place: no path and no modification time go in, so every process on every node
    that holds the checkpoint (a copy, another mount, a symlink) gets the same identity, and other
    weights give another (training changes every trained tensor's bytes; another dtype or shape
    its header). Cheap: one small read per tensor, whatever the model's size (a full checkpoint's
    language weights included), without the engine (json and file reads: a pool's callers import
    no model code). A checkpoint this process cannot see (a caller beside the cluster) is its name
    and the dtype: its keys then meet only those of callers that cannot see it either (misses,
    never a wrong hit). None: the shipped tiny model.
    """
    directory = Path(model) if model is not None else _SHIPPED_MODEL
    hasher = xxhash.xxh3_128()
    hasher.update(f"{dtype_name}\0".encode())
    config = directory / "config.json"
    if not config.is_file():
        hasher.update(f"not here: {model}\0".encode())
        return hasher.digest()
    hasher.update(config.read_bytes())
    tensors = sorted(sample for path in sorted(directory.glob("*.safetensors")) for sample in _samples(path))
    for name, digest in tensors:
        hasher.update(f"\0{name}\0".encode())
        hasher.update(digest)
    return hasher.digest()


WEIGHT_SAMPLE_BYTES = 4096  # of each tensor's data, what `model_identity` reads


def _samples(path: Path) -> list[tuple[str, bytes]]:
    """Per tensor of a safetensors file, its name and a digest of its header entry and its first
    WEIGHT_SAMPLE_BYTES. A file that is not safetensors is its name and a digest of its size and
    first bytes (its actor refuses it as it loads)."""
    with path.open("rb") as file:
        try:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length)) if length <= _MAX_HEADER_BYTES else None
            tensors = {
                name: (str(entry["dtype"]), entry["shape"], *_offsets(entry["data_offsets"]))
                for name, entry in header.items()
                if name != "__metadata__"
            }
        except (struct.error, ValueError, TypeError, KeyError, AttributeError):
            file.seek(0)
            unread = f"{path.stat().st_size}\0".encode() + file.read(WEIGHT_SAMPLE_BYTES)
            return [(f"{path.name} (not safetensors)", xxhash.xxh3_128_digest(unread))]
        samples = []
        for name, (dtype, shape, begin, end) in sorted(tensors.items(), key=lambda each: each[1][2]):
            file.seek(8 + length + begin)
            sample = xxhash.xxh3_128(f"{dtype}|{shape}|{end - begin}\0".encode())
            sample.update(file.read(min(end - begin, WEIGHT_SAMPLE_BYTES)))
            samples.append((name, sample.digest()))
    return samples


_MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a header


def _offsets(pair: Any) -> tuple[int, int]:
    begin, end = pair
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
        raise ValueError(f"not a tensor's data offsets: {pair!r}")
    return begin, end


def item_key(identity: bytes, parts: Sequence[Any]) -> bytes:
    """The 16-byte key of one checked item (its `parts`, each with `.spec` and `.pixels`)."""
    hasher = xxhash.xxh3_128(identity)
    for part in parts:
        spec = part.spec
        hasher.update(
            f"{spec.modality}|{spec.pixel_shape}|{spec.pixel_dtype}|{spec.layout}|{spec.path}\0".encode()
        )
        hasher.update(np.ascontiguousarray(to_array(part.pixels)))
    return hasher.digest()
