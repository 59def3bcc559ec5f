"""One set of static buffers, sized for the largest budget, shared by every budget's graph.

Each budget's graph reads and writes prefix views of the same tensors, so the buffers cost the
memory of the largest budget once. Every call writes every row of its budget (padding rows too),
so nothing stale from a larger batch is ever read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vitpool.models.protocol import TensorSpec, VisionAdapter
from vitpool.packing import Budget


class StaticBuffers:
    """pixels [max_rows, *row_shape]; metadata as the adapter names it, each as large as any
    budget needs; outputs [max_tokens, *output_row_shape], one per output tensor."""

    def __init__(self, adapter: VisionAdapter, budgets: Sequence[Budget], device: torch.device, dtype: torch.dtype) -> None:
        self._adapter = adapter
        max_rows = max(adapter.max_rows(budget.num_tokens) for budget in budgets)
        max_tokens = max(budget.num_tokens for budget in budgets)
        self.pixels = torch.zeros(max_rows, *adapter.row_shape, device=device, dtype=dtype)
        self.metadata = {
            name: torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            for name, spec in _largest_metadata(adapter, budgets).items()
        }
        # written by the captured graphs
        self.outputs = [
            torch.zeros(max_tokens, *row_shape, device=device, dtype=dtype) for row_shape in adapter.output_row_shapes
        ]

    def input_views(self, num_rows: int, budget: Budget) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        specs = self._adapter.metadata_specs(num_rows, budget)
        metadata = {
            name: self.metadata[name][tuple(slice(0, n) for n in spec.shape)] for name, spec in specs.items()
        }
        return self.pixels[:num_rows], metadata

    def output_views(self, num_tokens: int) -> list[torch.Tensor]:
        return [output[:num_tokens] for output in self.outputs]


def _largest_metadata(adapter: VisionAdapter, budgets: Sequence[Budget]) -> dict[str, TensorSpec]:
    """Per metadata name, a shape that holds every budget's view (the largest in each dimension)."""
    largest: dict[str, TensorSpec] = {}
    for budget in budgets:
        for name, spec in adapter.metadata_specs(adapter.max_rows(budget.num_tokens), budget).items():
            known = largest.get(name)
            if known is None:
                largest[name] = spec
                continue
            assert known.dtype == spec.dtype and len(known.shape) == len(spec.shape), (
                f"metadata {name!r} changes dtype or rank between budgets"
            )
            largest[name] = TensorSpec(tuple(map(max, known.shape, spec.shape)), spec.dtype)
    return largest
