"""Token budgets: the batch sizes a graph is captured for. Pure Python.

A budget counts output (merged) tokens, like vLLM's `encoder_cudagraph_token_budgets`, so
settings carry over. Besides tokens and items, a budget bounds whatever per-batch capacities the
model family declares (`limits`): attention sequences for Qwen-style towers (they size
`cu_seqlens`), windows for window attention, and so on. Packing knows them only by name.
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
SEQUENCES = "sequences"  # attention sequences: frames (temporal patches) of images and videos

Needs = tuple[tuple[str, int], ...]  # (capacity name, amount) pairs, sorted by name


@dataclass(frozen=True, order=True)
class Budget:
    """One captured batch shape. Ordered by tokens, then by capacity limits (cheaper first).

    `path` names the graph set it belongs to: a family whose item has several inputs runs each
    input (a global view, local crops) through graphs of its own, with buffers of that input's
    row shape; only items of the same path share a batch. "" for the one path of most families.
    """

    num_tokens: int
    limits: Needs = ()  # the most a batch may use of each named capacity
    max_items: int = 1  # items in one batch
    path: str = ""

    def limit(self, name: str) -> int | None:
        """The bound on capacity `name`, or None where this budget has none."""
        return dict(self.limits).get(name)

    @property
    def max_sequences(self) -> int:
        """Attention sequences a batch may hold (the items, for families that do not bound them)."""
        limit = self.limit(SEQUENCES)
        return self.max_items if limit is None else limit


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


def check_token_budgets(
    token_budgets: Sequence[int], max_items_per_batch: int | None
) -> tuple[list[int], int]:
    """The user's token budgets, checked, and the item bound (default min(32, smallest budget)).

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
    if (
        isinstance(max_items_per_batch, bool)
        or not isinstance(max_items_per_batch, int)
        or max_items_per_batch < 1
    ):
        raise ValueError(f"max_items_per_batch must be >= 1; got {max_items_per_batch}")
    if max_items_per_batch > smallest:
        # Every item has at least one token: more items than the smallest budget has tokens
        # cannot be laid into it.
        raise ValueError(
            f"max_items_per_batch ({max_items_per_batch}) exceeds the smallest budget "
            f"({smallest} tokens); lower it or drop the small budgets"
        )
    return tokens, max_items_per_batch


def make_budgets(
    token_budgets: Sequence[int],
    max_items_per_batch: int | None,
    max_frames_per_batch: int | None,
) -> list[Budget]:
    """Budgets for towers with one attention sequence per frame (Qwen-style): each bounds its
    sequences, which size `cu_seqlens`.

    Raises:
        ValueError: naming the setting and what to change.
    """
    tokens, max_items_per_batch = check_token_budgets(token_budgets, max_items_per_batch)
    if max_frames_per_batch is None:
        max_frames_per_batch = max(DEFAULT_MAX_FRAMES_PER_BATCH, max_items_per_batch)
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
        budgets.append(Budget(value, ((SEQUENCES, max_sequences),), min(max_items_per_batch, max_sequences)))
        if value > FEW_SEQUENCES_FROM_TOKENS and max_sequences > FEW_SEQUENCES:
            # Varlen attention launches (sequences x longest sequence) blocks, so a large budget
            # sized for many sequences wastes much of its attention time on one large image.
            # A variant for few sequences serves those batches; packing picks it when it fits.
            few = FEW_SEQUENCES
            budgets.append(Budget(value, ((SEQUENCES, few),), min(max_items_per_batch, few)))
    return sorted(budgets)


def plain_budgets(token_budgets: Sequence[int], max_items_per_batch: int | None) -> list[Budget]:
    """Budgets bounded by tokens and items only, for towers with no other per-batch capacity."""
    tokens, max_items_per_batch = check_token_budgets(token_budgets, max_items_per_batch)
    return sorted(Budget(value, (), max_items_per_batch) for value in tokens)
