"""GPU: every family's captured graphs, each budget checked against eager at capture (bf16), and
encodes against Hugging Face's own tower. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import relative_error
from family_tiny import FAMILY_CASES, mixed_items, reference_tokens, save_tiny_tower

from vitpool import GraphEncoder

pytestmark = pytest.mark.gpu

BUDGETS = [16, 64, 256]
TOLERANCE = 1e-2


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_every_budget_is_captured_and_encodes_match_the_tower(tmp_path, family):
    encoder = GraphEncoder.from_pretrained(save_tiny_tower(family, tmp_path), budgets=BUDGETS, device="cuda")
    stats = encoder.stats()
    assert sorted({tokens for tokens, _ in stats.captured_budgets}) == BUDGETS and stats.disabled_budgets == []
    tower = copy.deepcopy(encoder.adapter.tower)
    tower.config._attn_implementation = "sdpa"
    items = mixed_items(family, seed=1)
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        want = reference_tokens(tower, item, encoder.device, encoder.dtype)
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want) <= TOLERANCE
    assert encoder.stats().graph_items == len(items)


def test_kimi_k25_graphs_are_captured_and_match_its_tower_and_projector():
    """Kimi-K2.5: 4-D patch pixels, frames pooled and projected inside the graph."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
    from family_cases import kimi_k25

    from vitpool import Image, Video
    from vitpool.models.kimi_k25 import KimiK25Adapter

    adapter = KimiK25Adapter(kimi_k25.tiny_encoder_module(), row_factor=2)
    encoder = GraphEncoder(adapter, budgets=BUDGETS, device="cuda")
    stats = encoder.stats()
    assert sorted({tokens for tokens, _ in stats.captured_budgets}) == BUDGETS and stats.disabled_budgets == []
    reference = copy.deepcopy(encoder.adapter.tower)
    reference.vision_tower.config._attn_implementation = "sdpa"
    generator = torch.Generator().manual_seed(2)
    items = [
        Image(torch.randn(16, *kimi_k25.ROW_SHAPE, generator=generator), (1, 4, 4)),
        Image(torch.randn(48, *kimi_k25.ROW_SHAPE, generator=generator), (1, 8, 6)),
        Video(torch.randn(32, *kimi_k25.ROW_SHAPE, generator=generator), (2, 4, 4)),
    ]
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        grid = torch.tensor([item.grid_thw], device="cuda")
        with torch.no_grad():
            pixels = item.pixel_values.to("cuda", encoder.dtype)
            want = reference.mm_projector(reference.vision_tower(pixels, grid_thw=grid).pooler_output).squeeze(1)
        assert torch.isfinite(embedding.tokens).all() and relative_error(embedding.tokens, want) <= TOLERANCE
    assert encoder.stats().graph_items == len(items)
