"""GPU: crops of a size the encoder was not built for (Step-3.7, DeepSeek-OCR-2) run eagerly on the
device beside the captured graphs of the declared size (the CPU tests: tests/unit/test_undeclared_crops.py,
whose cases and items these are). Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import relative_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_undeclared_crops import LOCAL, UNDECLARED, image

from vitpool import GraphEncoder, Image

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family_name", sorted(UNDECLARED))
def test_gpu_undeclared_crops_run_eagerly_beside_the_graphs(family_name):
    """Every budget of both paths captured in bf16 (fused ops on, checked against eager at capture);
    undeclared crops run eagerly on the device (DeepSeek-OCR-2's fused SAM attention with tables of
    their grid), declared ones by the graphs; whole items against `get_image_features` in fp32 on
    the same GPU."""
    case, side, _ = UNDECLARED[family_name]
    model = case.hf_model(seed=22)
    # the case's adapter (its module holds copies of the model's tower), moved to the GPU here
    adapter = case.encoder_of(model, list(case.CASE_FIELDS["budgets"])).adapter
    encoder = GraphEncoder(
        adapter, budgets=list(case.CASE_FIELDS["budgets"]), device="cuda", dtype=torch.bfloat16
    )
    assert encoder.stats().disabled_budgets == []
    model = model.to("cuda", torch.float32)
    items = [image(case, 2, None, 23), image(case, 2, (3, side, side), 24), image(case, 1, None, 25)]
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        on_device = Image(item.pixel_values.cuda(), inputs={LOCAL: item.inputs[LOCAL].cuda()})
        expected = case.image_features(model, on_device)
        assert embedding.tokens.shape == expected.shape and torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens.float(), expected) <= 1.5e-2
    stats = encoder.stats()
    assert stats.eager_batches == 1 and stats.graph_items >= 3
