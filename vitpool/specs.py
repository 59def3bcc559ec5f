"""What every layer agrees on about an item and a batch, with no model code.

An item's spec is computed once, in the caller's process, by the model's item rules (see
`ItemRules`): its modality, the shape and dtype its pixels travel in, the family's layout
as plain integers (a grid, a tile count, ...), its rows and output tokens, and what it needs of
each per-batch capacity the family declares (attention sequences, windows, ...). The spec
travels with the pixels; packing, the transport and the actor read it and never look inside.
An encoder's settings and their checks are in `vitpool.encoder_spec`.

Plain Python: importing this module costs nothing, and every value here pickles and turns into
msgpack-able plain values (`*_to_wire` / `*_from_wire`).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from vitpool.packing import Budget, Needs

if TYPE_CHECKING:
    import torch

IMAGE = "image"
VIDEO = "video"
MODALITIES = (IMAGE, VIDEO)

# A capacity that no captured budget has room for: an item that needs it (one a family's tower
# takes but whose pixels are of a shape its path's buffers do not hold, Step-3.7's crops of a size
# the encoder was not built for) fits no budget, so every planner packs it alone, with no budget
# (`vitpool.packing.pack`), and it runs eagerly at its own size, the path every item over the
# largest budget takes. Rules that give such items limit it to 0 in each of their budgets and do
# not list it in `capacities` (no user's setting may make room for it).
NO_GRAPH = "no_graph"


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one static metadata buffer (an adapter's `metadata_specs`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ItemSpec:
    """One checked item, as its model's rules sized it.

    Attributes:
        modality: "image" or "video".
        pixel_shape: the pixels' shape as the processor emitted it; the first dimension is rows
            of the tower's input (patches, or tiles), the rest is `ItemRules.row_shape` (or, for
            an item no graph serves, `served_by_graph` False, the other row shape its rules took).
        pixel_dtype: the pixels' dtype name as they travel (`vitpool.transport.wire`).
        layout: the family's grid or tile layout as plain integers (Qwen: t, h, w; a tiled tower: ()).
        num_tokens: output tokens the item produces.
        needs: what the item uses of each per-batch capacity the rules declare, e.g.
            (("sequences", 2),) for a two-frame video.
        path: the graph set that runs it (`vitpool.packing.Budget.path`): "" for a family with
            one input per item; for an item of several inputs (`PathRules`), the name of the input
            this part of it is (e.g. "pixel_values_local").
    """

    modality: str
    pixel_shape: tuple[int, ...]
    pixel_dtype: str
    layout: tuple[int, ...]
    num_tokens: int
    needs: Needs = ()
    path: str = ""

    @property
    def num_rows(self) -> int:
        return self.pixel_shape[0]

    def need(self, name: str) -> int:
        """What the item uses of capacity `name` (0 where it uses none)."""
        return dict(self.needs).get(name, 0)

    @property
    def served_by_graph(self) -> bool:
        """Whether a graph of its path can run it: False for an item whose pixels' rows are of
        another shape than the path's buffers' (it needs `NO_GRAPH`; it runs eagerly, alone)."""
        return self.need(NO_GRAPH) == 0


def spec_to_wire(spec: ItemSpec) -> list:
    """The spec as msgpack-able plain values."""
    wire = [
        spec.modality,
        list(spec.pixel_shape),
        spec.pixel_dtype,
        list(spec.layout),
        spec.num_tokens,
        [[name, amount] for name, amount in spec.needs],
    ]
    return [*wire, spec.path] if spec.path else wire


def spec_from_wire(value: Any) -> ItemSpec:
    """The spec `spec_to_wire` made; ValueError for anything else."""
    try:
        modality, shape, dtype, layout, num_tokens, needs, *path = value
        if len(path) > 1 or (path and not isinstance(path[0], str)):
            raise ValueError(f"a path is one string; got {path!r}")
        spec = ItemSpec(
            str(modality),
            _ints(shape),
            str(dtype),
            _ints(layout),
            _int(num_tokens),
            tuple((str(name), _int(amount)) for name, amount in needs),
            path[0] if path else "",
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"not an item spec: {value!r} ({error})") from None
    if spec.modality not in MODALITIES or not spec.pixel_shape:
        raise ValueError(f"not an item spec: {value!r}")
    return spec


@dataclass(frozen=True)
class BatchPlan:
    """A batch as the dispatcher packed it: its items' specs, and the budget the dispatcher
    reckoned with (None: an item larger than every budget), an estimate for its own scheduling;
    the encoder that runs the batch picks the budget itself (`GraphEncoder.check_plan`).
    `cache_keys`: empty, or per item the embedding cache's key under which the actor publishes
    its result (None: not this item), for items whose caller claimed them in the pool's cache."""

    budget: Budget | None
    specs: tuple[ItemSpec, ...]
    cache_keys: tuple[bytes | None, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(spec.num_tokens for spec in self.specs)


def plan_to_wire(plan: BatchPlan) -> dict:
    """The plan as msgpack-able plain values."""
    budget = plan.budget
    return {
        # the path only where there is one: a plan of one path reads as before paths existed
        "budget": None
        if budget is None
        else [
            budget.num_tokens,
            [list(p) for p in budget.limits],
            budget.max_items,
            *([budget.path] if budget.path else []),
        ],
        "specs": [spec_to_wire(spec) for spec in plan.specs],
        **({"cache_keys": list(plan.cache_keys)} if plan.cache_keys else {}),
    }


def plan_from_wire(value: Any) -> BatchPlan:
    """The plan `plan_to_wire` made; ValueError for anything else."""
    if not isinstance(value, Mapping) or not isinstance(value.get("specs"), list):
        raise ValueError("not a batch plan")  # noqa: TRY004 - plan_from_wire raises only ValueError
    budget = value.get("budget")
    if budget is not None:
        try:
            num_tokens, limits, max_items, *rest = budget
            path = rest[0] if len(rest) == 1 else "" if not rest else None
            if not isinstance(path, str):
                raise TypeError(f"expected one path string after the item bound; got {rest!r}")
            budget = Budget(
                _int(num_tokens), tuple((str(n), _int(a)) for n, a in limits), _int(max_items), path
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"not a budget: {budget!r} ({error})") from None
    specs = tuple(spec_from_wire(spec) for spec in value["specs"])
    keys = value.get("cache_keys", [])
    if (
        not isinstance(keys, list)
        or (keys and len(keys) != len(specs))
        or any(key is not None and not isinstance(key, bytes) for key in keys)
    ):
        raise ValueError(f"cache keys must be one bytes or None per item ({len(specs)}); got {keys!r}")
    return BatchPlan(budget, specs, tuple(keys))


@dataclass(frozen=True)
class OutputLayout:
    """The tensors an item produces, defined once for the encoder, the transport and the caller.

    Every output tensor has one row per output token: item shapes are (num_tokens, *row_shape)
    for each entry of `row_shapes`; the first is what the LLM receives (`Embedding.tokens`),
    the others are extra outputs it consumes (Qwen3-VL's deepstack features).
    """

    row_shapes: tuple[tuple[int, ...], ...]
    dtype: str  # a wire dtype name; every output has the encoder's dtype

    def shapes(self, num_tokens: int) -> list[tuple[int, ...]]:
        """The shapes of an item's output tensors, for an item of `num_tokens` output tokens."""
        return [(num_tokens, *row_shape) for row_shape in self.row_shapes]


class ItemRules(Protocol):
    """What checking and sizing an item needs, without the weights: small, picklable and
    importable without transformers, so that a pool's callers check items in their own process.

    Attributes:
        row_shape: the shape of one pixel row (a flattened patch [C*T*P*P], or a patch or tile
            [C, P, P]).
        output_row_shapes: per output tensor, the shape of one output token's row.
        capacities: the per-batch capacities an item may need besides tokens and items, by name.
    """

    row_shape: tuple[int, ...]
    output_row_shapes: tuple[tuple[int, ...], ...]
    capacities: tuple[str, ...]

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        """The spec of an item with these pixels and this layout (what the processor emitted
        besides the pixels, e.g. `grid_thw`). Raises ValueError naming what is wrong.

        Given a spec's own `layout` as the layout it must give back that spec: an actor checks
        every spec it receives this way, so a spec that lies about its item fails its batch
        instead of corrupting its neighbours' rows.
        """
        ...

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """The captured batch shapes for these token budgets, each with a limit per capacity the
        family declares: the user's from `capacity_limits` (checked by
        `vitpool.encoder_spec.check_capacity_limits`), else the family's default. Raises
        ValueError naming a bad setting."""
        ...

    # Declared with defaults in `vitpool.rules.base.RulesBase`, which every family's rules derive from:
    parts: tuple[tuple[str, ItemRules], ...]
    """The named inputs of an item of several inputs, each with its rules, in the order their
    outputs are joined (`vitpool.rules.paths.PathRules`); () for an item of one input."""

    def pixel_rows(self, pixel_values: Any) -> Any:
        """The pixels with the item's rows along their first axis: the pixels themselves, except
        where a processor's layout differs (MiniCPM-V's strip of patches)."""
        ...


def is_int(value: Any) -> bool:
    """Whether `value` is an integer: Python's or NumPy's (a processor's grids hold either), never
    a bool (True == 1 in Python) nor a float or a tensor."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(value: Any) -> int:
    if not is_int(value):
        raise ValueError(f"{value!r} is not an integer")
    return int(value)


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{values!r} is not a list of integers")
    return tuple(_int(v) for v in values)
