"""The shared-memory segments of the same-node channel (`vitpool.transport.channel`).

A caller owns its segments: files under /dev/shm that it creates, maps, and unlinks once the actor
has mapped them too. It writes a batch's pixels into one; the actor writes the outputs back, by
DMA on a GPU (its mappings are registered with CUDA).

Outputs go to an output segment whose memory the caller's results view directly, with no copy,
and that is used again only once those results are gone (`OutputSegments`). When every output
segment of a connection is still held by results, or a batch's outputs are large, the outputs go
after the pixels in the batch's own segment and are copied out.
"""

from __future__ import annotations

import collections
import logging
import math
import mmap
import os
import tempfile
import uuid
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from vitpool.specs import is_int
from vitpool.transport.wire import WIRE_DTYPES

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "vitpool-segment-"
MIN_SEGMENT_BYTES = 1 << 20
ALIGNMENT = 64
# Output segments per connection that results may hold, and the largest batch outputs that go to
# one: past that, a copy costs little next to the encode, and shared memory stays bounded.
OUTPUT_SEGMENTS_PER_CONNECTION = 4
MAX_OUTPUT_SEGMENT_BYTES = 32 << 20
# A caller tells the actor which of its segments it closed, so an actor's connection maps only
# live ones (a pixel segment and the output segments). Past this many it closes the least
# recently used: a caller that never says would otherwise grow the actor's mappings for ever.
MAX_MAPPED_PER_CONNECTION = 32
# Pixels have 1 to 5 dimensions (rows, or tiles [N, C, P, P], ...); an output tensor has one more
# than its row shape. A bound keeps a peer's shape list small.
MAX_ARRAY_DIMENSIONS = 8


def shm_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def segment_size(nbytes: int) -> int:
    """Segments grow in powers of two, so a connection replaces its segment rarely."""
    return max(MIN_SEGMENT_BYTES, 1 << (nbytes - 1).bit_length())


def array_at(buffer: mmap.mmap, dtype_name: str, offset: int, shape: Sequence[int]) -> np.ndarray:
    """A view of `buffer` as an array of `shape` (1 to MAX_ARRAY_DIMENSIONS dimensions) and wire
    dtype `dtype_name`, starting at byte `offset`; ValueError if it does not lie inside.

    Every value may come from a peer, so each is checked before NumPy sees it.
    """
    if dtype_name not in WIRE_DTYPES:
        raise ValueError(f"unknown dtype {dtype_name!r}")
    dtype = WIRE_DTYPES[dtype_name][1]
    if (
        not isinstance(shape, (list, tuple))
        or not 1 <= len(shape) <= MAX_ARRAY_DIMENSIONS
        or any(not is_int(n) or n < 0 for n in shape)
    ):
        raise ValueError(f"bad shape {shape!r}: 1 to {MAX_ARRAY_DIMENSIONS} non-negative integers are needed")
    # as Python integers (NumPy's would wrap around): a huge shape cannot overflow past the check below
    shape = tuple(int(n) for n in shape)
    count = math.prod(shape)
    if not is_int(offset) or offset < 0 or int(offset) + count * dtype.itemsize > len(buffer):
        raise ValueError(f"{count} values at offset {offset} do not fit the {len(buffer)}-byte segment")
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=int(offset)).reshape(shape)


# the caller's side


class OwnedSegment:
    """A segment the caller created. Its name carries a random part, so a name is never used
    twice while an actor may still have the old file mapped."""

    def __init__(self, size: int) -> None:
        prefix = f"{SEGMENT_PREFIX}{uuid.uuid4().hex}-"
        descriptor, self.path = tempfile.mkstemp(prefix=prefix, dir=shm_directory())
        try:
            os.ftruncate(descriptor, size)
            self.buffer = mmap.mmap(descriptor, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(descriptor)
        self.size = size
        self._held = False  # taken for a batch, or its results view it (output segments only)
        self._viewer: weakref.ref | None = None  # the array the results view, while they may live
        self._linked = True

    @property
    def held(self) -> bool:
        """Whether the segment is taken: by a batch in flight, or by results that still view it
        (`hold_while_viewed`): those let it go when the last of them is gone, which is found here,
        lazily, rather than by a finalizer per batch (a finalizer costs the caller a few µs a call)."""
        viewer = self._viewer
        if viewer is not None and viewer() is None:
            self._viewer = None
            self._held = False
        return self._held

    @held.setter
    def held(self, value: bool) -> None:
        self._held = value
        self._viewer = None

    def hold_while_viewed(self, view: np.ndarray) -> None:
        """Stay held until `view` (the array the results' tensors view) is gone."""
        self._viewer = weakref.ref(view)

    def release(self) -> None:
        """No batch or results hold it any more (a batch that gave no results)."""
        self.held = False

    def unlink(self) -> None:
        if self._linked:
            self._linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        try:
            self.buffer.close()
        except BufferError:
            pass  # results still view it; the mapping goes with the last of them


class OutputSegments:
    """One connection's output segments: where a batch's outputs go when results may keep them."""

    def __init__(self) -> None:
        self._segments: list[OwnedSegment] = []
        self.closed_paths: list[str] = []  # replaced since the actor was last told

    def take(self, nbytes: int) -> OwnedSegment | None:
        """A segment of at least `nbytes` that no results hold, now held; None if there is none
        to be had (the outputs then go to the batch's own segment and are copied out)."""
        if nbytes > MAX_OUTPUT_SEGMENT_BYTES:
            return None
        free = [segment for segment in self._segments if not segment.held]
        fitting = [segment for segment in free if segment.size >= nbytes]
        if fitting:
            chosen = min(fitting, key=lambda segment: segment.size)
        elif free or len(self._segments) < OUTPUT_SEGMENTS_PER_CONNECTION:
            if free:  # too small: replace the smallest free one
                smallest = min(free, key=lambda segment: segment.size)
                self._segments.remove(smallest)
                smallest.close()
                self.closed_paths.append(smallest.path)
            chosen = OwnedSegment(segment_size(nbytes))
            self._segments.append(chosen)
        else:
            return None
        chosen.held = True
        return chosen

    def close(self) -> None:
        for segment in self._segments:
            segment.close()
        self._segments = []


# the actor's side


class MappedSegment:
    """A caller's segment, mapped by the actor; only vitpool segment files are accepted."""

    def __init__(self, path: object, size: object, cuda_device: torch.device | None) -> None:
        if not isinstance(path, str) or not isinstance(size, int) or size <= 0:
            raise ValueError("a request must name its segment and size")
        directory = os.path.realpath(shm_directory())
        resolved = os.path.realpath(path)
        if os.path.dirname(resolved) != directory or not os.path.basename(resolved).startswith(
            SEGMENT_PREFIX
        ):
            raise ValueError(f"{path!r} is not a vitpool segment")
        descriptor = os.open(resolved, os.O_RDWR)
        try:
            if os.fstat(descriptor).st_size < size:
                raise ValueError(f"segment {path!r} is smaller than {size} bytes")
            self.buffer = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        self.path = path
        self.size = size
        self._registered = None
        if cuda_device is not None:
            address = np.frombuffer(self.buffer, dtype=np.uint8).ctypes.data
            with torch.cuda.device(cuda_device):
                if torch.cuda.cudart().cudaHostRegister(address, size, 0) == 0:
                    self._registered = (cuda_device, address)
                else:
                    logger.warning("could not register a %d-byte segment with CUDA; copies are staged", size)

    def close(self) -> None:
        if self._registered is not None:
            device, address = self._registered
            with torch.cuda.device(device):
                torch.cuda.current_stream(device).synchronize()
                torch.cuda.cudart().cudaHostUnregister(address)
        try:
            self.buffer.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it does


class MappedSegments:
    """The segments one connection's caller has named, mapped once each (mapping and registering
    with CUDA cost far more than a batch's copies) until the caller says it closed them.

    A caller unlinks a segment once the actor has mapped it, so a mapping closed while the caller
    still uses the segment could not be made again: only the caller's word closes one, or, as a
    bound, more than MAX_MAPPED_PER_CONNECTION mappings.
    """

    def __init__(self, cuda_device: torch.device | None) -> None:
        self._cuda_device = cuda_device
        self._mapped: collections.OrderedDict[str, MappedSegment] = collections.OrderedDict()

    def get(self, path: object, size: object) -> MappedSegment:
        segment = self._mapped.get(path) if isinstance(path, str) else None
        if segment is not None and segment.size == size:
            self._mapped.move_to_end(path)
            return segment
        if segment is not None:  # named with another size: map it again, checked again
            self._mapped.pop(path).close()
        segment = MappedSegment(path, size, self._cuda_device)
        self._mapped[path] = segment
        while len(self._mapped) > MAX_MAPPED_PER_CONNECTION:
            stale_path, stale = self._mapped.popitem(last=False)
            logger.warning(
                "closing segment %s: its caller has %d mapped and never said it closed any",
                stale_path,
                len(self._mapped),
            )
            stale.close()
        return segment

    def forget(self, paths: object) -> None:
        """Close the mappings of segments the caller closed (a list of paths; anything else is
        ignored)."""
        if not isinstance(paths, list):
            return
        for path in paths:
            segment = self._mapped.pop(path, None) if isinstance(path, str) else None
            if segment is not None:
                segment.close()

    def close(self) -> None:
        for segment in self._mapped.values():
            segment.close()
        self._mapped.clear()
