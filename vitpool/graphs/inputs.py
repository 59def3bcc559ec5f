"""What the encoder checks of a batch it is given, and how it finds items with non-finite pixels.

Items are checked and sized once, by the model's item rules (`vitpool.items.prepare_items`),
usually in the caller's process. A batch planned elsewhere (`vitpool.specs.BatchPlan`) gets only
a cheap consistency check here, once: pixels shaped as their specs say, each spec what the rules
make of its layout. What passed it is a `CheckedPlan`, in the budget this encoder picked for it,
which the encoder runs without checking it again (an actor checks a batch before its combiner,
and the encoder then runs it). Non-finite pixels are found on the device, once the pixels are there:
scanning them on the host would cost as much as a small encode. An item too large for the
device's memory is found by running it (`out_of_memory.py`): its size in memory depends on the
family, the attention kernel and the device, which no cheap rule here knows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from vitpool.errors import counted
from vitpool.items import PreparedItem
from vitpool.packing import Needs
from vitpool.specs import BatchPlan, ItemSpec
from vitpool.transport.wire import from_array

NONFINITE_MESSAGE = "pixel_values contain NaN or infinity (or values too large for the model's dtype)"


def totals(specs: Sequence[ItemSpec]) -> tuple[int, int, Needs]:
    """Items, output tokens and summed capacity needs of a batch."""
    needs: dict[str, int] = {}
    for spec in specs:
        for name, amount in spec.needs:
            needs[name] = needs.get(name, 0) + amount
    return len(specs), sum(spec.num_tokens for spec in specs), tuple(sorted(needs.items()))


class CheckedPlan(NamedTuple):
    """A planned batch that an encoder's `check_plan` passed, with its pixels: that encoder runs
    it as it is (`GraphEncoder.start_plans`), without checking it again. Unpacks as the
    (plan, pixels) pair it was made from. Make one only with the `check_plan` of the encoder
    that will run it."""

    plan: BatchPlan
    pixels: Sequence[torch.Tensor]


def check_plan(
    plan: BatchPlan,
    pixels: Sequence[np.ndarray | torch.Tensor],
    row_shape: tuple[int, ...],
    is_consistent: Callable[[ItemSpec], bool],
) -> list[torch.Tensor]:
    """The one check of a batch planned elsewhere, where it crosses into the encoder: one pixel
    array per spec, each shaped and typed as its spec says, in rows the model takes, each spec
    what the model's rules make of its layout (`is_consistent`), and an item no graph serves
    (`ItemSpec.served_by_graph`) alone, as every planner packs it. Arrays become tensors sharing
    their memory (the encoder only reads them, so read-only object-store arrays are not copied).

    The plan's budget is not checked: it was the planner's estimate, and the encoder picks the
    budget a batch runs in (`GraphEncoder.check_plan`).

    Raises:
        ValueError: what does not match (the batch fails as a whole: its planner and this encoder
            disagree, which no item of the caller's can cause); an item's error names its position.
    """
    if not plan.specs:
        raise ValueError("a batch plan has no items")
    if len(pixels) != len(plan.specs):
        raise ValueError(
            f"a batch plan of {counted(len(plan.specs), 'item')} came with "
            f"{counted(len(pixels), 'pixel array')}"
        )
    if len(plan.specs) > 1 and not all(spec.served_by_graph for spec in plan.specs):
        raise ValueError(
            f"a batch plan of {counted(len(plan.specs), 'item')} holds one that no graph serves, "
            "which runs alone"
        )
    tensors = []
    for position, (spec, array) in enumerate(zip(plan.specs, pixels)):
        tensor = pixel_tensor(position, spec, array)
        check_pixels(position, spec, tensor, row_shape)
        if not is_consistent(spec):
            raise ValueError(
                f"item {position} of the batch: its spec {spec} is not what the model's rules make of it"
            )
        tensors.append(tensor)
    return tensors


def pixel_tensor(position: int, spec: ItemSpec, array: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Item `position`'s pixels as a tensor of its spec's dtype, sharing their memory; ValueError
    naming the item where they do not travel as its spec says."""
    if isinstance(array, torch.Tensor):
        return array
    try:
        return from_array(np.asarray(array), spec.pixel_dtype, copy_read_only=False)
    except (KeyError, TypeError) as error:
        raise ValueError(
            f"item {position} of the batch: pixels do not travel as {spec.pixel_dtype}: {error}"
        ) from None


def check_pixels(position: int, spec: ItemSpec, pixels: torch.Tensor, row_shape: tuple[int, ...]) -> None:
    """Pixels shaped as their spec says, in rows the model takes (the path's buffers' `row_shape`,
    for an item a graph may run); ValueError naming the item's position in its batch otherwise."""
    if tuple(pixels.shape) != spec.pixel_shape:
        raise ValueError(
            f"item {position} of the batch: pixels of shape {tuple(pixels.shape)}, its spec says "
            f"{spec.pixel_shape}"
        )
    # an item no graph serves has rows of its own shape, which the rules took (`is_consistent`)
    if spec.served_by_graph and spec.pixel_shape[1:] != row_shape:
        raise ValueError(
            f"item {position} of the batch: rows of shape {spec.pixel_shape[1:]}; the model takes {row_shape}"
        )


def nonfinite_positions(members: Sequence[PreparedItem], finite_rows: torch.Tensor) -> list[int]:
    """Positions of the batch's items with a NaN or infinite pixel; `finite_rows` says per row of
    their concatenated pixels whether it is finite (on a device, this waits for its stream)."""
    flags = finite_rows.cpu()
    if bool(flags.all()):  # the usual batch: one test, not one per item
        return []
    bad, row = [], 0
    for position, member in enumerate(members):
        end = row + member.spec.num_rows
        if not bool(flags[row:end].all()):
            bad.append(position)
        row = end
    return bad


def finite_rows(pixels: torch.Tensor) -> torch.Tensor:
    """Whether each row of `pixels` [rows, *row_shape] is finite: [rows], on their device."""
    return torch.isfinite(pixels).reshape(pixels.shape[0], -1).all(dim=1)
