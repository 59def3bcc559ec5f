"""The actor's end of the same-node channel: serves batches to callers on its node, one thread
per connection. It rebuilds each item's pixels from the plan's specs, runs the batch through the
function it was given, and writes every item's outputs where the caller asked (see
`vitpool.transport.channel_protocol` for the messages and the output layout)."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import struct
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from vitpool.specs import BatchPlan, OutputLayout, plan_from_wire
from vitpool.transport.channel_protocol import (
    ERROR,
    ChannelInfo,
    item_output_offsets,
    receive_message,
    send_message,
    spin_until_readable,
)
from vitpool.transport.embedding import Embedding
from vitpool.transport.link import BatchReceipt
from vitpool.transport.shared_memory import MappedSegments, array_at
from vitpool.transport.wire import to_array, wire_dtype_name

logger = logging.getLogger(__name__)

# One batch as the actor runs it: its plan, per item its pixels (views of the caller's segment,
# valid only during the call), and where the outputs should be (None: on the encoder's device).
BatchFunction = Callable[
    [BatchPlan, list[np.ndarray], str | None], tuple[list[Embedding | None], BatchReceipt]
]


class ChannelServer:
    """Serves batches to same-node callers from the actor's process, one thread per connection.

    Args:
        run_batch: runs one batch (`EncoderActor.run_batch`).
        name: part of the socket's name, for whoever lists sockets.
        device: the encoder's device. On a GPU the segments are registered with CUDA: pixels go
            to the device and outputs come back by DMA, with no staging copy; outputs are then
            asked for on the device (`output_device=None`), else on the CPU.
        spin_s: after each reply, poll this long for the next request before sleeping.
        output_layout: the tensors every item produces; `run_batch` must return exactly these.
    """

    def __init__(
        self,
        run_batch: BatchFunction,
        name: str,
        device: torch.device | None,
        spin_s: float,
        output_layout: OutputLayout,
    ) -> None:
        if not output_layout.row_shapes:
            raise ValueError("an output layout needs at least one output (the tokens)")
        self._run_batch = run_batch
        self._spin_s = spin_s
        self._cuda_device = device if device is not None and device.type == "cuda" else None
        self._output_layout = output_layout
        self.address = f"\0vitpool-{name}-{uuid.uuid4().hex}"
        self.info = ChannelInfo(self.address, output_layout)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(64)
        self._thread = threading.Thread(target=self._accept_loop, name="vitpool-channel-accept", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Take no new connections; open ones are served until their callers close them."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self._listener.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            if not _same_user(connection):
                connection.close()
                continue
            threading.Thread(
                target=self._serve, args=(connection,), name="vitpool-channel", daemon=True
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        segments = MappedSegments(self._cuda_device)
        # This connection's copies of outputs to its segments: on their own stream, so that they
        # neither wait for nor hold up the encoder's next replay, queued meanwhile on its stream.
        copies = None if self._cuda_device is None else torch.cuda.Stream(self._cuda_device)
        try:
            with connection:
                while True:
                    spin_until_readable(connection, self._spin_s)
                    request = receive_message(connection)
                    if request is None:
                        break
                    segments.forget(request.get("closed"))
                    pixel_segment = segments.get(request.get("segment"), request.get("size"))
                    output_path = request.get("output_segment")
                    output_segment = (
                        pixel_segment
                        if output_path is None
                        else segments.get(output_path, request.get("output_size"))
                    )
                    send_message(
                        connection, self._handle(pixel_segment.buffer, output_segment.buffer, request, copies)
                    )
        except (OSError, ValueError, msgpack.UnpackException) as error:
            # a bad segment name or bad framing: the peer is broken or hostile, so drop it unanswered
            logger.warning("channel connection dropped: %s", error)
        finally:
            segments.close()

    def _handle(
        self,
        pixel_buffer: mmap.mmap,
        output_buffer: mmap.mmap,
        request: dict,
        copies: torch.cuda.Stream | None,
    ) -> dict:
        try:
            plan = plan_from_wire(request.get("plan"))
            pixel_offsets = _offsets(request, "pixels", len(plan.specs))
            output_offsets = _offsets(request, "outputs", len(plan.specs))
            pixels = [
                array_at(pixel_buffer, spec.pixel_dtype, offset, spec.pixel_shape)
                for spec, offset in zip(plan.specs, pixel_offsets)
            ]
            values, receipt = self._run_batch(plan, pixels, None if self._cuda_device else "cpu")
            del pixels  # views of the segment: it can be unmapped once they are gone
            if len(values) != len(plan.specs):
                raise RuntimeError(f"the encoder answered {len(values)} values for {len(plan.specs)} items")
            # run_batch returns once the outputs are computed, so the copies need not wait for anything
            try:
                with contextlib.nullcontext() if copies is None else torch.cuda.stream(copies):
                    for spec, value, offset in zip(plan.specs, values, output_offsets):
                        if value is not None:
                            self._write_outputs(output_buffer, offset, spec.num_tokens, value.outputs)
            finally:
                if copies is not None:
                    copies.synchronize()  # before the outputs are freed and the segment is reused
            return {
                "status": receipt.status,
                "errors": [[position, reason] for position, reason in receipt.item_errors.items()],
                "busy": receipt.busy_seconds,
            }
        except Exception as error:  # the caller gets the error as the batch's outcome
            logger.exception("channel batch failed")
            return {"status": ERROR, "message": f"{type(error).__name__}: {error}"}

    def _write_outputs(
        self, buffer: mmap.mmap, offset: int, num_tokens: int, outputs: Sequence[torch.Tensor]
    ) -> None:
        """Write one item's tensors at `offset`, where the caller will read them (same layout)."""
        layout = self._output_layout
        shapes = layout.shapes(num_tokens)
        relative, _ = item_output_offsets(layout, num_tokens)
        if len(outputs) != len(shapes):
            raise RuntimeError(
                f"the encoder gave {len(outputs)} outputs for an item; its layout has {len(shapes)}"
            )
        for tensor, shape, tensor_offset in zip(outputs, shapes, relative):
            if tuple(tensor.shape) != shape or wire_dtype_name(tensor.dtype) != layout.dtype:
                raise RuntimeError(
                    f"the encoder gave an output of shape {tuple(tensor.shape)} and dtype {tensor.dtype}; "
                    f"the layout says {shape} of {layout.dtype}"
                )
            _write(array_at(buffer, layout.dtype, offset + tensor_offset, shape), tensor)


def _offsets(request: dict, name: str, count: int) -> list[int]:
    """The request's per-item byte offsets under `name`: `count` integers (bounds are checked
    where they are used, by `array_at`)."""
    offsets: Any = request.get(name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != count
        or any(not isinstance(n, int) or isinstance(n, bool) for n in offsets)
    ):
        raise ValueError(f"one {name} offset per item is needed ({count} integers)")
    return offsets


def _write(target: np.ndarray, tensor: torch.Tensor) -> None:
    """Copy `tensor` into the segment: by DMA from a GPU (complete once the stream is
    synchronised), else with NumPy (one thread: torch's copy would wake its CPU thread pool)."""
    if tensor.device.type == "cuda":
        torch.from_numpy(target).view(tensor.dtype).copy_(tensor, non_blocking=True)
    else:
        np.copyto(target, to_array(tensor))


def _same_user(connection: socket.socket) -> bool:
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", credentials)
    return uid == os.getuid()
