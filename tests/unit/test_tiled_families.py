"""The tiled families' own checks (InternVL, Llama 4; the shared ones are in
test_adapter_conformance.py): tiles in and the LLM's tokens out as the HF model hands them over,
loading from full and tower-only saves, the default budgets of whole tiles; and what is one
family's alone. CPU, fp32, tiny random models."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch
from conftest import relative_error
from family_cases import internvl as internvl_case
from family_cases import llama4 as llama4_case
from safetensors.torch import save_file

from vitpool import CheckpointError, GraphEncoder, Image
from vitpool.families.internvl.adapter import InternVLEncoder

TOLERANCE = 1e-5
# per family: its tiny case, its vitpool module, and the projector weight a tower-only save must hold
TILED = {
    "internvl": (internvl_case, "vitpool.families.internvl.adapter", "multi_modal_projector.linear_2.weight"),
    "llama4": (llama4_case, "vitpool.families.llama4.adapter", "multi_modal_projector.linear_1.weight"),
}


@pytest.fixture(scope="module", params=sorted(TILED))
def family(request) -> tuple[str, ModuleType, ModuleType, str]:
    case, module, projector_weight = TILED[request.param]
    return request.param, case, importlib.import_module(module), projector_weight


@pytest.fixture(scope="module")
def model(family):
    return family[1].hf_model(seed=3)


def budgets(case: ModuleType) -> list[int]:
    return [case.TOKENS_PER_TILE * tiles for tiles in (1, 2, 4)]


def tiles(case: ModuleType, count: int, seed: int) -> Image:
    return Image(torch.randn(count, *case.ROW_SHAPE, generator=torch.Generator().manual_seed(seed)))


def assert_matches(case, model, items, embeddings) -> None:
    for item, embedding in zip(items, embeddings, strict=True):
        expected = case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def test_images_of_several_tile_counts_in_one_call(family, model):
    _, case, _, _ = family
    encoder = case.encoder_of(model, budgets(case))
    counts = (1, 3, 2, 1, 5)  # 5 tiles: over every budget
    items = [tiles(case, count, seed) for seed, count in enumerate(counts)]
    embeddings = encoder.encode(items)
    assert [e.tokens.shape[0] for e in embeddings] == [case.TOKENS_PER_TILE * n for n in counts]
    assert_matches(case, model, items, embeddings)
    assert encoder.stats().eager_batches == 1  # the 5-tile image alone, at its own size


def test_loads_a_full_model_save(family, model, tmp_path):
    _, case, _, _ = family
    model.save_pretrained(tmp_path, safe_serialization=True)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=budgets(case), device="cpu", dtype=torch.float32)
    items = [tiles(case, 2, 10), tiles(case, 1, 11)]
    assert_matches(case, model, items, encoder.encode(items))


def test_loads_a_tower_only_save_and_refuses_missing_weights(family, model, tmp_path):
    _, case, module, projector_weight = family
    encoder_module = case.encoder_of(model, budgets(case)).adapter.tower
    module.tower_only_config(model.config).save_pretrained(tmp_path)
    state = {key: value.contiguous() for key, value in encoder_module.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=budgets(case), device="cpu", dtype=torch.float32)
    items = [tiles(case, 3, 12)]
    assert_matches(case, model, items, encoder.encode(items))
    del state[projector_weight]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"missing keys.*{projector_weight}"):
        GraphEncoder.from_pretrained(tmp_path, budgets=budgets(case), device="cpu")


def test_default_budgets_are_whole_tiles(family, model):
    _, case, module, _ = family
    encoder = GraphEncoder(case.encoder_of(model, budgets(case)).adapter, device="cpu", dtype=torch.float32)
    tokens = [budget.num_tokens for budget in encoder.budgets]
    assert tokens[0] == case.TOKENS_PER_TILE and tokens[-1] == module.MAX_GRAPH_TILES * case.TOKENS_PER_TILE
    assert all(value % case.TOKENS_PER_TILE == 0 for value in tokens)


def test_internvl_feature_settings_vitpool_does_not_run_are_refused():
    from vitpool.families.internvl.adapter import InternVLAdapter

    model = internvl_case.hf_model()
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.vision_feature_layer = -2
    module = InternVLEncoder(model.model.vision_tower, model.model.multi_modal_projector, config)
    with pytest.raises(ValueError, match="vision_feature_layer=-1"):
        InternVLAdapter(module)


def test_the_internvl_processors_output_for_one_image_is_one_item():
    """InternVL's image processor (GotOcr2, the releases' settings: 448² crops plus a thumbnail,
    1 to 12 crops) emits one image's tiles as they are: `Image(out["pixel_values"])` is an item of
    that many tiles, 256 tokens each, for the real tower's rules."""
    from PIL import Image as PILImage
    from transformers import GotOcr2ImageProcessorPil

    from vitpool.items import prepare_item
    from vitpool.rules.tiles import TileRules

    processor = GotOcr2ImageProcessorPil(
        crop_to_patches=True, min_patches=1, max_patches=12, size={"height": 448, "width": 448}
    )
    out = processor(images=PILImage.new("RGB", (1000, 600), (200, 120, 40)), return_tensors="pt")
    rules = TileRules(3, 448, 256, ((4096,),))  # InternViT-300M: (448/14)² patches, shuffled by 0.5
    spec = prepare_item(0, Image(out["pixel_values"]), rules).spec
    assert spec.num_rows == int(out["num_patches"][0]) == out["pixel_values"].shape[0] > 1
    assert spec.num_tokens == 256 * spec.num_rows


def test_the_pools_cost_of_a_tiled_batch_prices_attention_per_tile():
    """A tile is one attention sequence: a 13-tile image costs attention over 13 sequences of 256
    tokens, not over one of 3328 (the cost model would rate it 13 times too dear)."""
    from vitpool.packing import batch_cost, pack
    from vitpool.pool.policy import DispatchPolicy
    from vitpool.rules.tiles import TileRules
    from vitpool.specs import IMAGE

    rules = TileRules(3, 448, 256, ((64,),))
    spec = rules.item_spec(IMAGE, (13, 3, 448, 448), "float32", None)
    budgets = rules.budgets([256 * 13], None, {})
    policy = DispatchPolicy(tuple(budgets), 2)
    [batch] = pack([spec], budgets)
    assert policy.cost(batch) == batch_cost(256 * 13, 13) < batch_cost(256 * 13, 1)
