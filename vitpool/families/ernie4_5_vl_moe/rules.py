"""Item rules of ERNIE-4.5-VL: Qwen-style patch rows and grids whose videos merge frame pairs.

Pixels are the processor's flattened patches [t*h*w, C*P*P] (one frame per patch row: the
tower has no temporal patch) with a grid (t, h, w), merge blocks contiguous. The resampler after
the tower merges each 2x2 block of patches into one token and, for a video, the tokens of frames
2k and 2k+1 into one: an image gives h*w/4 tokens from h*w rows, a video t*h*w/8 tokens from
t*h*w rows. A video's rows per token are twice an image's, so tokens alone do not bound a batch's
rows: rows are a per-batch capacity (`ROWS`), every budget of n tokens holding n*4 rows, the
rows of its buffers. A batch of images fills a budget's tokens and rows together; a video fills
its rows first.

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
from vitpool.specs import VIDEO, ItemSpec

ROWS = "rows"  # patch rows of the batch: the static buffers' rows


@dataclass(frozen=True)
class TemporalMergeRules(SpatialMergeRules):
    """`SpatialMergeRules` whose videos merge `temporal_merge_size` frames into one token: a
    video's t must be a multiple of it (the video processor repeats the last frame of an odd
    count), and it gives t*h*w / (merge_size**2 * temporal_merge_size) tokens. Every item needs
    its rows (`ROWS`) and its frames (one attention sequence each)."""

    temporal_merge_size: int = 2
    capacities: tuple[str, ...] = (ROWS, SEQUENCES)

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        spec = super().item_spec(modality, pixel_shape, pixel_dtype, layout)
        t = spec.layout[0]
        frames_per_token = 1
        if modality == VIDEO:
            if t % self.temporal_merge_size:
                raise ValueError(
                    f"grid_thw {spec.layout}: a Video's t must be a multiple of the temporal merge size "
                    f"{self.temporal_merge_size} (the processor repeats the last frame of an odd count); "
                    "use Image for a single frame"
                )
            frames_per_token = self.temporal_merge_size
        num_tokens = spec.num_rows // (self.merge_size**2 * frames_per_token)
        return dataclasses.replace(spec, num_tokens=num_tokens, needs=((ROWS, spec.num_rows), (SEQUENCES, t)))

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """Qwen-style budgets (`make_budgets`), each also bounding its rows: merge_size**2 per token
        (what its buffers hold), or `capacity_limits["rows"]` where that is lower."""
        check_capacity_limits(capacity_limits, self.capacities)
        merge_unit = self.merge_size**2
        user_rows = capacity_limits.get(ROWS)
        budgets = set()
        for budget in make_budgets(token_budgets, max_items_per_batch, capacity_limits.get(SEQUENCES)):
            rows = budget.num_tokens * merge_unit
            if user_rows is not None:
                rows = min(rows, user_rows)
            limits = tuple(sorted((*budget.limits, (ROWS, rows))))
            # every item has at least one merge block of rows
            budgets.add(Budget(budget.num_tokens, limits, max(1, min(budget.max_items, rows // merge_unit))))
        return sorted(budgets)
