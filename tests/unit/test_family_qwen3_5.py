"""Qwen3.5 (dense and MoE): the static forward against the Hugging Face model's own
`get_image_features` / `get_video_features` on each item alone, loading, and bad items."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_cases.qwen3_5 import ROW_WIDTH, TINY_MOE_TEXT, TINY_TEXT, TINY_VISION

from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError, Video
from vitpool.models.qwen3_5 import Qwen3_5Adapter

TOLERANCE = 1e-5
BUDGETS = [8, 16, 32]



def full_model(kind: str):
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    torch.manual_seed(0)
    if kind == "moe":
        config = Qwen3_5MoeConfig(vision_config=TINY_VISION, text_config=TINY_MOE_TEXT)
        return Qwen3_5MoeForConditionalGeneration(config).eval()
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(vision_config=TINY_VISION, text_config=TINY_TEXT)).eval()


@pytest.fixture(scope="module", params=["dense", "moe"])
def saved(request, tmp_path_factory):
    """A tiny full model with random weights, saved as a full checkpoint."""
    model = full_model(request.param)
    path = tmp_path_factory.mktemp(f"qwen3_5_{request.param}")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def encoder(saved):
    return GraphEncoder.from_pretrained(saved[1], budgets=BUDGETS, device="cpu", dtype=torch.float32)


def items(generator: torch.Generator) -> list:
    def image(h, w):
        return Image(torch.randn(h * w, ROW_WIDTH, generator=generator), (1, h, w))

    return [image(4, 4), image(6, 4), image(2, 8), image(8, 6)]


def hf_tokens(model, item) -> torch.Tensor:
    pixels = torch.as_tensor(item.pixel_values)
    grid = torch.tensor([item.grid_thw])
    with torch.no_grad():
        if isinstance(item, Video):
            [tokens] = model.model.get_video_features(pixels, grid).pooler_output
        else:
            [tokens] = model.model.get_image_features(pixels, grid).pooler_output
    return tokens


def assert_like_hf(model, items_, embeddings) -> None:
    assert len(embeddings) == len(items_)
    for item, embedding in zip(items_, embeddings):
        want = hf_tokens(model, item)
        assert embedding.tokens.shape == want.shape == (want.shape[0], model.config.text_config.hidden_size)
        assert len(embedding.outputs) == 1  # no deepstack features in Qwen3.5
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def test_full_checkpoint_picks_the_family(saved, encoder):
    model, _ = saved
    assert isinstance(encoder.adapter, Qwen3_5Adapter)
    assert type(encoder.adapter.tower) is type(model.model.visual)


def test_one_image(saved, encoder):
    [item] = items(torch.Generator().manual_seed(1))[:1]
    assert_like_hf(saved[0], [item], encoder.encode([item]))


def test_images_of_different_sizes_in_one_call(saved, encoder):
    batch = items(torch.Generator().manual_seed(2))
    assert_like_hf(saved[0], batch, encoder.encode(batch))


def test_video_and_images_together(saved, encoder):
    generator = torch.Generator().manual_seed(3)
    clip = Video(torch.randn(3 * 4 * 6, ROW_WIDTH, generator=generator), (3, 4, 6))
    batch = [items(generator)[0], clip]
    assert_like_hf(saved[0], batch, encoder.encode(batch))


def test_tower_only_save_loads(saved, encoder, tmp_path):
    model, _ = saved
    model.model.visual.save_pretrained(tmp_path)
    tower_only = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert type(tower_only.adapter.tower) is type(model.model.visual)
    batch = items(torch.Generator().manual_seed(4))
    for got, want in zip(tower_only.encode(batch), encoder.encode(batch)):
        assert torch.equal(got.tokens, want.tokens)


def test_visual_prefix_and_missing_keys(saved, encoder, tmp_path):
    """`visual.` (a saved `Qwen3_5Model`) loads too; a missing tower key is named."""
    model, path = saved
    state = {f"visual.{k}": v.contiguous() for k, v in model.model.visual.state_dict().items()}
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(state, tmp_path / "model.safetensors")
    [item] = items(torch.Generator().manual_seed(5))[:1]
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert torch.equal(loaded.encode([item])[0].tokens, encoder.encode([item])[0].tokens)
    del state["visual.merger.linear_fc2.bias"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="merger.linear_fc2.bias"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)


BAD_ITEMS = [
    (Image(torch.randn(16, 1536), (1, 4, 4)), "1536 features per row"),
    (Image(torch.randn(1, 16, ROW_WIDTH), (1, 4, 4)), "must be 2-D"),
    (Image(torch.randn(16, ROW_WIDTH)), "three integers"),
    (Image(torch.randn(16, ROW_WIDTH), (1, 4)), "three integers"),
    (Image(torch.randn(32, ROW_WIDTH), (2, 4, 4)), "use Video for clips"),
    (Image(torch.randn(12, ROW_WIDTH), (1, 4, 3)), "multiples of the spatial merge size 2"),
    (Image(torch.randn(20, ROW_WIDTH), (1, 4, 4)), "needs t*h*w = 16"),
    (Video(torch.randn(0, ROW_WIDTH), (0, 4, 4)), "zero or negative"),
]


@pytest.mark.parametrize(("bad", "words"), BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(saved, encoder, bad, words):
    good = items(torch.Generator().manual_seed(6))[0]
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([good, good, bad])
    assert raised.value.index == 2 and words in str(raised.value)
    assert_like_hf(saved[0], [good], encoder.encode([good]))
