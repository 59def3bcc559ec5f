"""GPU: families whose item is several inputs (Step-3.7: a global view and local crops), each
path's graphs captured in bf16 and checked against eager at capture, whole items (crops and view
joined) against Hugging Face's `get_image_features`. Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import relative_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from family_cases import step3p7 as step3p7_case  # noqa: E402

from vitpool import GraphEncoder, Image  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = 1.5e-2  # bf16 against Hugging Face's own path, as for the other families


def test_step3p7_every_paths_budgets_are_captured_and_items_match_get_image_features():
    model = step3p7_case.hf_model(seed=2)
    adapter = step3p7_case.encoder_of(model, [4]).adapter  # its own copy of the weights
    encoder = GraphEncoder(adapter, budgets=[4, 8, 16], device="cuda", dtype=torch.bfloat16)
    model = model.to("cuda", torch.bfloat16)
    stats = encoder.stats()
    assert len(stats.captured_budgets) == 6 and stats.disabled_budgets == []  # 3 budgets per path
    generator = torch.Generator().manual_seed(1)

    def item(crops: int) -> Image:
        view = torch.randn(1, *step3p7_case.GLOBAL_ROW_SHAPE, generator=generator)
        local = torch.randn(crops, *step3p7_case.LOCAL_ROW_SHAPE, generator=generator)
        return Image(view, inputs={"pixel_values_local": local} if crops else None)

    items = [item(count) for count in (0, 3, 5, 1, 8)]
    for one, embedding in zip(items, encoder.encode(items), strict=True):
        crops = (one.inputs or {}).get("pixel_values_local")
        with torch.no_grad():
            want = model.model.get_image_features(
                pixel_values=one.pixel_values.to("cuda", torch.bfloat16),
                pixel_values_local=None if crops is None else crops.to("cuda", torch.bfloat16),
                num_local_patches=None if crops is None else [crops.shape[0]],
            ).pooler_output[0]
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want) <= TOLERANCE
    assert encoder.stats().graph_items == sum(1 + bool(one.inputs) for one in items)
