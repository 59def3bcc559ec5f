"""A batch's outputs on the caller's end of the channel: one block, from its first item's output to
the end of its last, cut into each item's tensors where the actor wrote them (`item_output_offsets`,
`vitpool.transport.channel_protocol`).

The block views the batch's output segment, or is copied out of its pixel segment
(`output_block`). How a batch shape's block is cut is worked out once per shape and remembered
(`OutputCuts`): a client's traffic repeats a few item sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from vitpool.specs import BatchPlan, OutputLayout
from vitpool.transport.channel_protocol import item_output_offsets
from vitpool.transport.embedding import Embedding
from vitpool.transport.shared_memory import OwnedSegment
from vitpool.transport.wire import WIRE_DTYPES

_MAX_PIECES = 4096  # batch shapes remembered per client (the item sizes of its traffic)


def output_block(
    layout: OutputLayout,
    plan: BatchPlan,
    output_offsets: list[int],
    output_segment: OwnedSegment | None,
    segment: OwnedSegment,
) -> tuple[torch.Tensor, tuple[np.ndarray, np.ndarray] | None]:
    """The batch's outputs as one block of the output dtype, from its first output to the end
    of its last (`output_offsets`: each item's, in bytes), and the copy still to make once the
    reply is in (None for a view).

    In an output segment: a view of it, and the segment stays held until the last tensor that
    views it is gone. Else a block to copy the outputs into out of the batch's `segment`, in one
    piece: fresh memory costs a page fault per 4 KiB on first touch, and the allocator keeps one
    recurring block mapped where it would give back many. That block is pinned when this
    process already uses CUDA (torch caches pinned blocks, and the caller's copy to its GPU can
    then be asynchronous). An output segment is not pinned here: an asynchronous copy from it
    could still be reading when the results are dropped and the segment is written again."""
    torch_dtype, wire_dtype = WIRE_DTYPES[layout.dtype]
    start = output_offsets[0]
    _, last_bytes = item_output_offsets(layout, plan.specs[-1].num_tokens)
    end = output_offsets[-1] + last_bytes  # blocks are aligned: whole elements
    if output_segment is not None:
        view = np.frombuffer(
            output_segment.buffer,
            dtype=wire_dtype,
            count=(end - start) // wire_dtype.itemsize,
            offset=start,
        )
        output_segment.hold_while_viewed(view)
        block = torch.from_numpy(view)
        return (block if block.dtype == torch_dtype else block.view(torch_dtype)), None
    block = torch.empty(end - start, dtype=torch.uint8, pin_memory=torch.cuda.is_initialized())
    source = np.frombuffer(segment.buffer, dtype=np.uint8, count=end - start, offset=start)
    return block.view(torch_dtype), (block.numpy(), source)


class OutputCuts:
    """How each batch shape's output block is cut into its items' tensors, remembered by the
    shape (its items' output tokens) for one actor's `layout`."""

    def __init__(self, layout: OutputLayout) -> None:
        self._layout = layout
        self.pieces: dict[tuple[int, ...], _Pieces] = {}

    def views(self, block: torch.Tensor, plan: BatchPlan) -> list[Embedding]:
        """Each item's tensors, as views of the batch's output block, where the actor writes them
        (`item_output_offsets`): one torch call for the whole batch where its tensors lie back to
        back with one row shape (every family's outputs so far), else one per tensor."""
        specs = plan.specs
        pieces = self.pieces.get(nums := tuple(spec.num_tokens for spec in specs))
        if pieces is None:
            pieces = _pieces_of(self._layout, nums)
            if len(self.pieces) >= _MAX_PIECES:
                self.pieces.clear()
            self.pieces[nums] = pieces
        if pieces.rows is not None:
            tensors = block.view(-1, *pieces.row_shape).split_with_sizes(pieces.rows)
        else:
            tensors = [
                block[offset : offset + math.prod(shape)].view(shape) for offset, shape in pieces.placed
            ]
        per_item = pieces.per_item
        return [
            Embedding(tensors[first], list(tensors[first + 1 : first + per_item]))
            for first in range(0, len(tensors), per_item)
        ]


@dataclass(frozen=True)
class _Pieces:
    """How one batch shape's output block is cut into its items' tensors: `rows` (the tensors'
    first dimensions, for one `split_with_sizes` of the block as rows of `row_shape`) where they
    lie back to back with one row shape, else `placed` (element offset, shape) each."""

    per_item: int  # tensors per item
    row_shape: tuple[int, ...]
    rows: list[int] | None
    placed: list[tuple[int, tuple[int, ...]]] | None


def _pieces_of(layout: OutputLayout, nums: tuple[int, ...]) -> _Pieces:
    """The pieces of a block holding items of `nums` output tokens, laid out by `item_output_offsets`."""
    itemsize = WIRE_DTYPES[layout.dtype][1].itemsize
    placed, base = [], 0  # (element offset, shape) per tensor
    for num_tokens in nums:
        offsets, size = item_output_offsets(layout, num_tokens)
        placed.extend(
            ((base + offset) // itemsize, shape) for shape, offset in zip(layout.shapes(num_tokens), offsets)
        )
        base += size
    per_item, row_shape = len(layout.row_shapes), tuple(layout.row_shapes[0])
    end = 0
    for offset, shape in placed:
        if offset != end or tuple(shape[1:]) != row_shape:
            break
        end += math.prod(shape)
    else:
        if end * itemsize == base:
            return _Pieces(per_item, row_shape, [shape[0] for _, shape in placed], None)
    return _Pieces(per_item, row_shape, None, placed)
