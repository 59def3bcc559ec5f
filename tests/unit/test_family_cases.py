"""The families' test cases (tests/unit/family_cases) and the registry's records agree: every
family vitpool ships has its case module, and every case module is a shipped family's. The
cross-family tests take their families from the registry (`family_cases.FAMILIES`) and each
family's case by its name, so a family left without a case fails here, by name, and not only
where a test reaches for it."""

from __future__ import annotations

import pytest
from family_cases import FAMILIES, RECORD_OF, case_names, case_of

from vitpool.models.registry import RECORDS


def test_the_families_are_the_registrys_records():
    assert FAMILIES == tuple(sorted(record.name for record in RECORDS))
    assert len(set(FAMILIES)) == len(RECORDS), "two records of one name"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_registered_family_has_a_case(family):
    assert family in case_names(), (
        f"family {family!r} (vitpool/families/{family}) has no test case: add "
        f"tests/unit/family_cases/{family}.py with its CASE_FIELDS"
    )
    fields = case_of(family).CASE_FIELDS
    assert {"make_encoder", "reference", "item_for", "bad_items", "budgets"} <= set(fields), family


@pytest.mark.parametrize("case", case_names())
def test_every_case_is_a_registered_family(case):
    assert case in RECORD_OF, (
        f"tests/unit/family_cases/{case}.py is no registered family's case (the records: "
        f"{', '.join(FAMILIES)}); name it as its family's package, or list a helper in HELPERS"
    )


def test_a_family_without_a_case_is_named():
    with pytest.raises(LookupError, match="'no_such_family' has no test case"):
        case_of("no_such_family")
