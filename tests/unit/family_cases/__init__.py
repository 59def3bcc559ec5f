"""Every family's tiny test case: one module here per family vitpool ships, named as the family's
package under `vitpool/families/` (its record's `name`), and helpers shared by several (`common`).

`FAMILIES` is the one list the cross-family tests parametrize over: the families the registry finds
(`vitpool.models.registry.RECORDS`), not a list kept by hand, so a new family's folder puts it under
every such test. `case_of(family)` is its case module; `test_family_cases.py` checks that the cases
here and the registry's records agree (a family without a case, or a case of no family, fails a
test that names it).

What each case module offers (`CASE_FIELDS`, the adapter conformance suite's fields, is every
case's; the rest only where the family's tests need it):

- `CASE_FIELDS`: `make_encoder` (budgets -> a CPU fp32 encoder of the tiny model), `reference` (the
  encoder -> the family's reference forward of one item alone), `item_for`, `bad_items`, `budgets`.
- `save_tower(directory)`: the tiny tower saved as a tower-only checkpoint (config.json and
  safetensors) whose items are patch rows and a grid, `Image`s (and `Video`s where the record's
  processor gives videos); `ROW_SHAPE` or `ROW_WIDTH` one row's shape; `tower_tokens(module,
  pixels, grid_thw)` Hugging Face's tokens for one item where they are not
  `module(pixels, grid_thw=...).pooler_output`; `TANH_GELU_MLP` where its blocks' MLPs are
  tanh-GELU (vitpool fuses the GELU into the GEMM's epilogue). What the pool and GPU tests that
  load a checkpoint run on (`tests/family_tiny.py`).
- `TILE_SHAPE`, `TOKENS_PER_TILE`: a tiled family's, whose items are `Image(tiles)`, any number of
  tiles of that shape, that many tokens each (`hf_model(seed)` its full model).
- `LOCAL_ROW_SHAPE`: a family whose item is a global view (`GLOBAL_ROW_SHAPE`) and crops, on two
  paths; `strip_of`: one whose items are slices of several sizes, as the processor's strip (its
  `adapter_of(model)` the adapter over its tiny model's tower).
- `TOO_OLD`: why the installed transformers cannot build the family (the tests skip), or None.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from vitpool.models.registry import RECORDS

# modules here that are no family's case
HELPERS = frozenset({"common"})

RECORD_OF = {record.name: record for record in RECORDS}
FAMILIES: tuple[str, ...] = tuple(sorted(RECORD_OF))


def case_names() -> tuple[str, ...]:
    """The case modules here, by name (helpers left out)."""
    return tuple(sorted(info.name for info in pkgutil.iter_modules(__path__) if info.name not in HELPERS))


def has_case(family: str) -> bool:
    return family in case_names()


def case_of(family: str) -> ModuleType:
    """The family's case module (`family_cases.<family>`)."""
    if not has_case(family):
        raise LookupError(
            f"family {family!r} has no test case: add tests/unit/family_cases/{family}.py "
            "(its CASE_FIELDS, as the other families' modules there)"
        )
    return importlib.import_module(f"{__name__}.{family}")


def families_offering(name: str) -> list[str]:
    """The families whose case module defines `name` (a family without a case is left out here:
    the agreement test names it)."""
    return [family for family in FAMILIES if has_case(family) and hasattr(case_of(family), name)]
