"""Item rules of families whose item is several named inputs, each run by graphs of its own.

Step-3.7 and DeepSeek-OCR-2 cut one image into a global view and local crops of another size;
their processors emit them as two tensors (`pixel_values`, `pixel_values_local`), and the model
runs each through the tower at its own resolution. vitpool calls each input a *path*: an item is
split into one part per input it holds, every part is an ordinary single-tensor item of its
path's rules (its `ItemSpec.path` names the input), parts of one path are packed into that
path's budgets and replayed by that path's graphs (a part of a shape they do not hold, crops of
another size, runs eagerly, alone: `ItemSpec.served_by_graph`), and the item's embedding is its
parts' outputs joined in the order `paths` lists them (the order the model hands them to its LLM).

Plain data: no torch, no transformers (the pool's callers split items in their own process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import Budget
from vitpool.rules.base import RulesBase
from vitpool.specs import ItemRules, ItemSpec

# A part's input as the rules see it: its pixels' shape and dtype name.
PartInput = tuple[tuple[int, ...], str]


@dataclass(frozen=True)
class PathRules(RulesBase):
    """Rules of an item made of named inputs, one path each.

    Attributes:
        paths: (input name, that input's rules) pairs, in the order the item's outputs are
            joined.
        required: the inputs every item must hold, the first of them the item's own
            `pixel_values`; the others may be absent or hold no rows (an image too small to be
            cut into crops).

    Raises:
        ValueError: no paths, duplicate names, a required name that is no path, or paths whose
            outputs differ in shape (their outputs are joined into one tensor each).
    """

    paths: tuple[tuple[str, ItemRules], ...]
    required: tuple[str, ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.paths]
        if not names or len(set(names)) != len(names) or "" in names:
            raise ValueError(f"paths need distinct, non-empty input names; got {names}")
        if not self.required:
            raise ValueError("required must name at least one input: the one an item's pixel_values are")
        unknown = [name for name in self.required if name not in names]
        if unknown:
            raise ValueError(f"required inputs {unknown} are not among the paths {names}")
        shapes = {tuple(rules.output_row_shapes) for _, rules in self.paths}
        if len(shapes) != 1:
            raise ValueError(f"every path must give outputs of one shape to be joined; got {sorted(shapes)}")

    @property
    def parts(self) -> tuple[tuple[str, ItemRules], ...]:
        """The inputs and their rules (`RulesBase.parts`): `paths`."""
        return self.paths

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.paths)

    @property
    def primary(self) -> str:
        """The input an item's `pixel_values` is."""
        return self.required[0]

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.paths[0][1].output_row_shapes

    @property
    def capacities(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c for _, rules in self.paths for c in rules.capacities))

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The primary input's row shape (each path has its own: see `rules_for`)."""
        return self.rules_for(self.primary).row_shape

    def rules_for(self, path: str) -> ItemRules:
        """The rules of input `path`. Raises ValueError for a name that is no path."""
        for name, rules in self.paths:
            if name == path:
                return rules
        raise ValueError(f"this model takes the inputs {list(self.input_names)}; {path!r} is none of them")

    def part_specs(self, modality: str, inputs: Mapping[str, PartInput], layout: Any) -> list[ItemSpec]:
        """The specs of an item's parts, in join order, from its inputs' shapes and dtypes (by
        name). An optional input with no rows gives no part. Raises ValueError naming the input."""
        unknown = [name for name in inputs if name not in self.input_names]
        if unknown:
            raise ValueError(f"unknown inputs {unknown}; this model takes {list(self.input_names)}")
        missing = [name for name in self.required if name not in inputs]
        if missing:
            raise ValueError(f"the item has no {missing}; this model's items need {list(self.required)}")
        specs = []
        for name, rules in self.paths:
            if name not in inputs:
                continue
            shape, dtype = inputs[name]
            if name not in self.required and len(shape) >= 1 and shape[0] == 0:
                continue
            try:
                spec = rules.item_spec(modality, shape, dtype, layout)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            specs.append(dataclasses.replace(spec, path=name))
        return specs

    def item_spec(
        self, modality: str, pixel_shape: tuple[int, ...], pixel_dtype: str, layout: Any
    ) -> ItemSpec:
        """The spec of an item that holds its primary input alone."""
        [spec] = self.part_specs(modality, {self.primary: (pixel_shape, pixel_dtype)}, layout)
        return spec

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """Every path's budgets for these token budgets."""
        return [
            budget
            for name, _ in self.paths
            for budget in self.path_budgets(name, token_budgets, max_items_per_batch, capacity_limits)
        ]

    def path_budgets(
        self,
        path: str,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """Input `path`'s budgets, each marked with its path; a capacity limit applies to the paths
        that have that capacity."""
        check_capacity_limits(capacity_limits, self.capacities)
        rules = self.rules_for(path)
        own = {name: limit for name, limit in capacity_limits.items() if name in rules.capacities}
        return [
            dataclasses.replace(budget, path=path)
            for budget in rules.budgets(token_budgets, max_items_per_batch, own)
        ]


def rules_of_part(rules: Any, path: str) -> ItemRules:
    """The rules that size an item of `path`: for rules of several inputs (`parts`), that
    input's, else the family's own (which set each spec's path themselves, e.g. Kimi-K2.5's
    clips). Raises ValueError for an input the family does not have."""
    if rules.parts and path:
        return rules.rules_for(path)
    return rules
