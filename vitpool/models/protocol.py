"""The adapter protocol: all that graphs/ knows of a vision model.

A model family is one adapter file. The graph code owns the static buffers and never looks
inside a model; an adapter owns everything that depends on the grids:

- sizes: how many patch rows, output tokens and attention sequences an item has;
- metadata: the grid-dependent tensors of a batch (positions, interpolation taps,
  `cu_seqlens`, window permutations, ...) laid out for a buffer of `num_rows` rows, with the
  padding rows forming a trailing dummy sequence so that every row is written;
- the forward over static tensors, free of host synchronisation, so it can be captured.

Window attention (Qwen2.5-VL: a second `cu_seqlens` and a token permutation), fixed tiles
(InternVL), learned-position resampling (GLM-4.1V) and clip-level attention (MoonViT) all
become more named metadata tensors plus their own `forward`; the graph code does not change.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class ItemSize:
    """What packing needs to know of one item."""

    num_rows: int  # patch rows the item feeds into the tower
    num_tokens: int  # output tokens it produces (rows / merge unit)
    num_sequences: int  # attention sequences it adds to cu_seqlens (frames for a video)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one static metadata buffer."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class ItemRules(Protocol):
    """What checking an item needs, without the weights; picklable, so a pool's callers have it."""

    row_width: int  # features per patch row: C * T * P * P

    def item_size(self, grid: Grid) -> ItemSize:
        """Sizes of an item with this grid. Raises ValueError for a grid the model cannot take."""
        ...


class VisionAdapter(Protocol):
    """A vision tower seen through the operations the graph code needs."""

    tower: torch.nn.Module
    item_rules: ItemRules
    row_width: int  # features per patch row: C * T * P * P
    merge_unit: int  # patch rows per output token (4 for a 2x2 merge)
    output_width: int  # hidden size of the output tokens
    num_deepstack: int  # deepstack feature maps per item (0 for models without)

    def item_size(self, grid: Grid) -> ItemSize:
        """Sizes of an item with this grid. Raises ValueError for a grid the model cannot take."""
        ...

    def metadata_specs(self, num_rows: int, max_sequences: int) -> dict[str, TensorSpec]:
        """Static metadata buffers for a batch of `num_rows` rows and up to `max_sequences` sequences."""
        ...

    def build_metadata(
        self, grids: Sequence[Grid], num_rows: int, max_sequences: int
    ) -> dict[str, torch.Tensor]:
        """CPU tensors matching `metadata_specs`, for `grids` laid out in order from row 0.

        Rows past the items' rows are padding and must get valid values too.
        """
        ...

    def forward(
        self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixels: [num_rows, row_width] -> (tokens [num_rows / merge_unit, output_width], deepstack).

        Must not synchronise with the host: it is captured into a CUDA graph.
        """
        ...

    def sample_grids(self, num_rows: int, max_sequences: int, rng: random.Random) -> list[Grid]:
        """Random valid grids using at most `num_rows` rows and `max_sequences` sequences.

        Used to warm up and check each captured budget on inputs unlike any earlier ones.
        """
        ...
