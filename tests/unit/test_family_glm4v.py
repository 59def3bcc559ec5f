"""GLM-4.1V / GLM-4.5V / GLM-4.6V (`Glm4vVisionModel`): the static forward against the Hugging Face
model's own `get_image_features` / `get_video_features` on each item alone (fp32), loading from
tower-only and full-model saves of each model type, and the family's bad inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import relative_error
from family_cases.glm4v import (
    BAD_ITEMS,
    ROW_WIDTH,
    TINY_TEXT,
    TINY_VISION,
    randomize,
    reference_tokens,
    tiny_tower,
)
from safetensors.torch import load_file, save_file

from vitpool import GraphEncoder, Image, InvalidItemError, Video
from vitpool.errors import CheckpointError
from vitpool.models.glm4v import Glm4vAdapter
from vitpool.models.registry import find_family

TOLERANCE = 1e-5
BUDGETS = [16, 32, 64]



def image(h: int, w: int, seed: int) -> Image:
    return Image(torch.randn(h * w, ROW_WIDTH, generator=torch.Generator().manual_seed(seed)), (1, h, w))


def video(t: int, h: int, w: int, seed: int) -> Video:
    return Video(torch.randn(t * h * w, ROW_WIDTH, generator=torch.Generator().manual_seed(seed)), (t, h, w))


def full_glm4v() -> torch.nn.Module:
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    config = Glm4vConfig(vision_config=TINY_VISION, text_config=TINY_TEXT)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Glm4vForConditionalGeneration(config)
    randomize(model.model.visual, seed=1)
    model.model.visual.config._attn_implementation = "sdpa"
    return model.eval()


@pytest.fixture(scope="module")
def hf_model():
    return full_glm4v()


@pytest.fixture(scope="module")
def full_checkpoint(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("glm4v_full")
    hf_model.save_pretrained(path, max_shard_size="200KB")
    return path


@pytest.fixture(scope="module")
def encoder(full_checkpoint) -> GraphEncoder:
    return GraphEncoder.from_pretrained(full_checkpoint, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def hf_features(model, item) -> torch.Tensor:
    """What the HF model hands its LLM for this item alone."""
    grid = torch.tensor([list(item.grid_thw)])
    with torch.no_grad():
        if isinstance(item, Video):
            [tokens] = model.model.get_video_features(pixel_values_videos=item.pixel_values, video_grid_thw=grid).pooler_output
        else:
            [tokens] = model.model.get_image_features(pixel_values=item.pixel_values, image_grid_thw=grid).pooler_output
    return tokens


def assert_like_hf(model, items, embeddings) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings):
        want = hf_features(model, item)
        assert embedding.tokens.shape == want.shape == (want.shape[0], TINY_TEXT["hidden_size"])
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def test_full_checkpoint_holds_the_tower_under_model_visual(full_checkpoint, encoder):
    import json

    keys = json.loads((full_checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("model.visual.embeddings.position_embedding") for k in keys)
    assert any(k.startswith("model.language_model.") for k in keys)
    assert isinstance(encoder.adapter, Glm4vAdapter)


def test_one_image(hf_model, encoder):
    items = [image(6, 10, seed=1)]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_several_images_of_different_sizes_in_one_call(hf_model, encoder):
    # 4 + 24 + 3 + 1 tokens share a budget; 80 tokens exceed every budget and run alone, eager
    items = [image(4, 4, 2), image(8, 12, 3), image(6, 2, 4), image(2, 2, 5), image(20, 16, 6), image(16, 2, 7)]
    assert_like_hf(hf_model, items, encoder.encode(items))
    assert encoder.stats().replays_per_budget


def test_videos_and_images_in_one_call(hf_model, encoder):
    items = [video(3, 4, 6, 8), image(4, 6, 9), video(2, 2, 2, 10), video(4, 8, 8, 11)]
    assert_like_hf(hf_model, items, encoder.encode(items))


@pytest.mark.parametrize("model_type", ["glm4v_vision", "glm4v_moe_vision"])
def test_tower_only_save(tmp_path, model_type):
    tower = tiny_tower(seed=3, model_type=model_type)
    tower.save_pretrained(tmp_path)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=[16, 32], device="cpu", dtype=torch.float32)
    assert isinstance(encoder.adapter, Glm4vAdapter)
    assert type(encoder.adapter.tower) is type(tower)
    tower.config._attn_implementation = "sdpa"
    items = [image(4, 8, 12), video(2, 4, 4, 13)]
    for item, embedding in zip(items, encoder.encode(items)):
        assert relative_error(embedding.tokens, reference_tokens(tower, item)) <= TOLERANCE


def test_glm46v_full_save(tmp_path):
    """GLM-4.6V nests a `glm4v_vision` config and keeps the tower under `model.visual.` too."""
    from transformers import Glm46VConfig, Glm46VForConditionalGeneration

    config = Glm46VConfig(vision_config=dict(TINY_VISION, model_type="glm4v_vision"),
                          text_config=dict(TINY_TEXT, model_type="glm4v_text"))
    config._attn_implementation = "sdpa"
    model = Glm46VForConditionalGeneration(config).eval()
    randomize(model.model.visual, seed=4)
    model.model.visual.config._attn_implementation = "sdpa"
    model.save_pretrained(tmp_path)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=[16, 32], device="cpu", dtype=torch.float32)
    items = [image(4, 4, 14), video(2, 6, 4, 15)]
    assert_like_hf(model, items, encoder.encode(items))


def test_glm4v_moe_full_save(tmp_path):
    """GLM-4.5V: `glm4v_moe` with a `glm4v_moe_vision` tower under `model.visual.`."""
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    text = dict(TINY_TEXT, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=16,
                first_k_dense_replace=1, n_group=1, topk_group=1)
    config = Glm4vMoeConfig(vision_config=TINY_VISION, text_config=text)
    config._attn_implementation = "sdpa"
    model = Glm4vMoeForConditionalGeneration(config).eval()
    randomize(model.model.visual, seed=5)
    model.model.visual.config._attn_implementation = "sdpa"
    model.save_pretrained(tmp_path)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=[16, 32], device="cpu", dtype=torch.float32)
    assert encoder.adapter.tower.config.model_type == "glm4v_moe_vision"
    items = [image(6, 4, 16), video(2, 4, 4, 17)]
    assert_like_hf(model, items, encoder.encode(items))


def test_every_model_type_is_registered():
    for model_type in ("glm4v_vision", "glm4v_moe_vision"):
        assert find_family(model_type) is not None, model_type


def test_missing_and_unexpected_keys_are_named(tmp_path):
    tower = tiny_tower(seed=6)
    tower.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["embeddings.position_embedding.weight"]
    state["blocks.7.attn.qkv.weight"] = torch.zeros(2, 2)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing keys \['embeddings.position_embedding.weight'\]") as raised:
        GraphEncoder.from_pretrained(tmp_path, budgets=[16], device="cpu")
    assert "unexpected keys ['blocks.7.attn.qkv.weight']" in str(raised.value)


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([image(4, 4, 18), image(2, 2, 19), bad])
    assert raised.value.index == 2 and words in str(raised.value)
