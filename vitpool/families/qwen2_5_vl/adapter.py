"""Qwen2.5-VL: the Hugging Face tower (window attention, RMSNorm) driven with precomputed metadata.

`Qwen2_5_VisionTransformerPretrainedModel.forward` takes every grid-dependent tensor through
keyword arguments (`transformers.vision_utils`): `position_ids`, `cu_seqlens` (one sequence per
frame, for the full-attention blocks), `window_index` (the permutation of merged tokens into
window order; the tower inverts it with an on-device argsort) and `cu_window_seqlens` (one
sequence per window, for the other blocks), with `max_seqlen` / `max_window_seqlen` as Python
ints. Given them the forward has no host synchronisation.

Pixels are flattened patches [rows, C*T*P*P] with grid (t, h, w), as for Qwen3-VL. Padding
rows are whole merged tokens at the end: `window_index` leaves them in place, they form the
trailing sequence of `cu_seqlens` and trailing windows of `cu_window_seqlens` of at most a
window's rows each (so that `max_window_seqlen` stays a window's size).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

from vitpool.families.qwen2_5_vl.rules import WINDOWS, WindowedMergeRules, frame_windows
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import SpatialMergeAdapter, row_width_of
from vitpool.packing import Budget
from vitpool.specs import ItemSpec

Grid = tuple[int, int, int]


class Qwen2_5_VLAdapter(SpatialMergeAdapter):
    """Adapter for `Qwen2_5_VisionTransformerPretrainedModel`."""

    def __init__(self, tower: torch.nn.Module) -> None:
        config = tower.config
        self.patch_size: int = config.patch_size
        self.window_size: int = config.window_size
        window_tokens = config.window_size // config.spatial_merge_size // config.patch_size
        if window_tokens < 1:
            raise ValueError(
                f"window_size {config.window_size} is smaller than a merged token "
                f"({config.spatial_merge_size} x {config.patch_size} pixels)"
            )
        rules = WindowedMergeRules(
            row_width=row_width_of(config),
            merge_size=config.spatial_merge_size,
            output_row_shapes=((config.out_hidden_size,),),
            window_tokens=window_tokens,
        )
        super().__init__(tower, rules)
        self.window_rows = window_tokens**2 * self.merge_unit  # rows of the largest window
        self._per_grid_metadata = lru_cache(maxsize=1024)(self._compute_grid_metadata)

    def _padding_windows(self, num_rows: int) -> int:
        return max(1, -(-num_rows // self.window_rows))

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        windows = budget.limit(WINDOWS)
        if windows is None:
            windows = num_rows // self.merge_unit
        return {
            "position_ids": TensorSpec((num_rows, 2), torch.long),
            # real sequences, one trailing padding sequence, and the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
            "window_index": TensorSpec((num_rows // self.merge_unit,), torch.long),
            # real windows, the padding rows' windows, and the leading 0
            "cu_window_seqlens": TensorSpec((windows + self._padding_windows(num_rows) + 1,), torch.int32),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        grids = [_grid(spec) for spec in specs]
        needed_rows = sum(t * h * w for t, h, w in grids)
        needed_sequences = sum(t for t, _, _ in grids)
        needed_windows = sum(
            t * frame_windows(h, w, self.merge_size, self.item_rules.window_tokens) for t, h, w in grids
        )
        max_windows = budget.limit(WINDOWS)
        if (
            needed_rows > num_rows
            or needed_sequences > budget.max_sequences
            or (max_windows is not None and needed_windows > max_windows)
        ):
            raise ValueError(
                f"{len(grids)} items need {needed_rows} rows, {needed_sequences} sequences and "
                f"{needed_windows} windows; the buffers hold {num_rows}, {budget.max_sequences} and "
                f"{max_windows}"
            )
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        # Unused cu_seqlens entries repeat the end; padding rows have rotary position (0, 0)
        # and keep their place in window order.
        metadata["cu_seqlens"].fill_(num_rows)
        metadata["cu_seqlens"][0] = 0
        metadata["cu_window_seqlens"].fill_(num_rows)
        metadata["cu_window_seqlens"][0] = 0
        window_index = metadata["window_index"]
        window_index.copy_(torch.arange(window_index.shape[0]))
        row = 0
        boundaries: list[int] = []
        window_boundaries: list[int] = []
        for grid in grids:
            position_ids, item_window_index, item_window_ends = self._per_grid_metadata(grid)
            end = row + position_ids.shape[0]
            metadata["position_ids"][row:end] = position_ids
            token = row // self.merge_unit
            window_index[token : token + item_window_index.shape[0]] = item_window_index + token
            window_boundaries.extend(row + boundary for boundary in item_window_ends)
            t, h, w = grid
            boundaries.extend(row + h * w * (frame + 1) for frame in range(t))
            row = end
        # padding rows: windows of at most a real window's rows
        window_boundaries.extend(range(row + self.window_rows, num_rows, self.window_rows))
        if boundaries:
            metadata["cu_seqlens"][1 : len(boundaries) + 1] = torch.tensor(boundaries, dtype=torch.int32)
        if window_boundaries:
            metadata["cu_window_seqlens"][1 : len(window_boundaries) + 1] = torch.tensor(
                window_boundaries, dtype=torch.int32
            )
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        num_rows = pixels.shape[0]  # static: Python ints from the buffer's shape
        output = self.tower(
            pixels,
            grid_thw=None,  # every grid-derived tensor is given below
            max_seqlen=num_rows,
            max_window_seqlen=min(num_rows, self.window_rows),
            **metadata,
        )
        return [output.pooler_output]

    def _compute_grid_metadata(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """An item's rotary positions [rows, 2], its window permutation of merged tokens
        [tokens], and the ends of its windows in rows (from its first row)."""
        grid_thw = torch.tensor([grid], dtype=torch.long)
        position_ids = get_vision_position_ids(grid_thw, self.merge_size)
        window_index, cu_window_seqlens = get_vision_window_index(
            grid_thw,
            spatial_merge_size=self.merge_size,
            window_size=self.window_size,
            patch_size=self.patch_size,
        )
        return position_ids, window_index, tuple(cu_window_seqlens[1:].tolist())


def _grid(spec: ItemSpec) -> Grid:
    t, h, w = spec.layout
    return (t, h, w)
