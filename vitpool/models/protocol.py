"""The adapter protocol: all that graphs/ knows of a vision model.

A model family is one adapter file plus its item rules (`vitpool.specs.ItemRules`). The graph
code owns the static buffers and never looks inside an item or a model; an adapter owns
everything that depends on the family:

- sizes: how many input rows a budget's buffer holds (`max_rows`), the shape of one input row
  (`row_shape`: a flattened patch, a patch, a tile) and of one output row per output tensor;
- metadata: the tensors a batch needs besides its pixels (positions, interpolation taps,
  `cu_seqlens`, window permutations, ...) laid out for a buffer of `num_rows` rows, with the
  padding rows given valid values too (a trailing dummy sequence), so that every row is written;
- the forward over static tensors, free of host synchronisation, so it can be captured;
- random valid items for a budget, to warm up and check each captured graph;
- members with defaults (`vitpool.models.adapter_base.AdapterBase`, which every family's adapter
  derives from, gives them): the token budgets its graphs should cover by default
  (`budget_range`), where the device's ladder does not fit it (a tiled tower whose every tile
  gives a fixed token count); the paths of a family whose items run through buffers of several
  shapes (`paths`); why FP8 GEMMs are refused for it (`fp8_refused`). `check_adapter` refuses an
  adapter that lacks them.

An item's layout inside the adapter is its `ItemSpec.layout` (Qwen: the grid (t, h, w); tiled
towers: nothing). Window attention (Qwen2.5-VL: a second `cu_seqlens` and a token permutation),
fixed tiles (InternVL), learned-position resampling (GLM-4.1V) and clip-level attention
(MoonViT) all become more named metadata tensors plus their own `forward`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vitpool.packing import Budget
from vitpool.specs import ItemRules, ItemSpec, TensorSpec


@dataclass(frozen=True)
class BudgetRange:
    """The default token budgets a family asks for (as vLLM's `get_encoder_cudagraph_budget_range`):
    from `min_tokens` to `max_tokens`, every one a multiple of `step_tokens` (a family whose items
    come in fixed units of tokens, such as tiles, gains nothing from budgets between two units).

    Raises:
        ValueError: bounds that are not positive multiples of the step, or min above max.
    """

    min_tokens: int
    max_tokens: int
    step_tokens: int = 1

    def __post_init__(self) -> None:
        values = (self.min_tokens, self.max_tokens, self.step_tokens)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"a budget range needs positive integers; got {values}")
        if self.min_tokens % self.step_tokens or self.max_tokens % self.step_tokens:
            raise ValueError(
                f"budget range {self.min_tokens}..{self.max_tokens} is not in steps of {self.step_tokens}"
            )
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"budget range: min_tokens {self.min_tokens} is above max_tokens {self.max_tokens}"
            )


def zero_metadata(specs: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """CPU tensors of zeros shaped as `specs` (an adapter's `metadata_specs`), to fill in."""
    return {name: torch.zeros(spec.shape, dtype=spec.dtype) for name, spec in specs.items()}


class VisionAdapter(Protocol):
    """A vision tower seen through the operations the graph code needs.

    Attributes:
        tower: the torch module (the graph code moves it to the device and dtype).
        item_rules: checks and sizes items; small and picklable (a pool's callers get it).
        row_shape: shape of one input row (`item_rules.row_shape`).
        output_row_shapes: per output tensor, shape of one output token's row
            (`item_rules.output_row_shapes`): tokens first, then the extra outputs.
    """

    tower: torch.nn.Module
    item_rules: ItemRules
    row_shape: tuple[int, ...]
    output_row_shapes: tuple[tuple[int, ...], ...]

    def max_rows(self, num_tokens: int) -> int:
        """Input rows of a buffer for a batch of up to `num_tokens` output tokens (round up)."""
        ...

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        """Static metadata buffers for a batch of `num_rows` input rows within `budget`."""
        ...

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        """CPU tensors matching `metadata_specs(num_rows, budget)`, for the items laid out in order
        from row 0. Rows past the items' rows are padding and get valid values too.

        Raises:
            ValueError: the items do not fit `num_rows` or the budget's capacities.
        """
        ...

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """pixels [num_rows, *row_shape] -> one tensor per `output_row_shapes` entry, each
        [n, *row_shape] with n at least the output tokens of the items laid into the rows; each
        item's output rows follow the previous item's, from row 0.

        Must not synchronise with the host: it is captured into a CUDA graph.
        """
        ...

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        """Random valid items that together use at most `num_rows` rows and fit `budget`.

        Used to warm up and check each captured budget on inputs unlike any earlier ones.
        """
        ...

    # ---- members with defaults (`vitpool.models.adapter_base.AdapterBase` gives them) ----------

    paths: Mapping[str, VisionAdapter]
    """Families that run some items through buffers of another shape (a path): the adapter of
    each path by name, "" where the family's plain items go; {"": the adapter itself} for a
    family of one path. Each path gets its own buffers, budgets and graphs; `ItemSpec.path` says
    which path runs an item and `Budget.path` which path a budget is of. Either the rules have
    `parts` (an item of several inputs, `PathRules`: one part per input, joined), or the family's
    own rules set each spec's path (e.g. by the item's kind) and mark each budget with its path."""

    fp8_refused: str | None
    """Why `precision="fp8"` is refused for this family (the encoder's ConfigError says it); None:
    FP8 GEMMs are allowed (`vitpool.kernels.fp8`)."""

    def budget_range(self, device: torch.device) -> BudgetRange | None:
        """The budgets this family's graphs should cover when the user names none; None: the
        device's default ladder (`vitpool.graphs.defaults`)."""
        ...


# A parameter an adapter marks so (`setattr(parameter, KEEPS_DTYPE, True)`) keeps its dtype when the
# encoder casts the tower to its own (a router Hugging Face keeps in fp32: `_keep_in_fp32_modules_strict`)
KEEPS_DTYPE = "_vitpool_keeps_dtype"

# The members `VisionAdapter` and `ItemRules` declare with defaults, which `AdapterBase` and
# `RulesBase` give: an adapter (or its rules) on neither must write them.
ADAPTER_DEFAULTS = ("paths", "fp8_refused", "budget_range")
RULES_DEFAULTS = ("parts", "pixel_rows", "budgets")


def check_adapter(adapter: Any) -> VisionAdapter:
    """`adapter` as it is, where it and its item rules have every member the protocol declares
    with a default; where it is an adapter of a family outside vitpool on neither base.

    Raises:
        TypeError: naming the members it lacks and the bases that give them.
    """
    missing = [name for name in ADAPTER_DEFAULTS if not hasattr(adapter, name)]
    rules = getattr(adapter, "item_rules", None)
    missing += [f"item_rules.{name}" for name in RULES_DEFAULTS if not hasattr(rules, name)]
    if missing:
        raise TypeError(
            f"{type(adapter).__name__} lacks {missing}: derive the adapter from "
            "vitpool.models.adapter_base.AdapterBase and its item rules from vitpool.rules.base.RulesBase, "
            "which give their defaults"
        )
    return adapter
