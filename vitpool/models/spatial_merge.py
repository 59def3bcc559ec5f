"""What the adapters of spatial-merge towers share (Qwen2-VL through Qwen3.5, GLM-4.1V): items
with a (t, h, w) grid of patches, one attention sequence per temporal patch, and padding rows
that form one trailing sequence of their own. Towers that attend over a whole item at once
(Kimi-K2.5, PaddleOCR-VL) share the per-item versions: `item_grids`, `item_cu_seqlens`."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import torch

from vitpool.kernels.attention import install_packed_attention
from vitpool.models.adapter_base import AdapterBase
from vitpool.packing import Budget
from vitpool.rules.grids import SpatialMergeRules
from vitpool.specs import IMAGE, VIDEO, ItemSpec

Grid = tuple[int, int, int]


def row_width_of(config: object) -> int:
    """Features per patch row of a tower config: channels * temporal patch * patch * patch."""
    return config.in_channels * config.temporal_patch_size * config.patch_size**2


class SpatialMergeAdapter(AdapterBase):
    """What every spatial-merge adapter shares: its sizes (from its item rules, `AdapterBase`),
    the capture-check sampler (frames and sequences), and the packed attention hook in its tower.
    Subclasses add their metadata and forward."""

    def __init__(self, tower: torch.nn.Module, item_rules: SpatialMergeRules) -> None:
        self.tower = tower
        self.item_rules = item_rules
        self.merge_size = item_rules.merge_size
        self.merge_unit = self.merge_size**2  # patch rows per output token
        self.row_width = item_rules.row_width
        install_packed_attention(tower)

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        return sample_grid_specs(self.item_rules, num_rows, budget, rng, self.sampled_items(budget))


def grids_of(specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> list[Grid]:
    """The items' (t, h, w) grids; ValueError if their rows or frames overflow the buffers."""
    grids = [(spec.layout[0], spec.layout[1], spec.layout[2]) for spec in specs]
    needed_rows = sum(t * h * w for t, h, w in grids)
    needed_sequences = sum(t for t, _, _ in grids)
    if needed_rows > num_rows or needed_sequences > budget.max_sequences:
        raise ValueError(
            f"{len(grids)} items need {needed_rows} rows and {needed_sequences} sequences; "
            f"the buffers hold {num_rows} and {budget.max_sequences}"
        )
    return grids


def frame_cu_seqlens(grids: Sequence[Grid], num_rows: int, max_sequences: int) -> torch.Tensor:
    """cu_seqlens [max_sequences + 2] (int32): one sequence per frame of each item, in order from
    row 0; the unused entries repeat `num_rows`, so the padding rows form one trailing sequence."""
    return _packed_cu_seqlens([h * w for t, h, w in grids for _ in range(t)], num_rows, max_sequences)


def item_grids(specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> list[Grid]:
    """The items' (t, h, w) grids; ValueError if their rows, tokens or count overflow the buffers."""
    grids = [(spec.layout[0], spec.layout[1], spec.layout[2]) for spec in specs]
    rows = sum(t * h * w for t, h, w in grids)
    tokens = sum(spec.num_tokens for spec in specs)
    if rows > num_rows or tokens > budget.num_tokens or len(specs) > budget.max_items:
        raise ValueError(
            f"{len(specs)} items need {rows} rows and {tokens} tokens; the buffers hold {num_rows} rows, "
            f"{budget.num_tokens} tokens and {budget.max_items} items"
        )
    return grids


def item_cu_seqlens(grids: Sequence[Grid], num_rows: int, max_items: int) -> torch.Tensor:
    """cu_seqlens [max_items + 2] (int32): one sequence per item (a clip attends across its
    frames), in order from row 0; the unused entries repeat `num_rows`, so the padding rows form
    one trailing sequence."""
    return _packed_cu_seqlens([t * h * w for t, h, w in grids], num_rows, max_items)


def _packed_cu_seqlens(lengths: Sequence[int], num_rows: int, capacity: int) -> torch.Tensor:
    """cu_seqlens [capacity + 2] (int32) of sequences of `lengths` packed from row 0, then the
    padding rows as one trailing sequence (the unused entries repeat `num_rows`)."""
    cu_seqlens = torch.full((capacity + 2,), num_rows, dtype=torch.int32)
    cu_seqlens[0] = 0
    cu_seqlens[1 : len(lengths) + 1] = torch.tensor(list(itertools.accumulate(lengths)), dtype=torch.int32)
    return cu_seqlens


def sample_grid_specs(
    rules: SpatialMergeRules, num_rows: int, budget: Budget, rng: random.Random, max_items: int
) -> list[ItemSpec]:
    """Random valid images and two-frame videos, at most `max_items`, within `num_rows` rows and
    every limit of `budget` (frames, and any other capacity the rules declare), for warming up
    and checking a captured budget on inputs unlike any before."""
    merge_unit = rules.merge_unit
    specs: list[ItemSpec] = []
    used: dict[str, int] = {}
    rows_left, sequences_left = num_rows, budget.max_sequences
    while rows_left >= merge_unit and sequences_left > 0 and len(specs) < max_items:
        frames = 2 if sequences_left >= 2 and rows_left >= 2 * merge_unit and rng.random() < 0.3 else 1
        max_blocks = rows_left // (merge_unit * frames)
        # Sometimes fill the rest, usually not, so that padding rows are exercised too.
        num_blocks = max_blocks if rng.random() < 0.2 else rng.randint(1, max(1, max_blocks // 2))
        height_blocks = rng.randint(1, num_blocks)
        width_blocks = max(1, num_blocks // height_blocks)
        grid = (frames, height_blocks * rules.merge_size, width_blocks * rules.merge_size)
        num_grid_rows = grid[0] * grid[1] * grid[2]
        modality = VIDEO if frames > 1 else IMAGE
        spec = rules.item_spec(modality, (num_grid_rows, *rules.row_shape), "float32", grid)
        needs = dict(used)
        for name, amount in spec.needs:
            needs[name] = needs.get(name, 0) + amount
        if any(needs.get(name, 0) > limit for name, limit in budget.limits):
            break
        specs.append(spec)
        used = needs
        rows_left -= num_grid_rows
        sequences_left -= frames
    return specs
