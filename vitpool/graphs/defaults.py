"""Defaults derived from the device: dtype and token budgets."""

from __future__ import annotations

import torch

from vitpool.errors import ConfigError
from vitpool.packing import budget_ladder

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_GIB = 1024**3

# Above 256 tokens a batch costs about its rows, so budgets step by 12.5% there (padding
# stays under that); see `budget_ladder`.
LADDER_GROWTH = 1.125
LADDER_ALIGN_TOKENS = 32


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"device {device!r} is not a torch device: {error}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: CUDA is not available here; use device='cpu'")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    elif resolved.type != "cpu":
        raise ConfigError(f"device {device!r}: vitpool runs on 'cuda' or 'cpu'")
    return resolved


def resolve_dtype(dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _SUPPORTED_DTYPES:
        raise ConfigError(f"dtype {dtype} is not supported; use one of {_SUPPORTED_DTYPES}")
    return dtype


def default_token_budgets(device: torch.device) -> list[int]:
    """Budgets from the device: graphs on a GPU sized by its memory, small ones on a CPU.

    Items larger than the largest budget still run (eager, alone): they are compute-bound,
    where a graph gains little.
    """
    if device.type != "cuda":
        return budget_ladder(16, 1024, LADDER_GROWTH, LADDER_ALIGN_TOKENS)
    total_memory = torch.cuda.get_device_properties(device).total_memory
    max_tokens = 4096 if total_memory >= 40 * _GIB else 2048 if total_memory >= 16 * _GIB else 1024
    return budget_ladder(64, max_tokens, LADDER_GROWTH, LADDER_ALIGN_TOKENS)


def dtype_from_name(name: str | None) -> torch.dtype | None:
    """The torch dtype named "bfloat16", "float16" or "float32"; None for the device's default."""
    if name is None:
        return None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if dtype not in _SUPPORTED_DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; use 'bfloat16', 'float16' or 'float32'")
    return dtype
