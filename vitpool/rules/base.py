"""The base every family's item rules derive from: the defaults of the rules' members that most
families do not write (`vitpool.specs.ItemRules`).

- `pixel_rows`: the view of a processor's pixels that has the item's rows along its first axis;
  the pixels as they are (MiniCPM-V's strip of patches and Mistral 3's images are cut here);
- `parts`: the named inputs of an item of several inputs, each with its rules, in the order their
  outputs are joined (`vitpool.rules.paths.PathRules`); none for an item of one input;
- `budgets`: the captured batch shapes for token budgets; bounded by tokens and items, and by
  attention sequences where the rules have that capacity (`make_budgets`, Qwen's). Rules with
  other capacities write their own.

Plain Python, importing neither torch nor transformers: a pool's callers unpickle these rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vitpool.encoder_spec import check_capacity_limits
from vitpool.packing import SEQUENCES, Budget, make_budgets, plain_budgets

if TYPE_CHECKING:
    from vitpool.specs import ItemRules


class RulesBase:
    """The defaults of `ItemRules`' optional members. A mixin of frozen dataclasses: it adds no
    fields (a subclass declares its own `capacities`)."""

    capacities: tuple[str, ...]
    # An item of one input; `PathRules` lists its inputs.
    parts: tuple[tuple[str, ItemRules], ...] = ()

    def pixel_rows(self, pixel_values: Any) -> Any:
        """`pixel_values` with one of the item's rows per index of the first axis: as they are."""
        return pixel_values

    def budgets(
        self,
        token_budgets: Sequence[int],
        max_items_per_batch: int | None,
        capacity_limits: Mapping[str, int],
    ) -> list[Budget]:
        """Budgets bounded by tokens and items, and by attention sequences where `capacities`
        holds them (`capacity_limits["sequences"]` lowers the default).

        Raises:
            ValueError: a bad setting (`check_capacity_limits`, `make_budgets`).
            NotImplementedError: rules with another capacity, which must write their own.
        """
        others = [name for name in self.capacities if name != SEQUENCES]
        if others:
            raise NotImplementedError(
                f"{type(self).__name__} bounds {others} per batch: it writes its own budgets"
            )
        check_capacity_limits(capacity_limits, self.capacities)
        if SEQUENCES in self.capacities:
            return make_budgets(token_budgets, max_items_per_batch, capacity_limits.get(SEQUENCES))
        return plain_budgets(token_budgets, max_items_per_batch)
