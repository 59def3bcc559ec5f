"""GPU: the families whose item is a global view and crops on two paths (Step-3.7, DeepSeek-OCR-2)
or slices of several sizes (MiniCPM-V 4.6 and 4.7), from their tiny cases in tests/unit/family_cases:
every budget of every path captured in bf16 and checked against eager at capture, whole items
against Hugging Face's `get_image_features` run in fp32 on the same GPU. Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import relative_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from family_cases import case_of, families_offering

from vitpool import GraphEncoder, Image

pytestmark = pytest.mark.gpu

TOLERANCE = 1.5e-2  # bf16 against Hugging Face's own path in fp32
# Only these: whole items of several parts (test_sampled_items_gpu.py checks each part alone) or of
# slices of unlike sizes, which the other families' items are not. A global view and crops: the
# case's LOCAL_ROW_SHAPE; slices: items in the processor's strip (the case's `strip_of`).
GLOBAL_AND_CROPS_FAMILIES = families_offering("LOCAL_ROW_SHAPE")
SLICES_FAMILIES = families_offering("strip_of")
GLOBAL_AND_CROPS = {"step3p7": (0, 3, 5, 1, 8), "deepseek_ocr2": (0, 2, 3)}  # crops per item, by family
MINICPM_SLICES = ([[4, 4]], [[8, 4], [4, 4], [4, 8]], [[4, 8]], [[8, 8], [4, 4]])


def build(family: str, case) -> tuple[torch.nn.Module, GraphEncoder, list[Image]]:
    generator = torch.Generator().manual_seed(1)
    budgets = list(case.CASE_FIELDS["budgets"])
    if family in SLICES_FAMILIES:  # each case's own adapter (MiniCPM-OCR's reads its mode; 4.7's is 4.6's)
        model = case.tiny_model(seed=2)
        adapter = case.adapter_of(model)
        items = [
            Image(torch.randn(sum(h * w for h, w in sizes), *case.ROW_SHAPE, generator=generator), sizes)
            for sizes in MINICPM_SLICES
        ]
    else:
        model = case.hf_model(seed=2)
        adapter = case.encoder_of(model, budgets[:1]).adapter  # its own copy of the weights

        def item(crops: int) -> Image:
            view = torch.randn(1, *case.GLOBAL_ROW_SHAPE, generator=generator)
            local = torch.randn(crops, *case.LOCAL_ROW_SHAPE, generator=generator)
            return Image(view, inputs={"pixel_values_local": local} if crops else None)

        items = [item(count) for count in GLOBAL_AND_CROPS[family]]
    encoder = GraphEncoder(adapter, budgets=budgets, device="cuda", dtype=torch.bfloat16)
    return model.to("cuda", torch.float32), encoder, items


@pytest.mark.parametrize("family", sorted([*GLOBAL_AND_CROPS_FAMILIES, *SLICES_FAMILIES]))
def test_every_budget_is_captured_and_items_match_get_image_features(family):
    case = case_of(family)
    if getattr(case, "TOO_OLD", None):
        pytest.skip(case.TOO_OLD)
    model, encoder, items = build(family, case)
    stats = encoder.stats()
    assert len(stats.captured_budgets) == len(encoder.budgets) and stats.disabled_budgets == []
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        on_gpu = Image(
            item.pixel_values.cuda(),
            item.grid_thw,
            None if item.inputs is None else {name: t.cuda() for name, t in item.inputs.items()},
        )
        want = case.image_features(model, on_gpu)
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want) <= TOLERANCE, family
    assert encoder.stats().graph_items == sum(1 + bool(item.inputs) for item in items)
