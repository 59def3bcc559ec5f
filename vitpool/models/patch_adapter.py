"""What the adapters of patch-row towers share (Kimi-K2.5, PaddleOCR-VL).

Both towers take patches one per row [rows, C, P, P] with a (t, h, w) grid per item, resample a
learned square position table to each grid (interpolation taps), give each patch its 2D rotary
position (row, column), and attend over each item alone. Per grid these tensors are computed on
the host once (cached) and laid into the buffers item after item from row 0; padding rows read
table row 0 with weight 0 and rotary position (0, 0), and form one trailing attention sequence.

A subclass adds its own per-grid tensors (`grid_metadata`: rows of the item, and rows of its output
tokens), their buffers (`own_metadata_specs`) and its forward. Token tensors named in
`ROW_INDEX_NAMES` hold row indices of the item and are offset by its first row; a token tensor of
an item fills the leading corner of its slots (a clip of 2 frames fills 2 of 4 frame slots).
Both families' checkpoints are converted by first-match key renames (`renamed_key`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

from vitpool.kernels.attention import install_packed_attention
from vitpool.models.adapter_base import AdapterBase, renamed_key  # noqa: F401 - where callers have found it
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import item_cu_seqlens, item_grids
from vitpool.packing import Budget
from vitpool.rules.patch_rows import Grid, PatchRows
from vitpool.specs import ItemSpec

Tensors = dict[str, torch.Tensor]


class PatchRowAdapter(AdapterBase):
    """The position table's and rotary positions' metadata and the fill of the metadata buffers of
    a patch-row tower; its sizes and its capture-check sampler (images, and clips of `frames`) are
    `AdapterBase`'s.

    Args:
        tower: the encoder module (moved and captured by the graph code).
        vision: the tower inside it whose attention runs packed sequences.
        item_rules: the family's rules (`PatchRows` sizes, `item_spec`).
        pos_embedding: the tower's position table module (`num_grid_per_side`,
            `interpolation_mode`, `interpolation_align_corners`).
        row_factor: buffer rows per (kh*kw * token): 1 for images; t for clips of up to t frames.
        frames: (fewest, most) frames of the items this adapter samples.
    """

    ROW_INDEX_NAMES: tuple[str, ...] = ()

    def __init__(
        self,
        tower: torch.nn.Module,
        vision: torch.nn.Module,
        item_rules: PatchRows,
        pos_embedding: torch.nn.Module,
        row_factor: int = 1,
        frames: tuple[int, int] = (1, 1),
    ) -> None:
        self.tower = tower
        self.item_rules = item_rules
        self.merge_kernel = item_rules.merge_kernel
        self.merge_unit = item_rules.merge_unit
        self.row_factor = row_factor
        self.sampled_frames = frames
        self._num_grid_per_side: int = pos_embedding.num_grid_per_side
        self._interpolation_mode: str = pos_embedding.interpolation_mode
        self._align_corners: bool = pos_embedding.interpolation_align_corners
        self._per_grid = lru_cache(maxsize=1024)(self._grid_tensors)
        install_packed_attention(vision)

    def max_rows(self, num_tokens: int) -> int:
        return num_tokens * self.merge_unit * self.row_factor

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        taps = 16 if self._interpolation_mode == "bicubic" else 4
        return {
            "interp_indices": TensorSpec((num_rows, taps), torch.long),
            "interp_weights": TensorSpec((num_rows, taps), torch.float32),
            "position_ids": TensorSpec((num_rows, 2), torch.long),
            # one sequence per item, the padding's, the leading 0
            "cu_seqlens": TensorSpec((budget.max_items + 2,), torch.int32),
            **self.own_metadata_specs(num_rows, budget),
        }

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> Tensors:
        grids = item_grids(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        metadata["cu_seqlens"] = item_cu_seqlens(grids, num_rows, budget.max_items)
        row = token = 0
        for grid in grids:
            rows, tokens = self._per_grid(grid)
            row_end = row + grid[0] * grid[1] * grid[2]
            token_end = token + grid[1] * grid[2] // self.merge_unit
            for name, tensor in rows.items():
                metadata[name][row:row_end] = tensor
            for name, tensor in tokens.items():
                slots = metadata[name][token:token_end]
                slots[tuple(slice(0, size) for size in tensor.shape)] = (
                    tensor + row if name in self.ROW_INDEX_NAMES else tensor
                )
            row, token = row_end, token_end
        return metadata

    def own_metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        """The subclass's buffers besides the position table's, rotary positions and cu_seqlens."""
        raise NotImplementedError

    def grid_metadata(self, grid: Grid) -> tuple[Tensors, Tensors]:
        """The subclass's tensors of one item: over its rows, and over its output tokens."""
        raise NotImplementedError

    def _grid_tensors(self, grid: Grid) -> tuple[Tensors, Tensors]:
        grid_thw = torch.tensor([grid], dtype=torch.long)
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw,
            self._num_grid_per_side,
            mode=self._interpolation_mode,
            align_corners=self._align_corners,
            spatial_merge_size=1,
        )
        rows = {
            "interp_indices": indices,
            "interp_weights": weights.to(torch.float32),
            "position_ids": get_vision_position_ids(grid_thw, spatial_merge_size=1),
        }
        own_rows, tokens = self.grid_metadata(grid)
        return {**rows, **own_rows}, tokens
