"""Plain data that crosses every layer: the inputs (Image, Video) and the output (Embedding).

Inputs are checked when they are encoded, not when they are built, so that an error can name
the item's position in the caller's list.

An `Embedding` pickles its tensors as NumPy arrays (see `vitpool.wire`), which Ray moves through
its object store without pickling torch storage, so `ray.get` on a pool's result reference gives
an `Embedding`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vitpool.wire import from_array, to_array, wire_dtype_name


@dataclass
class Image:
    """One image as the model's processor emits it.

    Args:
        pixel_values: flattened patches [t*h*w, C*T*P*P] (torch tensor or NumPy array, floating
            point), in the processor's order (merge blocks contiguous).
        grid_thw: (t, h, w) in patches; t is 1 for an image.
    """

    pixel_values: Any
    grid_thw: Any


@dataclass
class Video:
    """One video clip: like `Image`, with t temporal patches (frames / temporal patch size)."""

    pixel_values: Any
    grid_thw: Any


Item = Image | Video


@dataclass
class Embedding:
    """The encoder's output for one item.

    Attributes:
        tokens: merged output tokens [num_tokens, hidden] (the LLM's embedding width).
        deepstack: per-deepstack-layer features, each [num_tokens, hidden]; empty for models
            without deepstack.
    """

    tokens: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)

    def __reduce__(self) -> tuple:
        dtype_name = wire_dtype_name(self.tokens.dtype)
        return _embedding_from_arrays, (dtype_name, to_array(self.tokens), [to_array(d) for d in self.deepstack])


_sharing = threading.local()


@contextlib.contextmanager
def shared_results() -> Iterator[None]:
    """Within it, Embeddings fetched from Ray's object store (`ray.get` on `encode_refs` results)
    are read-only views of the node's shared memory instead of private copies: every worker on
    the node reads the same bytes, with no copy per rank. Do not write into them (the process
    would crash); clone one to write, or move it to a GPU, which copies anyway."""
    previous = getattr(_sharing, "on", False)
    _sharing.on = True
    try:
        yield
    finally:
        _sharing.on = previous


def _embedding_from_arrays(dtype_name: str, tokens: np.ndarray, deepstack: list[np.ndarray]) -> Embedding:
    copy = not getattr(_sharing, "on", False)
    return Embedding(
        from_array(tokens, dtype_name, copy_read_only=copy),
        [from_array(d, dtype_name, copy_read_only=copy) for d in deepstack],
    )


ItemMetadata = tuple[bool, tuple[int, int, int], str]  # (is video, grid, pixels' dtype name)


def item_from_wire(metadata: ItemMetadata, pixels: np.ndarray) -> Item:
    """An item as an encoder actor receives it: metadata, and pixels as sent by `to_array`.

    The pixels share the received buffer, which may be read-only (Ray's object store): the
    encoder only reads them.
    """
    is_video, grid, dtype_name = metadata
    tensor = from_array(pixels, dtype_name, copy_read_only=False)
    return Video(tensor, grid) if is_video else Image(tensor, grid)
