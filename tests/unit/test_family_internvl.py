"""InternVL's own checks (the shared ones are in test_adapter_conformance.py): tiles in and the
LLM's tokens out as `get_image_features` gives them, loading from full and tower-only saves, and
the family's default budgets of whole tiles. CPU, fp32, tiny random models."""

from __future__ import annotations

import pytest
import torch
from conftest import relative_error
from family_cases.internvl import ROW_SHAPE, TOKENS_PER_TILE, encoder_of, hf_model, image_features
from safetensors.torch import save_file

from vitpool import CheckpointError, GraphEncoder, Image
from vitpool.models.internvl import MAX_GRAPH_TILES, InternVLEncoder, tower_only_config

TOLERANCE = 1e-5
BUDGETS = [4, 8, 16]


@pytest.fixture(scope="module")
def model():
    return hf_model(seed=3)


def tiles(count: int, seed: int) -> Image:
    return Image(torch.randn(count, *ROW_SHAPE, generator=torch.Generator().manual_seed(seed)))


def assert_matches(model, items, embeddings) -> None:
    for item, embedding in zip(items, embeddings, strict=True):
        expected = image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def test_images_of_several_tile_counts_in_one_call(model):
    encoder = encoder_of(model, BUDGETS)
    items = [tiles(count, seed) for seed, count in enumerate((1, 3, 2, 1, 5))]  # 5 tiles: over 16 tokens
    embeddings = encoder.encode(items)
    assert [e.tokens.shape[0] for e in embeddings] == [TOKENS_PER_TILE * n for n in (1, 3, 2, 1, 5)]
    assert_matches(model, items, embeddings)
    assert encoder.stats().eager_batches == 1  # the 5-tile image alone, at its own size


def test_loads_a_full_model_save(model, tmp_path):
    model.save_pretrained(tmp_path, safe_serialization=True)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [tiles(2, 10), tiles(1, 11)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_a_tower_only_save_and_refuses_missing_weights(model, tmp_path):
    module = InternVLEncoder(model.model.vision_tower, model.model.multi_modal_projector, model.config)
    tower_only_config(model.config).save_pretrained(tmp_path)
    state = {key: value.contiguous() for key, value in module.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [tiles(3, 12)]
    assert_matches(model, items, encoder.encode(items))
    del state["multi_modal_projector.linear_2.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys.*multi_modal_projector.linear_2.weight"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


def test_default_budgets_are_whole_tiles(model):
    encoder = GraphEncoder(encoder_of(model, BUDGETS).adapter, device="cpu", dtype=torch.float32)
    tokens = [budget.num_tokens for budget in encoder.budgets]
    assert tokens[0] == TOKENS_PER_TILE and tokens[-1] == MAX_GRAPH_TILES * TOKENS_PER_TILE
    assert all(value % TOKENS_PER_TILE == 0 for value in tokens)


def test_feature_settings_vitpool_does_not_run_are_refused(model):
    from vitpool.models.internvl import InternVLAdapter

    config = model.config.__class__.from_dict(model.config.to_dict())
    config.vision_feature_layer = -2
    module = InternVLEncoder(model.model.vision_tower, model.model.multi_modal_projector, config)
    with pytest.raises(ValueError, match="vision_feature_layer=-1"):
        InternVLAdapter(module)


def test_the_processors_output_for_one_image_is_one_item():
    """InternVL's image processor (GotOcr2, the releases' settings: 448² crops plus a thumbnail,
    1 to 12 crops) emits one image's tiles as they are: `Image(out["pixel_values"])` is an item of
    that many tiles, 256 tokens each, for the real tower's rules."""
    from PIL import Image as PILImage
    from transformers import GotOcr2ImageProcessorPil

    from vitpool.items import prepare_item
    from vitpool.models.tile_rules import TileRules

    processor = GotOcr2ImageProcessorPil(
        crop_to_patches=True, min_patches=1, max_patches=12, size={"height": 448, "width": 448}
    )
    out = processor(images=PILImage.new("RGB", (1000, 600), (200, 120, 40)), return_tensors="pt")
    rules = TileRules(3, 448, 256, ((4096,),))  # InternViT-300M: (448/14)² patches, shuffled by 0.5
    spec = prepare_item(0, Image(out["pixel_values"]), rules).spec
    assert spec.num_rows == int(out["num_patches"][0]) == out["pixel_values"].shape[0] > 1
    assert spec.num_tokens == 256 * spec.num_rows
