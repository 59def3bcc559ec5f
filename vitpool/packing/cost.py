"""How long a batch keeps an actor busy, in token units, for picking the least-loaded actor."""

from __future__ import annotations

# At about this many tokens per attention sequence (4096 patch rows for a 2x2 merge) attention
# costs as much as the rest of a ViT block; below it the linear layers dominate.
QUADRATIC_TOKENS = 1024
# A replay's fixed cost (launches, copies, one host round trip), in tokens of linear work.
BATCH_OVERHEAD_TOKENS = 64


def batch_cost(num_tokens: int, num_sequences: int) -> float:
    """Estimated cost of a batch that computes `num_tokens` tokens (the budget's, padding included,
    since a graph computes every row) in `num_sequences` sequences of about equal length."""
    sequences = max(1, num_sequences)
    quadratic = num_tokens * num_tokens / (sequences * QUADRATIC_TOKENS)
    return BATCH_OVERHEAD_TOKENS + num_tokens + quadratic
