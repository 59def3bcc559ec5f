"""Counters of a GraphEncoder."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EncoderStats:
    """What an encoder has done since it was built. `stats()` returns a copy.

    Attributes:
        graph_items: items encoded by replaying a captured graph.
        eager_items: items encoded without a graph (oversized, disabled budget, or CPU).
        replays_per_budget: batches run per budget (output tokens), graph or not.
        eager_batches: oversized items run alone, at their own size.
        batch_rows: patch rows of all budgeted batches, padding included.
        padding_rows: of those, rows that were padding.
        captured_budgets: (tokens, sequences) of the budgets with a checked graph.
        disabled_budgets: (tokens, sequences) of budgets whose graph failed its check; they run eager.
        capture_seconds: time to capture and check every graph.
        urgent_interrupts: urgent-lane batches queued between two segments of a run
            (`GraphEncoder`'s `urgent_tokens`).
        dense_items: of the graph items, those replayed in a budget's dense graph (one image
            filling most of its budget: cuDNN attention over the budget's rows).
        dense_graphs: budgets (tokens, sequences) with a checked dense graph too.
        oom_splits: runs that ran out of device memory and ran again in halves (or refused
            their one item).
    """

    graph_items: int = 0
    eager_items: int = 0
    replays_per_budget: dict[int, int] = field(default_factory=dict)
    eager_batches: int = 0
    batch_rows: int = 0
    padding_rows: int = 0
    captured_budgets: list[tuple[int, int]] = field(default_factory=list)
    disabled_budgets: list[tuple[int, int]] = field(default_factory=list)
    capture_seconds: float = 0.0
    urgent_interrupts: int = 0
    dense_items: int = 0
    dense_graphs: list[tuple[int, int]] = field(default_factory=list)
    oom_splits: int = 0

    @classmethod
    def combined(cls, parts: list[EncoderStats]) -> EncoderStats:
        """The counters of several paths' runners as one encoder's."""
        total = cls()
        for part in parts:
            total.graph_items += part.graph_items
            total.eager_items += part.eager_items
            for tokens, count in part.replays_per_budget.items():
                total.replays_per_budget[tokens] = total.replays_per_budget.get(tokens, 0) + count
            total.eager_batches += part.eager_batches
            total.batch_rows += part.batch_rows
            total.padding_rows += part.padding_rows
            total.captured_budgets += part.captured_budgets
            total.disabled_budgets += part.disabled_budgets
            total.capture_seconds += part.capture_seconds
            total.dense_items += part.dense_items
            total.dense_graphs += part.dense_graphs
        return total

    @property
    def padding_waste(self) -> float:
        """Share of budgeted rows that were padding."""
        return self.padding_rows / self.batch_rows if self.batch_rows else 0.0
