"""Token budgets: the batch sizes a graph is captured for. Pure Python.

A budget counts output (merged) tokens, like vLLM's `encoder_cudagraph_token_budgets`, so
settings carry over; its buffers hold `num_tokens * merge_unit` patch rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MAX_ITEMS_PER_BATCH = 32
DEFAULT_MAX_FRAMES_PER_BATCH = 64
# Budgets above this many tokens also get a variant for batches of at most FEW_SEQUENCES sequences.
FEW_SEQUENCES_FROM_TOKENS = 256
FEW_SEQUENCES = 4


@dataclass(frozen=True, order=True)
class Budget:
    """One captured batch shape. Ordered by tokens, then by sequence capacity (cheaper first)."""

    num_tokens: int
    max_sequences: int  # attention sequences (frames) in one batch: sizes cu_seqlens
    max_items: int  # items in one batch


def budget_ladder(min_tokens: int, max_tokens: int, growth: float, align_tokens: int) -> list[int]:
    """Budgets from `min_tokens` to `max_tokens`: doubling up to 256 tokens, then by `growth`.

    Small batches cost about the same whatever their size (launch-bound), so few budgets
    suffice there; large ones cost in proportion to their rows, so the padding a coarse step
    adds would be paid in full: above 256 tokens, steps grow by `growth`, rounded up to
    `align_tokens`.
    """
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens ({min_tokens}) <= max_tokens ({max_tokens})")
    ladder = [min_tokens]
    while ladder[-1] < max_tokens:
        current = ladder[-1]
        step = current * 2 if current < 256 else math.ceil(current * growth / align_tokens) * align_tokens
        ladder.append(min(max(step, current + 1), max_tokens))
    return ladder


def make_budgets(
    token_budgets: Sequence[int],
    max_items_per_batch: int | None,
    max_frames_per_batch: int | None,
) -> list[Budget]:
    """Check the user's settings and derive each budget's item and sequence bounds.

    Raises:
        ValueError: naming the setting and what to change.
    """
    tokens = list(token_budgets)
    if not tokens:
        raise ValueError("budgets is empty; give at least one token budget, or None for defaults")
    for value in tokens:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"budgets must be positive integers (output tokens); got {value!r}")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"budgets has duplicates: {sorted(tokens)}")
    smallest = min(tokens)
    if max_items_per_batch is None:
        max_items_per_batch = min(DEFAULT_MAX_ITEMS_PER_BATCH, smallest)
    if max_frames_per_batch is None:
        max_frames_per_batch = max(DEFAULT_MAX_FRAMES_PER_BATCH, max_items_per_batch)
    if max_items_per_batch < 1:
        raise ValueError(f"max_items_per_batch must be >= 1; got {max_items_per_batch}")
    if max_items_per_batch > smallest:
        # Every item has at least one token: more items than the smallest budget has tokens
        # cannot be laid into it.
        raise ValueError(
            f"max_items_per_batch ({max_items_per_batch}) exceeds the smallest budget "
            f"({smallest} tokens); lower it or drop the small budgets"
        )
    if max_frames_per_batch < max_items_per_batch:
        raise ValueError(
            f"max_frames_per_batch ({max_frames_per_batch}) must be >= max_items_per_batch "
            f"({max_items_per_batch}): every item has at least one frame"
        )
    budgets = []
    for value in tokens:
        # Each sequence has at least one token, so a budget never holds more sequences than
        # tokens; sizing cu_seqlens past that only launches empty attention blocks.
        max_sequences = min(max_frames_per_batch, value)
        budgets.append(Budget(value, max_sequences, min(max_items_per_batch, max_sequences)))
        if value > FEW_SEQUENCES_FROM_TOKENS and max_sequences > FEW_SEQUENCES:
            # Varlen attention launches (sequences x longest sequence) blocks, so a large budget
            # sized for many sequences wastes much of its attention time on one large image.
            # A variant for few sequences serves those batches; packing picks it when it fits.
            few = FEW_SEQUENCES
            budgets.append(Budget(value, few, min(max_items_per_batch, few)))
    return sorted(budgets)
