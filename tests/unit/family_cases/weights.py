"""Random weights for the families' tiny towers, shared by their cases."""

from __future__ import annotations

import math

import torch


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of unit scale (HF's init is tiny): every row, position and norm matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            values = torch.randn(parameter.shape, generator=generator)
            if parameter.ndim >= 2 and "position_embedding" not in name:
                values = values / math.sqrt(parameter[0].numel())
            elif parameter.ndim == 1:
                values = (1 + 0.1 * values) if "norm" in name else 0.1 * values
            parameter.copy_(values)
    return module
