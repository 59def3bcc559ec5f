"""GPU: every family the registry ships, from its tiny case in tests/unit/family_cases (the
conformance suite's CASE_FIELDS): every budget captured in bf16 (each checked against eager at
capture), and items sampled for each budget against the case's reference (Hugging Face's own path)
in fp32 on the CPU. Skipped without CUDA."""

from __future__ import annotations

import copy
import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import relative_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from family_cases import FAMILIES, case_of

from vitpool import GraphEncoder
from vitpool.specs import BatchPlan

pytestmark = pytest.mark.gpu

# bf16 against Hugging Face's own path in fp32, on tiny random towers: an output of a few tokens
# is not averaged over many (H100, first run: Mistral 3's worst of 22 outputs 2.3e-2, GLM-OCR's
# 1.5e-2, the rest below 1.1e-2). The graph's exactness is the capture's check of every budget
# against the same forward run eagerly (no budget disabled, asserted below).
TOLERANCE = 3e-2
# Mistral 3's tiny tower in bf16 is that far from its fp32 self in Hugging Face's own path too: HF
# bf16 against HF fp32 on the same sampled items, max 3.75e-2, median 1.85e-2 (CPU); vitpool's
# graphs on an H100 gave 3.2e-2
TOLERANCES = {"mistral3": 4e-2}


def check_family(family: str, device: str, dtype: torch.dtype, tolerance: float) -> list[float]:
    """The family's encoder on `device` against its case's reference on the CPU in fp32, items
    sampled for every budget; returns the relative errors."""
    case = case_of(family)
    if getattr(case, "TOO_OLD", None):
        pytest.skip(case.TOO_OLD)
    fields = case.CASE_FIELDS
    reference_encoder = fields["make_encoder"](list(fields["budgets"]))
    reference = fields["reference"](reference_encoder)
    adapter = copy.deepcopy(reference_encoder.adapter)
    encoder = GraphEncoder(adapter, budgets=list(fields["budgets"]), device=device, dtype=dtype)
    stats = encoder.stats()
    if device == "cuda":
        assert len(stats.captured_budgets) == len(encoder.budgets) and stats.disabled_budgets == []
    errors = []
    for number, budget in enumerate(encoder.budgets):
        path_adapter = getattr(encoder.adapter, "paths", {}).get(budget.path, encoder.adapter)
        specs = path_adapter.sample_specs(
            path_adapter.max_rows(budget.num_tokens), budget, random.Random(number)
        )
        specs = [dataclasses.replace(spec, path=budget.path) for spec in specs]
        generator = torch.Generator().manual_seed(number)
        pixels = [torch.randn(spec.pixel_shape, generator=generator) for spec in specs]
        # One planned batch of the budget's path, as the conformance suite runs it: for a family of
        # several paths an item's outputs are then its part's alone, as the reference gives them.
        [outcomes] = encoder.run_plans([(BatchPlan(budget, tuple(specs)), pixels)], "cpu")
        for spec, item_pixels, embedding in zip(specs, pixels, outcomes, strict=True):
            with torch.no_grad():
                wanted = reference(fields["item_for"](spec, item_pixels))
            for got, want in zip(embedding.outputs, wanted, strict=True):
                got = got.float().cpu()
                assert torch.isfinite(got).all(), family
                errors.append(relative_error(got, want.float().cpu()))
                assert errors[-1] <= tolerance, f"{family}, budget {budget}: {errors[-1]}"
    return errors


@pytest.mark.parametrize("family", FAMILIES)
def test_every_budget_is_captured_and_sampled_items_match_the_reference(family):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    errors = check_family(family, "cuda", torch.bfloat16, TOLERANCES.get(family, TOLERANCE))
    print(f"{family}: {len(errors)} outputs, largest relative error {max(errors):.2e}")
