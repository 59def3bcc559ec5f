"""What every model adapter must do, checked the same way for each family (CPU, fp32).

Every family the registry ships is checked (`family_cases.FAMILIES`), each by its case module,
tests/unit/family_cases/<family>.py, whose CASE_FIELDS say how to build an encoder of it, its
reference forward on one item alone (Hugging Face's own tower where transformers has the family),
how an item looks given its spec, and a few bad items. The suite checks:

- the static forward through GraphEncoder against the reference, item by item, at every budget;
- padding rows and neighbours do not change an item's rows;
- `sample_specs` gives valid items that fit the budget (capture and checks rely on them);
- bad items raise InvalidItemError naming the item; non-finite pixels fail their item alone;
- a capacity limit the family does not have, or one that is not positive, is refused;
- the item rules pickle, and import without transformers (a pool's callers load them).

A family whose item is several inputs (`vitpool.rules.paths`) is checked part by part: each
budget belongs to one path, items are sampled by that path's adapter, and a part's spec is found
among the parts of the item its case builds for it.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import toy_family
from conftest import relative_error
from family_cases import FAMILIES, case_of

from vitpool import GraphEncoder, Image, InvalidItemError
from vitpool.graphs.inputs import totals
from vitpool.items import prepare_item
from vitpool.packing import fits
from vitpool.rules.paths import rules_of_part
from vitpool.specs import BatchPlan, ItemSpec

TOLERANCE = 1e-5
TESTS_DIRECTORY = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class FamilyCase:
    """One family under the suite.

    Attributes:
        make_encoder: a CPU fp32 encoder of the family with these token budgets.
        reference: the encoder -> the family's reference forward of one item alone (its outputs
            in `OutputLayout` order).
        item_for: an item with this spec and these pixels, as a caller would build it.
        bad_items: (an item the rules must refuse, words of the message).
        budgets: a small ladder of token budgets.
    """

    make_encoder: Callable[[list[int]], GraphEncoder]
    reference: Callable[[GraphEncoder], Callable[[Any], list[torch.Tensor]]]
    item_for: Callable[[ItemSpec, torch.Tensor], Any]
    bad_items: tuple[tuple[Any, str], ...]
    budgets: tuple[int, ...]


def toy_reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    return lambda item: list(encoder.adapter.tower(item.pixel_values))


TOY_TILES = FamilyCase(
    make_encoder=lambda budgets: GraphEncoder(
        toy_family.ToyTilesAdapter(toy_family.ToyTilesTower(toy_family.ToyTilesConfig())),
        budgets=budgets,
        device="cpu",
        dtype=torch.float32,
    ),
    reference=toy_reference,
    item_for=lambda spec, pixels: Image(pixels),
    bad_items=(
        (Image(torch.randn(2, 3, 8, 8), (1, 2, 2)), "no grid"),
        (Image(torch.randn(4, 192)), "must be tiles"),
    ),
    budgets=(8, 16, 32),
)

# Every family the registry ships (its case: tests/unit/family_cases/<family>.py), and a test's
# family registered from outside vitpool/families (tests/toy_family.py).
EXTRA_CASES = {"toy_tiles": TOY_TILES}
CASE_NAMES = sorted([*FAMILIES, *EXTRA_CASES])


def family_case(name: str) -> FamilyCase:
    if name in EXTRA_CASES:
        return EXTRA_CASES[name]
    module = case_of(name)
    if getattr(module, "TOO_OLD", None):
        pytest.skip(module.TOO_OLD)
    return FamilyCase(**module.CASE_FIELDS)


@pytest.fixture(scope="module", params=CASE_NAMES)
def case(request) -> FamilyCase:
    return family_case(request.param)


@pytest.fixture(scope="module")
def encoder(case) -> GraphEncoder:
    return case.make_encoder(list(case.budgets))


@pytest.fixture(scope="module")
def reference(case, encoder):
    return case.reference(encoder)


def adapter_of(encoder: GraphEncoder, path: str):
    """The adapter that runs items of `path` (the family's own, or its path's)."""
    return getattr(encoder.adapter, "paths", {}).get(path, encoder.adapter)


def sampled(
    case: FamilyCase, encoder: GraphEncoder, budget, seed: int
) -> tuple[list[ItemSpec], list[torch.Tensor]]:
    """Random valid items for `budget` from its path's adapter, with random pixels."""
    adapter = adapter_of(encoder, budget.path)
    specs = adapter.sample_specs(adapter.max_rows(budget.num_tokens), budget, random.Random(seed))
    specs = [dataclasses.replace(spec, path=budget.path) for spec in specs]
    generator = torch.Generator().manual_seed(seed)
    return specs, [torch.randn(spec.pixel_shape, generator=generator) for spec in specs]


def fitting_budget(encoder: GraphEncoder, specs: list[ItemSpec]):
    """The smallest budget of the items' path that holds them, rows included; None if none does."""
    adapter = adapter_of(encoder, specs[0].path)
    for budget in encoder.budgets:
        rows_fit = sum(spec.num_rows for spec in specs) <= adapter.max_rows(budget.num_tokens)
        if budget.path == specs[0].path and rows_fit and fits(budget, *totals(specs)):
            return budget
    return None


def prepared_spec(case: FamilyCase, spec: ItemSpec, pixels: torch.Tensor, rules) -> ItemSpec:
    """The spec the rules give the item the case builds for `spec` (its part of `spec`'s path)."""
    prepared = prepare_item(0, case.item_for(spec, pixels), rules)
    return next(part.spec for part in prepared.parts if part.spec.path == spec.path)


def assert_matches(case, encoder, reference, specs, pixels, outcomes) -> None:
    assert len(outcomes) == len(specs)
    for spec, item_pixels, embedding in zip(specs, pixels, outcomes):
        assert [tuple(t.shape) for t in embedding.outputs] == encoder.output_layout.shapes(spec.num_tokens)
        with torch.no_grad():
            expected = reference(case.item_for(spec, item_pixels))
        for got, want in zip(embedding.outputs, expected, strict=True):
            assert torch.isfinite(got).all()
            assert relative_error(got, want) <= TOLERANCE


def test_every_budget_matches_the_reference(case, encoder, reference):
    for number, budget in enumerate(encoder.budgets):
        specs, pixels = sampled(case, encoder, budget, seed=number)
        before = encoder.stats().replays_per_budget.get(budget.num_tokens, 0)
        [outcomes] = encoder.run_plans([(BatchPlan(budget, tuple(specs)), pixels)], "cpu")
        assert_matches(case, encoder, reference, specs, pixels, outcomes)
        assert encoder.stats().replays_per_budget[budget.num_tokens] == before + 1


def test_padding_and_neighbours_do_not_change_an_items_rows(case, encoder):
    smallest = encoder.budgets[0]
    largest = [budget for budget in encoder.budgets if budget.path == smallest.path][-1]
    [spec], [pixels] = (values[:1] for values in sampled(case, encoder, smallest, seed=11))
    neighbours, neighbour_pixels = sampled(case, encoder, largest, seed=12)
    plans = {
        "alone, smallest budget": BatchPlan(smallest, (spec,)),
        "alone, largest budget": BatchPlan(largest, (spec,)),
    }
    runs = {name: encoder.run_plans([(plan, [pixels])], "cpu")[0][0] for name, plan in plans.items()}
    crowded_specs, crowded_pixels = [], []
    for neighbour, neighbour_pixel in zip(neighbours, neighbour_pixels):  # as many as fit beside the item
        if fitting_budget(encoder, [*crowded_specs, neighbour, spec]) is not None:
            crowded_specs.append(neighbour)
            crowded_pixels.append(neighbour_pixel)
    assert crowded_specs, "no neighbour fits beside the item"
    crowded_specs, crowded_pixels = [*crowded_specs, spec], [*crowded_pixels, pixels]
    crowded = BatchPlan(fitting_budget(encoder, crowded_specs), tuple(crowded_specs))
    runs["with neighbours"] = encoder.run_plans([(crowded, crowded_pixels)], "cpu")[0][-1]
    for name, embedding in runs.items():
        for got, want in zip(embedding.outputs, runs["alone, smallest budget"].outputs, strict=True):
            assert relative_error(got, want) <= TOLERANCE, name


def test_sampled_items_are_valid_and_fit_their_budget(case, encoder):
    rules = encoder.adapter.item_rules
    for number, budget in enumerate(encoder.budgets):
        specs, pixels = sampled(case, encoder, budget, seed=100 + number)
        assert specs, f"no items sampled for {budget}"
        for spec, item_pixels in zip(specs, pixels):
            assert prepared_spec(case, spec, item_pixels, rules) == spec
        assert fits(budget, *totals(specs))
        assert sum(spec.num_rows for spec in specs) <= adapter_of(encoder, budget.path).max_rows(
            budget.num_tokens
        )


def test_a_bad_item_is_named_and_the_encoder_keeps_working(case, encoder):
    [good], [good_pixels] = (values[:1] for values in sampled(case, encoder, encoder.budgets[0], seed=21))
    good_item = case.item_for(good, good_pixels)
    before = encoder.encode([good_item])[0].tokens
    for bad, words in case.bad_items:
        with pytest.raises(InvalidItemError) as raised:
            encoder.encode([good_item, bad])
        assert raised.value.index == 1 and words in str(raised.value)
    assert torch.equal(encoder.encode([good_item])[0].tokens, before)


def test_a_capacity_limit_the_family_lacks_or_not_positive_is_refused(case, encoder):
    def encoder_with(capacity_limits: dict[str, int]) -> GraphEncoder:
        return GraphEncoder(
            encoder.adapter,
            budgets=list(case.budgets),
            device="cpu",
            dtype=torch.float32,
            capacity_limits=capacity_limits,
        )

    with pytest.raises(ValueError, match="bounds no 'no_such_capacity'"):
        encoder_with({"no_such_capacity": 4})
    for name in encoder.adapter.item_rules.capacities:
        with pytest.raises(ValueError, match=f"capacity_limits\\['{name}'\\] must be a positive integer"):
            encoder_with({name: 0})


def test_a_batch_shaped_like_the_last_reuses_its_metadata(monkeypatch, case, encoder, reference):
    """Metadata depends only on the specs and the budget: a batch shaped like the one before it
    is not given its metadata again, and still matches the reference; another shape in between
    writes its own, and the first shape's comes back."""
    budget = encoder.budgets[-1]
    specs, pixels = sampled(case, encoder, budget, seed=43)
    other_specs, other_pixels = next(
        sample for seed in range(44, 120) if (sample := sampled(case, encoder, budget, seed))[0] != specs
    )
    builds = []
    adapter = adapter_of(encoder, budget.path)
    build = adapter.build_metadata
    monkeypatch.setattr(adapter, "build_metadata", lambda *args: builds.append(1) or build(*args))
    plan = BatchPlan(fitting_budget(encoder, specs), tuple(specs))
    other_plan = BatchPlan(fitting_budget(encoder, other_specs), tuple(other_specs))
    encoder.run_plans([(other_plan, other_pixels)], "cpu")
    [first] = encoder.run_plans([(plan, pixels)], "cpu")
    [again] = encoder.run_plans([(plan, [p + 1 for p in pixels])], "cpu")  # same shapes, other pixels
    assert len(builds) == 2
    encoder.run_plans([(other_plan, other_pixels)], "cpu")
    [back] = encoder.run_plans([(plan, pixels)], "cpu")
    assert len(builds) == 4
    assert_matches(case, encoder, reference, specs, [p + 1 for p in pixels], again)
    for got, want in zip(back, first, strict=True):
        assert all(torch.equal(g, w) for g, w in zip(got.outputs, want.outputs))


def test_non_finite_pixels_fail_their_item_alone(case, encoder, reference):
    specs, pixels = next(
        sample
        for budget in reversed(encoder.budgets)
        for seed in range(31, 100)
        if len((sample := sampled(case, encoder, budget, seed))[0]) >= 2
    )
    specs, pixels = specs[:2], pixels[:2]
    pixels[1].view(-1)[0] = float("nan")
    [outcomes] = encoder.run_plans([(BatchPlan(fitting_budget(encoder, specs), tuple(specs)), pixels)], "cpu")
    assert isinstance(outcomes[1], InvalidItemError) and outcomes[1].index == 1
    assert "NaN or infinity" in outcomes[1].reason
    assert_matches(case, encoder, reference, specs[:1], pixels[:1], outcomes[:1])


def test_item_rules_pickle_and_give_equal_specs(case, encoder):
    rules = encoder.adapter.item_rules
    unpickled = pickle.loads(pickle.dumps(rules))
    assert unpickled == rules
    specs, pixels = sampled(case, encoder, encoder.budgets[-1], seed=41)
    for spec, item_pixels in zip(specs, pixels):
        assert (
            prepared_spec(case, spec, item_pixels, unpickled)
            == prepared_spec(case, spec, item_pixels, rules)
            == spec
        )
    assert sorted(unpickled.budgets(list(case.budgets), None, {})) == encoder.budgets


def test_the_rules_give_back_a_spec_from_its_own_layout(case, encoder):
    """An actor checks each spec it receives by deriving it again from its layout."""
    rules = encoder.adapter.item_rules
    for number, budget in enumerate(encoder.budgets):
        for spec in sampled(case, encoder, budget, seed=200 + number)[0]:
            derived = rules_of_part(rules, spec.path).item_spec(
                spec.modality, spec.pixel_shape, spec.pixel_dtype, spec.layout
            )
            assert dataclasses.replace(derived, path=spec.path) == spec


def test_item_rules_import_without_transformers(encoder):
    module = type(encoder.adapter.item_rules).__module__
    check = (
        f"import sys; sys.path.insert(0, {str(TESTS_DIRECTORY)!r}); import {module}; "
        "assert 'transformers' not in sys.modules, sorted(m for m in sys.modules if 'transformers' in m)"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
