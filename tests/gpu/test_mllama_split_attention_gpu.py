"""GPU: Llama 3.2 Vision's split attention (`vitpool.families.mllama.split_attention`) in captured
graphs, bf16: every budget's graph, fed fresh random images, against Hugging Face's eager masked
path (the model's own vision model and projector), finite; the split and the masked path in graphs
agree; the split runs call B on the packed kernel. A head size of 80, as the released model's.
Skipped without CUDA."""

from __future__ import annotations

import copy
import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import relative_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # family_cases/ lives there

from family_cases import mllama as case
from family_cases.common import randomize

from vitpool import GraphEncoder, Image
from vitpool.families.mllama import split_attention as split
from vitpool.families.mllama.adapter import MllamaAdapter, MllamaEncoder

pytestmark = pytest.mark.gpu

TILE_TOKENS = case.TOKENS_PER_TILE
BUDGET_TILES = (1, 4, 8, 16)  # one, one, two and four image slots
BUDGETS = [TILE_TOKENS * tiles for tiles in BUDGET_TILES]
# bf16 against the model's eager masked SDPA: different kernels and summation orders
TOLERANCE = 1.5e-2
HIDDEN = 160  # two heads of 80


def gpu_model() -> torch.nn.Module:
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    vision = {**case.TINY_VISION, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN}
    vision["vision_output_dim"] = HIDDEN * (1 + len(vision["intermediate_layers_indices"]))
    config = MllamaConfig(vision_config=vision, text_config=dict(case.TINY_TEXT))
    config._attn_implementation = "sdpa"
    model = MllamaForConditionalGeneration(config)
    randomize(model.model.vision_model, 11)
    randomize(model.model.multi_modal_projector, 12)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def model():
    return gpu_model()


@pytest.fixture(scope="module")
def reference(model):
    """The model's vision model and projector, eager, masked SDPA, bf16 on the GPU."""
    inner = model.model
    vision = copy.deepcopy(inner.vision_model).to("cuda", torch.bfloat16)
    projector = copy.deepcopy(inner.multi_modal_projector).to("cuda", torch.bfloat16)

    def tokens(item: Image) -> torch.Tensor:
        inputs = {name: tensor.to("cuda") for name, tensor in case.processor_layout(item).items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
        with torch.no_grad():
            states = vision(**inputs).last_hidden_state
            projected = projector(states)[0, 0, : len(item.pixel_values)]
        return projected.reshape(-1, projected.shape[-1])

    return tokens


def encoder_of(model, split_on: bool) -> GraphEncoder:
    inner = model.model
    tower = MllamaEncoder(copy.deepcopy(inner.vision_model), copy.deepcopy(inner.multi_modal_projector))
    adapter = MllamaAdapter(tower)
    adapter.split_attention = split_on  # before capture: the graphs record one path or the other
    return GraphEncoder(adapter, budgets=BUDGETS, device="cuda", dtype=torch.bfloat16)


def batches(seed: int) -> list[list[Image]]:
    """Fresh random images, one batch for each budget: 1 tile; 2 to 4 tiles in one image; two
    images over 4 tiles; three or four images over 8 tiles."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)

    def image(tiles: int) -> Image:
        canvas = rng.choice([c for c in case.ASPECT_RATIOS if c[0] * c[1] == tiles])
        return Image(torch.randn(tiles, *case.ROW_SHAPE, generator=generator), canvas)

    return [
        [image(1)],
        [image(rng.randint(2, 4))],
        [image(4), image(rng.randint(1, 4))],
        [image(4), image(4), *[image(rng.randint(1, 4)) for _ in range(rng.randint(1, 2))]],
    ]


@pytest.mark.parametrize("split_on", [True, False], ids=["split", "masked"])
def test_every_budgets_graph_matches_the_models_masked_path(model, reference, split_on, monkeypatch):
    encoder = encoder_of(model, split_on)
    stats = encoder.stats()
    assert sorted({tokens for tokens, _ in stats.captured_budgets}) == BUDGETS
    assert stats.disabled_budgets == []
    calls = []
    original = split.flash_varlen
    monkeypatch.setattr(split, "flash_varlen", lambda *a, **k: calls.append(1) or original(*a, **k))
    for seed in (1, 2):  # fresh values in the same buffers: the graphs replay with new indices
        for batch in batches(seed):
            for item, embedding in zip(batch, encoder.encode(batch), strict=True):
                want = reference(item)
                assert embedding.tokens.shape == want.shape
                assert torch.isfinite(embedding.tokens).all()
                assert relative_error(embedding.tokens, want) <= TOLERANCE
    stats = encoder.stats()
    assert set(stats.replays_per_budget) == set(BUDGETS)  # every budget's graph ran
    assert stats.eager_batches == 0 and stats.eager_items == 0
    assert calls == []  # replays launch captured kernels: no Python attention runs


def test_the_split_and_the_masked_graphs_agree_and_call_b_is_packed(model, monkeypatch):
    kernels = []
    original = split.flash_varlen
    monkeypatch.setattr(split, "flash_varlen", lambda *a, **k: kernels.append(1) or original(*a, **k))
    split_encoder = encoder_of(model, True)
    assert kernels  # captured with call B on the packed kernel: the split, not the model's path
    masked_encoder = encoder_of(model, False)
    items = [image for batch in batches(3) for image in batch]
    for a, b in zip(split_encoder.encode(items), masked_encoder.encode(items), strict=True):
        assert relative_error(a.tokens, b.tokens) <= TOLERANCE
