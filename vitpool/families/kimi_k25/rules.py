"""Item rules of Kimi-K2.5 (MoonViT): checks and sizes of an item without the weights.

Importing neither torch nor transformers (a pool's callers unpickle these rules). Pixels are the
processor's patches [t*h*w, 3, P, P] (4-D, one patch per row); an item's layout is its grid
(t, h, w) in patches. The tower attends over a whole clip at once (one attention sequence per
item) and pools `kh x kw` patches of every frame into one output token, averaging over the frames:
an item gives h*w / (kh*kw) tokens whatever its t, and takes t*h*w rows.

So a clip's rows are not kh*kw per token: the rows past its first frame, (t-1)*h*w, are the
capacity "extra_rows". Buffers sized for clips would make every image batch compute t times its
rows, so the family has two paths (`ItemSpec.path`, `Budget.path`), each with buffers, budgets and
graphs of its own over one tower:

- "" (images, and videos of one frame): kh*kw rows per token; its budgets hold no extra rows.
- "clip" (videos of t > 1 frames): `clip_frames` * kh*kw rows per token (4 by default: the
  processor's chunks of 4 frames), so a budget of n tokens holds (clip_frames - 1) * kh*kw * n
  extra rows. A clip of fewer frames needs fewer: it takes its own rows, and the batch's padding
  rows the rest. Its budgets are the token budgets whose rows stay within the largest image
  budget's (at least the smallest one): the clip path adds at most the image path's memory. A clip
  larger than them runs eager, alone, at its own rows.

With `clip_frames` 1 there is no clip path: clips fit no budget and run eager, alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import Budget, plain_budgets
from vitpool.rules.patch_rows import EXTRA_ROWS, PatchRows, patch_grid
from vitpool.specs import ItemSpec

CLIP = "clip"  # the path of videos of more than one frame
DEFAULT_CLIP_FRAMES = 4  # Kimi_K25VideoProcessor's chunks (temporal_patch_size), pos_emb_time


@dataclass(frozen=True)
class KimiK25Rules(PatchRows):
    """MoonViT's items: 4-D patches [t*h*w, C, P, P], grid (t, h, w), t <= max_frames; a video of
    t > 1 frames runs on the path CLIP.

    Raises:
        ValueError: `clip_frames` outside 1..max_frames.
        TypeError: `clip_frames` not an integer.
    """

    channels: int
    patch_size: int
    merge_kernel: tuple[int, int]  # (kh, kw)
    max_frames: int  # the temporal position table's length (pos_emb_time)
    output_width: int  # the LLM's hidden size (the projector's output)
    clip_frames: int = (
        DEFAULT_CLIP_FRAMES  # rows of a clip budget's buffer per (kh*kw * token); 1: no clip path
    )
    capacities: tuple[str, ...] = (EXTRA_ROWS,)

    def __post_init__(self) -> None:
        if isinstance(self.clip_frames, bool) or not isinstance(self.clip_frames, int):
            raise TypeError(f"clip_frames must be an integer; got {self.clip_frames!r}")
        if not 1 <= self.clip_frames <= self.max_frames:
            raise ValueError(
                f"clip_frames {self.clip_frames}: a clip budget holds 1 to {self.max_frames} frames' rows "
                "per token (the model's pos_emb_time); 1 runs clips eager"
            )

    @property
    def paths(self) -> tuple[str, ...]:
        """The family's paths: "" (images), and CLIP unless clips run eager."""
        return ("", CLIP) if self.clip_frames > 1 else ("",)

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        t, h, w = grid = patch_grid(self, modality, pixel_shape, layout, f"merge kernel {self.merge_kernel}")
        if t > self.max_frames:
            raise ValueError(
                f"grid_thw {grid}: at most {self.max_frames} frames per clip (the model's pos_emb_time)"
            )
        path = CLIP if t > 1 and self.clip_frames > 1 else ""
        needs = ((EXTRA_ROWS, (t - 1) * h * w),)
        return ItemSpec(
            modality, tuple(pixel_shape), pixel_dtype, grid, h * w // self.merge_unit, needs, path
        )

    def row_factor(self, path: str) -> int:
        """Rows of a budget's buffer of `path` per (kh*kw * token)."""
        return self.clip_frames if path == CLIP else 1

    def extra_rows(self, num_tokens: int, path: str = CLIP) -> int:
        """Rows past kh*kw per token that a budget of `num_tokens` of `path` holds."""
        return (self.row_factor(path) - 1) * self.merge_unit * num_tokens

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """The image budgets (path "", no extra rows) and, with a clip path, the clip budgets
        (path CLIP) of the token budgets whose clip rows stay within the largest image budget's
        rows (at least the smallest token budget). A user's limit on EXTRA_ROWS bounds the clip
        budgets and may not exceed what their buffers hold.

        Raises:
            ValueError: naming the setting and what to change.
        """
        check_capacity_limits(capacity_limits, self.capacities)
        plain = plain_budgets(token_budgets, max_items_per_batch)
        budgets = [Budget(budget.num_tokens, ((EXTRA_ROWS, 0),), budget.max_items) for budget in plain]
        limit = capacity_limits.get(EXTRA_ROWS)
        if CLIP not in self.paths:
            if limit is not None:
                raise ValueError(
                    f"capacity_limits[{EXTRA_ROWS!r}] = {limit}: with clip_frames 1 no budget holds extra "
                    "rows (clips run eager); raise clip_frames or drop the limit"
                )
            return budgets
        largest = max(budget.num_tokens for budget in plain)
        most_clip_tokens = max(plain[0].num_tokens, largest // self.clip_frames)
        for budget in plain:
            if budget.num_tokens > most_clip_tokens:
                continue
            held = self.extra_rows(budget.num_tokens)
            if limit is not None and limit > held:
                raise ValueError(
                    f"capacity_limits[{EXTRA_ROWS!r}] = {limit}: a clip budget of {budget.num_tokens} tokens "
                    f"holds {held} extra rows (clip_frames {self.clip_frames}); raise clip_frames or lower "
                    "the limit"
                )
            value = held if limit is None else limit
            budgets.append(Budget(budget.num_tokens, ((EXTRA_ROWS, value),), budget.max_items, CLIP))
        return sorted(budgets)
