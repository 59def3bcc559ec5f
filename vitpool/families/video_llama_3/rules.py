"""Item rules of VideoLLaMA 3 (its SigLIP-style NaViT tower and projector): checks and sizes of an
item without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules). Pixels are the
processor's flattened patches [t*h*w, C*P*P] (temporal patch 1), merge blocks contiguous; an
item's layout is (t, h, w, merge_size): the processor gives a merge size per item
(`image_merge_sizes`, `video_merge_sizes`: 1 for images, 2 for videos by default), and the tower
resamples each frame's h x w patches bilinearly to (h/m) x (w/m) tokens. A grid of three integers
takes its modality's default merge size. Each frame is one attention sequence (capacity
"sequences"), so an item gives t*h*w / m² tokens from t*h*w rows.

A merged item takes m² rows per token, an unmerged one a single row: buffers sized for merged
items would make every image batch compute four times its rows. So the family has two paths
(`ItemSpec.path`, `Budget.path`) over one tower, each with buffers, budgets and graphs of its own:

- "" (merge size 1): one row per token; its budgets hold no extra rows.
- "merged" (merge size 2 and up): `MERGED_ROWS_PER_TOKEN` rows per token, so a budget of n tokens
  holds 3n rows past one a token (capacity "extra_rows"; an item needs t*h*w - tokens). Its
  budgets are the token budgets whose rows stay within the largest image budget's (at least the
  smallest one): the merged path adds at most the image path's memory. A larger item (or one of
  merge size 3 and up that needs more extra rows than a budget holds) runs eager, alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import SEQUENCES, Budget, make_budgets
from vitpool.rules.base import RulesBase
from vitpool.rules.grids import check_row_count, checked_grid
from vitpool.rules.patch_rows import EXTRA_ROWS
from vitpool.specs import ItemSpec, is_int

MERGED = "merged"  # the path of items of merge size 2 and up
MERGED_ROWS_PER_TOKEN = 4  # a 2 x 2 merge: the video processor's default
DEFAULT_MERGE_SIZES = {"image": 1, "video": 2}  # VideoLlama3ImageProcessor's, VideoLlama3VideoProcessor's


def parse_layout(modality: str, layout: Any) -> tuple[int, int, int, int]:
    """(t, h, w, merge size) of a grid of three integers (the modality's default merge size) or
    four. ValueError for anything else."""
    values = layout.tolist() if hasattr(layout, "tolist") else layout
    if isinstance(values, (list, tuple)) and len(values) == 4 and all(is_int(v) for v in values):
        merge = int(values[3])
        if merge < 1:
            raise ValueError(f"grid {tuple(values)}: the merge size (its fourth entry) must be positive")
        return (*checked_grid(modality, values[:3], (merge, merge), f"merge size {merge}"), merge)
    if isinstance(values, (list, tuple)) and len(values) not in (1, 3):
        raise ValueError(f"grid_thw must be (t, h, w) or (t, h, w, merge_size) of integers; got {layout!r}")
    merge = DEFAULT_MERGE_SIZES[modality]
    return (*checked_grid(modality, layout, (merge, merge), f"merge size {merge}"), merge)


@dataclass(frozen=True)
class VideoLlama3Rules(RulesBase):
    """VideoLLaMA 3's items: flattened patches [t*h*w, C*P*P], layout (t, h, w, merge size); an
    item of merge size above 1 runs on the path MERGED."""

    row_width: int  # C * P * P (temporal patch 1)
    output_width: int  # the LLM's hidden size (the projector's output)
    capacities: tuple[str, ...] = (EXTRA_ROWS, SEQUENCES)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.row_width,)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.output_width,),)

    @property
    def merge_unit(self) -> int:
        """Rows per token on the plain path (merge size 1)."""
        return 1

    @property
    def paths(self) -> tuple[str, ...]:
        return ("", MERGED)

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        t, h, w, merge = grid = parse_layout(modality, layout)
        if len(pixel_shape) != 2:
            raise ValueError(
                f"pixel_values must be 2-D [t*h*w, C*P*P] (flattened patches); got shape {pixel_shape}"
            )
        if pixel_shape[1] != self.row_width:
            raise ValueError(
                f"pixel_values have {pixel_shape[1]} features per row; the model takes {self.row_width} "
                "(channels * patch * patch)"
            )
        num_rows = t * h * w
        check_row_count(pixel_shape, (t, h, w), num_rows, "t*h*w")
        tokens = num_rows // merge**2
        needs = ((EXTRA_ROWS, num_rows - tokens), (SEQUENCES, t))
        return ItemSpec(
            modality, tuple(pixel_shape), pixel_dtype, grid, tokens, needs, MERGED if merge > 1 else ""
        )

    def row_factor(self, path: str) -> int:
        """Rows of a budget's buffer of `path` per token."""
        return MERGED_ROWS_PER_TOKEN if path == MERGED else 1

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """The plain budgets (path "", no extra rows) and the merged ones (path MERGED) of the
        token budgets whose rows stay within the largest plain budget's (at least the smallest
        token budget); each bounds its attention sequences (frames) as Qwen's do. A user's limit
        on EXTRA_ROWS bounds the merged budgets and may not exceed what their buffers hold.

        Raises:
            ValueError: naming the setting and what to change.
        """
        check_capacity_limits(capacity_limits, self.capacities)
        sequenced = make_budgets(token_budgets, max_items_per_batch, capacity_limits.get(SEQUENCES))
        budgets = [_with_extra_rows(budget, 0, "") for budget in sequenced]
        limit = capacity_limits.get(EXTRA_ROWS)
        largest = max(budget.num_tokens for budget in sequenced)
        most_merged = max(min(b.num_tokens for b in sequenced), largest // MERGED_ROWS_PER_TOKEN)
        for budget in sequenced:
            if budget.num_tokens > most_merged:
                continue
            held = (MERGED_ROWS_PER_TOKEN - 1) * budget.num_tokens
            if limit is not None and limit > held:
                raise ValueError(
                    f"capacity_limits[{EXTRA_ROWS!r}] = {limit}: a merged budget of {budget.num_tokens} "
                    f"tokens holds {held} extra rows; lower the limit"
                )
            budgets.append(_with_extra_rows(budget, held if limit is None else limit, MERGED))
        return sorted(budgets)


def _with_extra_rows(budget: Budget, extra_rows: int, path: str) -> Budget:
    limits = tuple(sorted(((EXTRA_ROWS, extra_rows), *budget.limits)))
    return Budget(budget.num_tokens, limits, budget.max_items, path)
