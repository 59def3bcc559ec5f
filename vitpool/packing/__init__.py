"""Budgets and bin-packing. Imports neither torch nor Ray, so its logic tests in milliseconds."""

from vitpool.packing.budgets import Budget, budget_ladder, make_budgets
from vitpool.packing.cost import batch_cost
from vitpool.packing.packer import Batch, ItemCost, pack

__all__ = ["Batch", "Budget", "ItemCost", "batch_cost", "budget_ladder", "make_budgets", "pack"]
