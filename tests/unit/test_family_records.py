"""Each family lives in one package with one record, and everything keyed by a family reads the
records: the registry's towers, vLLM's layouts, the gateway's grid families, Dynamo's families and
the transformers drop-in's stand-ins."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import vitpool.families
from vitpool.models.family import FamilyRecord, named_object
from vitpool.models.registry import FAMILIES, RECORDS, record_of, tower_family

ROOT = Path(vitpool.families.__file__).parents[1]
PACKAGES = sorted(info.name for info in pkgutil.iter_modules(vitpool.families.__path__) if info.ispkg)


def test_every_package_has_its_record_and_the_registry_reads_them_all():
    assert [record.name for record in RECORDS] == PACKAGES
    towers = [tower for record in RECORDS for tower in record.towers]
    assert set(towers) <= set(FAMILIES)
    model_types = [model_type for record in RECORDS for model_type in record.model_types]
    assert len(model_types) == len(set(model_types))
    for record in RECORDS:
        claimed = [tower for tower in record.towers if tower not in record.full_checkpoint_towers]
        for model_type in (*claimed, *record.model_types):
            first = next(
                r
                for r in RECORDS
                if model_type in (*r.model_types, *(t for t in r.towers if t not in r.full_checkpoint_towers))
            )
            assert record_of(model_type) is first  # a tower type several families share: the first's
        for tower in record.towers:  # ... and a full checkpoint's own family's, through its model type
            for model_type in record.model_types:
                assert tower_family(model_type, tower) is record.towers[tower]
    shared = {tower for tower in towers if towers.count(tower) > 1}
    assert shared <= {"siglip_vision_model", "clip_vision_model"}, (
        f"tower types now shared by several families: {shared}"
    )


@pytest.mark.parametrize("name", PACKAGES)
def test_a_records_names_resolve(name):
    """Every "module:Class" a record names imports, and each tower's adapter is found lazily."""
    record = importlib.import_module(f"vitpool.families.{name}").RECORD
    if record.image_features is not None:
        assert record.image_features.startswith(f"vitpool.families.{name}.")
        assert isinstance(named_object(record.image_features), type)
    if record.transformers_parts is not None and record.transformers_parts.encoder_module is not None:
        assert isinstance(named_object(record.transformers_parts.encoder_module), type)


def test_a_record_refuses_what_no_integration_reads():
    with pytest.raises(ValueError, match="vllm_layout"):
        FamilyRecord("x", {}, ("x",), vllm_layout="rows")
    with pytest.raises(ValueError, match="one of them"):
        FamilyRecord("x", {}, ("x",), image_features="m:C")  # and the default tower parts


def test_the_integrations_derive_their_families_from_the_records():
    from vitpool.integrations.vllm.images import GRID_FAMILIES
    from vitpool.integrations.vllm.layouts import supported_model_types

    assert GRID_FAMILIES == {t for r in RECORDS if r.grid_processor for t in r.model_types}
    assert supported_model_types() == sorted(t for r in RECORDS if r.vllm_layout for t in r.model_types)


def test_no_module_outside_the_families_keeps_a_table_of_family_names():
    """A literal family `model_type` in code outside vitpool/families (and the records' data
    module) means a second place to edit when a family is added."""
    names = {t for record in RECORDS for t in (*record.towers, *record.model_types)}
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if "families" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not offenders, "family names outside vitpool/families:\n" + "\n".join(offenders)
