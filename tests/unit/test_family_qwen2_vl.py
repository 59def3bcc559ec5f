"""Qwen2-VL: the static forward against the Hugging Face model's own `get_image_features` /
`get_video_features` on each item alone (tiny random config, fp32), loading from a tower-only
save, a full-model save (`visual.`) and the `model.visual.` layout, and the bad-input matrix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from family_cases.qwen2_vl import BAD_ITEMS, ROW_WIDTH, TINY_TEXT_CONFIG, TINY_VISION_CONFIG
from safetensors.torch import load_file, save_file

from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError, Video

TOLERANCE = 1e-5
BUDGETS = [16, 64]


@pytest.fixture(scope="module")
def hf_model():
    """A tiny full Qwen2-VL model with random weights, run by Hugging Face (SDPA)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2VLConfig(vision_config=TINY_VISION_CONFIG, text_config=TINY_TEXT_CONFIG)
    config._attn_implementation = "sdpa"
    return Qwen2VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def full_checkpoint(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2_vl_full")
    hf_model.save_pretrained(path, max_shard_size="200KB")
    return path


@pytest.fixture(scope="module")
def tower_checkpoint(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2_vl_tower")
    hf_model.model.visual.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def encoder(full_checkpoint) -> GraphEncoder:
    return GraphEncoder.from_pretrained(full_checkpoint, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def hf_tokens(model, item) -> torch.Tensor:
    """What the Hugging Face model hands its LLM for this item, run alone."""
    pixels = torch.as_tensor(item.pixel_values)
    grid = torch.tensor([item.grid_thw])
    with torch.no_grad():
        if isinstance(item, Video):
            [tokens] = model.model.get_video_features(pixels, grid).pooler_output
        else:
            [tokens] = model.model.get_image_features(pixels, grid).pooler_output
    return tokens


def make_image(h: int, w: int, seed: int) -> Image:
    generator = torch.Generator().manual_seed(seed)
    return Image(torch.randn(h * w, ROW_WIDTH, generator=generator), (1, h, w))


def make_video(t: int, h: int, w: int, seed: int) -> Video:
    generator = torch.Generator().manual_seed(seed)
    return Video(torch.randn(t * h * w, ROW_WIDTH, generator=generator), (t, h, w))


def assert_matches_hf(model, encoder, items) -> None:
    results = encoder.encode(items)
    assert len(results) == len(items)
    for item, result in zip(items, results):
        want = hf_tokens(model, item)
        assert result.tokens.shape == want.shape == (want.shape[0], TINY_VISION_CONFIG["hidden_size"])
        assert result.deepstack == []
        assert torch.isfinite(result.tokens).all()
        assert relative_error(result.tokens, want) <= TOLERANCE


def test_one_image(hf_model, encoder):
    assert_matches_hf(hf_model, encoder, [make_image(4, 6, seed=1)])


def test_several_images_of_different_sizes_in_one_call(hf_model, encoder):
    before = sum(encoder.stats().replays_per_budget.values())
    items = [make_image(4, 6, seed=2), make_image(2, 2, seed=3), make_image(8, 4, seed=4), make_image(6, 10, seed=5)]
    assert_matches_hf(hf_model, encoder, items)
    # 6 + 1 + 8 + 15 = 30 tokens: one replay of the 64-token budget holds them all
    assert sum(encoder.stats().replays_per_budget.values()) == before + 1


def test_videos_and_images_together(hf_model, encoder):
    items = [make_video(2, 4, 4, seed=6), make_image(4, 2, seed=7), make_video(3, 2, 6, seed=8)]
    assert_matches_hf(hf_model, encoder, items)


def test_an_item_larger_than_every_budget_runs_eager(hf_model, encoder):
    assert_matches_hf(hf_model, encoder, [make_image(18, 16, seed=9)])  # 72 tokens > 64


def test_tower_only_save(hf_model, tower_checkpoint):
    assert json.loads((tower_checkpoint / "config.json").read_text())["model_type"] == "qwen2_vl_vision"
    encoder = GraphEncoder.from_pretrained(tower_checkpoint, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert_matches_hf(hf_model, encoder, [make_image(4, 4, seed=10), make_video(2, 2, 4, seed=11)])


def test_full_model_save_keeps_the_published_layout(full_checkpoint):
    """transformers saves Qwen2-VL in its published layout: the tower under `visual.`, the
    language model under `model.`; only the vision weights load (the fixture's encoder)."""
    index = json.loads((full_checkpoint / "model.safetensors.index.json").read_text())
    assert any(key.startswith("visual.") for key in index["weight_map"])
    assert any(key.startswith("model.layers.") for key in index["weight_map"])
    assert json.loads((full_checkpoint / "config.json").read_text())["model_type"] == "qwen2_vl"


def test_model_visual_prefix(hf_model, full_checkpoint, tower_checkpoint, tmp_path):
    """The in-memory layout of transformers 5 (`model.visual.`, `model.language_model.`), one file."""
    state = {f"model.visual.{key}": value for key, value in load_file(tower_checkpoint / "model.safetensors").items()}
    state["model.language_model.embed_tokens.weight"] = torch.zeros(4, 4)
    state["lm_head.weight"] = torch.zeros(4, 4)
    save_file(state, tmp_path / "model.safetensors")
    shutil.copy(full_checkpoint / "config.json", tmp_path / "config.json")
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert_matches_hf(hf_model, encoder, [make_image(2, 4, seed=12)])


def test_missing_and_unexpected_keys_are_named(tower_checkpoint, tmp_path):
    state = load_file(tower_checkpoint / "model.safetensors")
    del state["merger.ln_q.weight"]
    state["blocks.9.attn.qkv.weight"] = torch.zeros(2, 2)
    save_file(state, tmp_path / "model.safetensors")
    shutil.copy(tower_checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError) as raised:
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert "merger.ln_q.weight" in str(raised.value) and "blocks.9.attn.qkv.weight" in str(raised.value)


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named_by_index(encoder, bad, words):
    good = make_image(2, 2, seed=13)
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([good, good, bad])
    assert raised.value.index == 2 and words in str(raised.value)
