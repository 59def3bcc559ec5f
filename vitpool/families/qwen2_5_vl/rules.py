"""Item rules of Qwen2.5-VL: Qwen-style grids, plus the attention windows a batch holds.

Qwen2.5-VL's tower attends within windows of `window_tokens` x `window_tokens` output tokens in
most blocks (full attention only in `fullatt_block_indexes`). Windows tile each frame from its
top-left corner, so a frame of h x w patches has ceil(h/m/v) * ceil(w/m/v) windows (m: the
spatial merge size, v: `window_tokens`). A batch's windows size `cu_window_seqlens`, so they are
a per-batch capacity, declared by name (`WINDOWS`).

Plain Python: imports neither torch nor transformers (a pool's callers unpickle these rules).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import SEQUENCES, Budget, make_budgets
from vitpool.rules.grids import SpatialMergeRules
from vitpool.specs import ItemSpec

WINDOWS = "windows"  # attention windows of the windowed blocks


def frame_windows(h: int, w: int, merge_size: int, window_tokens: int) -> int:
    """Windows of one frame of h x w patches."""
    return -(-(h // merge_size) // window_tokens) * -(-(w // merge_size) // window_tokens)


def max_windows(num_tokens: int, num_sequences: int, window_tokens: int) -> int:
    """The most windows a batch of at most `num_tokens` tokens in `num_sequences` frames can have.

    A frame of T tokens has at most T * max(v, 4) / v**2 + 1 windows (v: `window_tokens`): one
    window if both sides are under v tokens; ceil(n/v) < n/v + 1 along one side longer than v;
    ceil(n/v) <= 2n/v along each side when both are. Every window holds at least one token.
    """
    v = window_tokens
    return min(num_tokens, num_sequences + -(-num_tokens * max(v, 4) // (v * v)))


@dataclass(frozen=True)
class WindowedMergeRules(SpatialMergeRules):
    """`SpatialMergeRules` (pixels [t*h*w, C*T*P*P], `grid_thw` (t, h, w)) whose items also need
    attention windows: t * ceil(h/m/v) * ceil(w/m/v) of them."""

    window_tokens: int = 1  # v: a window's side in output (merged) tokens
    capacities: tuple[str, ...] = (SEQUENCES, WINDOWS)

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        spec = super().item_spec(modality, pixel_shape, pixel_dtype, layout)
        t, h, w = spec.layout
        windows = t * frame_windows(h, w, self.merge_size, self.window_tokens)
        return dataclasses.replace(spec, needs=((SEQUENCES, t), (WINDOWS, windows)))

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """Qwen-style budgets (`make_budgets`), each also bounding windows: by default as many as
        any batch of its tokens and sequences can have (`max_windows`), so that the bound never
        refuses a batch the other limits take; `capacity_limits["windows"]` lowers it."""
        check_capacity_limits(capacity_limits, self.capacities)
        user_windows = capacity_limits.get(WINDOWS)
        budgets = set()
        for budget in make_budgets(token_budgets, max_items_per_batch, capacity_limits.get(SEQUENCES)):
            windows = max_windows(budget.num_tokens, budget.max_sequences, self.window_tokens)
            if user_windows is not None:
                windows = min(windows, user_windows)
            limits = tuple(sorted((*budget.limits, (WINDOWS, windows))))
            # every item has at least one window
            budgets.add(Budget(budget.num_tokens, limits, min(budget.max_items, windows)))
        return sorted(budgets)
