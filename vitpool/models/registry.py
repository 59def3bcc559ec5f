"""Model families by the vision config's `model_type`.

The families vitpool ships are the packages under `vitpool/families/`, each with its
`FamilyRecord` (`RECORD`): the registry finds them there, so adding a family touches its own
folder alone. A family that lives elsewhere (out of tree, or a test's) registers itself with
`register_family` when its module is imported; name that module in the environment variable
`VITPOOL_FAMILY_MODULES` (comma-separated module names, importable where the encoder runs) and
every lookup imports it first. Ray actors inherit the driver's environment, so a family named
there reaches the pool's actor processes too.

Importing this module imports neither torch nor transformers: records are plain data, and each
family's callables import their modeling code when called.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from typing import Any

from vitpool.errors import CheckpointError
from vitpool.models.family import (  # noqa: F401 - where callers have found them
    CheckpointLayout,
    Family,
    FamilyRecord,
    read_hf_config,
    vision_config_of,
)

FAMILY_MODULES_VARIABLE = "VITPOOL_FAMILY_MODULES"
FAMILIES_PACKAGE = "vitpool.families"


def _shipped_records() -> tuple[FamilyRecord, ...]:
    package = importlib.import_module(FAMILIES_PACKAGE)
    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__) if info.ispkg)
    return tuple(importlib.import_module(f"{FAMILIES_PACKAGE}.{name}").RECORD for name in names)


RECORDS: tuple[FamilyRecord, ...] = _shipped_records()


# Keyed by the vision config's model_type: every tower of every shipped family, then the registered
# ones. A generic tower type several families build on (SigLIP's `siglip_vision_model`: Gemma 3,
# LLaVA-OneVision) is the first family's here, by name; a full checkpoint finds its own family's
# through its own model_type first (`tower_family`).
def _first_claims(records: tuple[FamilyRecord, ...]) -> tuple[dict[str, Family], dict[str, FamilyRecord]]:
    """Each tower type's family and each type's record, the first record's where several claim it
    (a record's `full_checkpoint_towers` claim nothing: its full checkpoints find it by their type)."""
    families: dict[str, Family] = {}
    by_type: dict[str, FamilyRecord] = {}
    for record in records:
        for tower, family in record.towers.items():
            if tower not in record.full_checkpoint_towers:
                families.setdefault(tower, family)
        claimed = [tower for tower in record.towers if tower not in record.full_checkpoint_towers]
        for model_type in (*claimed, *record.model_types):
            by_type.setdefault(model_type, record)
    return families, by_type


FAMILIES, _RECORD_BY_TYPE = _first_claims(RECORDS)


def tower_family(full_type: str | None, vision_type: str) -> Family | None:
    """The family of a tower of `vision_type` in a full checkpoint of `full_type` (None: a
    tower-only save): the checkpoint's own family's where it has a tower of that type, else
    whichever family has it (`find_family`)."""
    record = _own_record(full_type, vision_type)
    return record.towers[vision_type] if record is not None else find_family(vision_type)


def family_record(full_type: str | None, vision_type: str) -> FamilyRecord | None:
    """The record of the family `tower_family` gives."""
    return _own_record(full_type, vision_type) or record_of(vision_type)


def _own_record(full_type: Any, vision_type: str) -> FamilyRecord | None:
    """The full checkpoint's own family, where it has a tower of `vision_type`."""
    record = record_of(full_type) if isinstance(full_type, str) else None
    return record if record is not None and vision_type in record.towers else None


def record_of(model_type: str) -> FamilyRecord | None:
    """The shipped family of a full checkpoint's or a tower's `model_type` (a "<family>_vision"
    type not listed is taken as its family's); None for one vitpool does not ship."""
    return _RECORD_BY_TYPE.get(model_type) or _RECORD_BY_TYPE.get(model_type.removesuffix("_vision"))


def register_family(model_type: str, family: Family) -> None:
    """Make `model_type` loadable; a family module calls this when imported (registering the
    same type again replaces the earlier entry)."""
    FAMILIES[model_type] = family


def find_family(model_type: str) -> Family | None:
    """The family of `model_type`, after importing the modules named in VITPOOL_FAMILY_MODULES;
    None if no family has that type.

    Raises:
        CheckpointError: a module named there cannot be imported.
    """
    import_family_modules()
    return FAMILIES.get(model_type)


def supported_model_types() -> list[str]:
    import_family_modules()
    return sorted(FAMILIES)


def import_family_modules() -> None:
    """Import the modules named in VITPOOL_FAMILY_MODULES (each registers its families); Python
    caches imported modules, so calling this again costs a dictionary lookup per name."""
    for name in os.environ.get(FAMILY_MODULES_VARIABLE, "").split(","):
        name = name.strip()
        if not name:
            continue
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise CheckpointError(
                f"{FAMILY_MODULES_VARIABLE} names module {name!r}, which cannot be imported ({error}); "
                "fix the name or put the module on PYTHONPATH where the encoder runs"
            ) from None
