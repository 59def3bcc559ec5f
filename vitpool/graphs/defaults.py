"""Defaults derived from the device (dtype, token budgets) and from the family (its budget range)."""

from __future__ import annotations

import torch

from vitpool.dtypes import SUPPORTED_DTYPES
from vitpool.errors import ConfigError
from vitpool.models.protocol import BudgetRange, VisionAdapter
from vitpool.packing import budget_ladder

# Above 256 tokens a batch costs about its rows, so budgets step by 12.5% there (padding
# stays under that); see `budget_ladder`.
LADDER_GROWTH = 1.125
LADDER_ALIGN_TOKENS = 32


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
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
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"dtype {dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    return dtype


# Above this many tokens (6144 patch rows for a 2x2 merge: a ~1250² image) a batch runs eager at
# its own rows instead of padded into a graph: there it is compute-bound, so launches cost little,
# and it pays no padding. The ladder once stopped at 1024 tokens (eager won above that when graphs
# ran packed FA2); since a graph of one image runs dense cuDNN attention, the graph wins up to here,
# the small towers most, whose eager path is bound by its launches (benchmarks/RESULTS.md, "The GPU
# ladder to 1536 tokens" in "What moved the large workloads: three changes, measured before and
# after in one process each").
GRAPH_MAX_TOKENS = 1536
# Below 256 tokens the GPU ladder steps by 32 tokens rather than doubling: 4 more graphs (33 in
# all) buy less padding for small calls packed alone (benchmarks/RESULTS.md, "Figures the code's
# design rests on"); 4 x 224² (196 tokens) fills 224 instead of 256.
SMALL_STEP_TOKENS = 32


# A family's range (`BudgetRange`) gets every step up to this many steps, then the ladder's growth.
DENSE_STEPS = 8


def default_token_budgets(device: torch.device, adapter: VisionAdapter | None = None) -> list[int]:
    """The budgets the adapter's family asks for on this device (its `budget_range`), where it
    states one; else from the device: 64…GRAPH_MAX_TOKENS tokens on a GPU (steps of 32 tokens to
    256, then 12.5%), 16…1024 on a CPU.

    Items larger than the largest budget still run (eager, alone, at their own rows).
    """
    chosen = adapter.budget_range(device) if adapter is not None else None
    if chosen is not None:
        return family_budgets(chosen)
    if device.type != "cuda":
        return budget_ladder(16, 1024, LADDER_GROWTH, LADDER_ALIGN_TOKENS)
    small = range(64, 256, SMALL_STEP_TOKENS)
    return sorted({*small, *budget_ladder(256, GRAPH_MAX_TOKENS, LADDER_GROWTH, LADDER_ALIGN_TOKENS)})


def family_budgets(chosen: BudgetRange) -> list[int]:
    """Every step of the range up to DENSE_STEPS steps (where a unit more or less is a large share
    of the batch), then the ladder's 12.5% growth rounded up to a step, to `max_tokens`."""
    step = chosen.step_tokens
    dense = range(chosen.min_tokens, min(chosen.max_tokens, DENSE_STEPS * step) + 1, step)
    ladder = budget_ladder(chosen.min_tokens, chosen.max_tokens, LADDER_GROWTH, step)
    return sorted({*dense, *ladder})
