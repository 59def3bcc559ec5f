"""One set of static buffers, sized for the largest budget, shared by every budget's graph.

Each budget's graph reads and writes prefix views of the same tensors, so the buffers cost the
memory of the largest budget once. Every call writes every row of its budget (padding rows too),
so nothing stale from a larger batch is ever read.
"""

from __future__ import annotations

import torch

from vitpool.models.protocol import VisionAdapter


class StaticBuffers:
    def __init__(
        self,
        adapter: VisionAdapter,
        max_rows: int,
        max_sequences: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self._adapter = adapter
        self.pixels = torch.zeros(max_rows, adapter.row_width, device=device, dtype=dtype)
        self.metadata = {
            name: torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            for name, spec in adapter.metadata_specs(max_rows, max_sequences).items()
        }
        max_tokens = max_rows // adapter.merge_unit
        # outputs: [tokens, output_width], written by the captured graphs
        self.tokens = torch.zeros(max_tokens, adapter.output_width, device=device, dtype=dtype)
        self.deepstack = [torch.zeros_like(self.tokens) for _ in range(adapter.num_deepstack)]

    def input_views(self, num_rows: int, max_sequences: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        specs = self._adapter.metadata_specs(num_rows, max_sequences)
        metadata = {
            name: self.metadata[name][tuple(slice(0, n) for n in spec.shape)] for name, spec in specs.items()
        }
        return self.pixels[:num_rows], metadata

    def output_views(self, num_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.tokens[:num_tokens], [d[:num_tokens] for d in self.deepstack]
