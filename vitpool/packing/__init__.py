"""Budgets and bin-packing. Imports neither torch nor Ray, so its logic tests in milliseconds."""

from vitpool.packing.budgets import SEQUENCES, Budget, Needs, budget_ladder, make_budgets, plain_budgets
from vitpool.packing.cost import batch_cost
from vitpool.packing.packer import Batch, ItemCost, Packable, fits, pack, smallest_fitting

__all__ = [
    "SEQUENCES",
    "Batch",
    "Budget",
    "ItemCost",
    "Needs",
    "Packable",
    "batch_cost",
    "budget_ladder",
    "fits",
    "make_budgets",
    "pack",
    "plain_budgets",
    "smallest_fitting",
]
