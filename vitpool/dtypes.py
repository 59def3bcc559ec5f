"""The dtypes an encoder runs in, by name (a setting, a flag, an environment variable): torch only,
so that the gateway, the Dynamo backend and the command line parse one without loading the engine."""

from __future__ import annotations

import torch

from vitpool.errors import ConfigError

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dtype_from_name(name: str | None) -> torch.dtype | None:
    """The torch dtype named "bfloat16", "float16" or "float32"; None for the device's default."""
    if name is None:
        return None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; use 'bfloat16', 'float16' or 'float32'")
    return dtype
