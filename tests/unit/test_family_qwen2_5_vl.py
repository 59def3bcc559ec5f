"""Qwen2.5-VL: the static forward against the Hugging Face model's own `get_image_features` /
`get_video_features` on each item alone, loading, windows as a per-batch capacity, bad items."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_cases.qwen2_5_vl import BAD_ITEMS, ROW_WIDTH, TINY_TEXT_CONFIG, TINY_VISION_CONFIG, tiny_encoder

from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError, Video
from vitpool.models.qwen2_5_vl import Qwen2_5_VLAdapter
from vitpool.models.qwen2_5_vl_rules import WINDOWS, frame_windows, max_windows

TOLERANCE = 1e-5
BUDGETS = [16, 32, 64]



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny full Qwen2.5-VL model with random weights, saved as a full checkpoint."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(vision_config=TINY_VISION_CONFIG, text_config=TINY_TEXT_CONFIG)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def encoder(saved):
    return GraphEncoder.from_pretrained(saved[1], budgets=BUDGETS, device="cpu", dtype=torch.float32)


def image(generator: torch.Generator, h: int, w: int) -> Image:
    return Image(torch.randn(h * w, ROW_WIDTH, generator=generator), (1, h, w))


def images(generator: torch.Generator) -> list[Image]:
    # 2 x 2-token windows: 4 x 4 patches is one window, 6 x 10 has partial windows
    return [image(generator, 4, 4), image(generator, 6, 10), image(generator, 2, 8), image(generator, 8, 6)]


def hf_tokens(model, item) -> torch.Tensor:
    pixels = torch.as_tensor(item.pixel_values)
    grid = torch.tensor([item.grid_thw])
    with torch.no_grad():
        if isinstance(item, Video):
            [tokens] = model.model.get_video_features(pixels, grid).pooler_output
        else:
            [tokens] = model.model.get_image_features(pixels, grid).pooler_output
    return tokens


def assert_like_hf(model, items, embeddings) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings):
        want = hf_tokens(model, item)
        assert embedding.tokens.shape == want.shape == (want.shape[0], model.config.text_config.hidden_size)
        assert len(embedding.outputs) == 1  # no extra outputs in Qwen2.5-VL
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def test_full_checkpoint_picks_the_family(saved, encoder):
    model, _ = saved
    assert isinstance(encoder.adapter, Qwen2_5_VLAdapter)
    assert type(encoder.adapter.tower) is type(model.model.visual)
    assert all(budget.limit(WINDOWS) is not None for budget in encoder.budgets)


def test_one_image(saved, encoder):
    item = image(torch.Generator().manual_seed(1), 6, 10)
    assert_like_hf(saved[0], [item], encoder.encode([item]))


def test_images_of_different_sizes_in_one_call(saved, encoder):
    batch = images(torch.Generator().manual_seed(2))
    before = encoder.stats()
    assert_like_hf(saved[0], batch, encoder.encode(batch))
    after = encoder.stats()
    assert after.eager_batches == before.eager_batches  # packed into budgets, none run at its own size
    assert sum(after.replays_per_budget.values()) > sum(before.replays_per_budget.values())


def test_video_and_images_together(saved, encoder):
    generator = torch.Generator().manual_seed(3)
    clip = Video(torch.randn(3 * 4 * 6, ROW_WIDTH, generator=generator), (3, 4, 6))
    batch = [images(generator)[1], clip]
    assert_like_hf(saved[0], batch, encoder.encode(batch))


def test_item_larger_than_every_budget_runs_eager(saved, encoder):
    item = image(torch.Generator().manual_seed(4), 18, 16)  # 72 tokens
    assert_like_hf(saved[0], [item], encoder.encode([item]))


def test_tower_only_save_loads(saved, encoder, tmp_path):
    model, _ = saved
    model.model.visual.save_pretrained(tmp_path)
    tower_only = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert type(tower_only.adapter.tower) is type(model.model.visual)
    batch = images(torch.Generator().manual_seed(5))
    for got, want in zip(tower_only.encode(batch), encoder.encode(batch)):
        assert torch.equal(got.tokens, want.tokens)


def test_visual_prefix_and_missing_keys(saved, encoder, tmp_path):
    """Legacy exports keep the tower under `visual.`; a missing tower key is named."""
    model, path = saved
    state = {f"visual.{k}": v.contiguous() for k, v in model.model.visual.state_dict().items()}
    state["lm_head.weight"] = torch.zeros(4, 4)  # language-model weights are skipped
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(state, tmp_path / "model.safetensors")
    item = images(torch.Generator().manual_seed(6))[1]
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert torch.equal(loaded.encode([item])[0].tokens, encoder.encode([item])[0].tokens)
    del state["visual.merger.ln_q.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="merger.ln_q.weight"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize(("bad", "words"), BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(saved, encoder, bad, words):
    good = images(torch.Generator().manual_seed(7))[0]
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([good, good, bad])
    assert raised.value.index == 2 and words in str(raised.value)
    assert_like_hf(saved[0], [good], encoder.encode([good]))


def test_windows_limit_is_settable_and_bounds_batches(saved):
    model, _ = saved
    limited = tiny_encoder(BUDGETS, capacity_limits={WINDOWS: 4})
    limited.adapter.tower.load_state_dict(model.model.visual.state_dict())
    assert [budget.limit(WINDOWS) for budget in limited.budgets] == [4, 4, 4]
    assert all(budget.max_items <= 4 for budget in limited.budgets)
    generator = torch.Generator().manual_seed(8)
    # 4 windows each (two batches at most), and one of 9 windows: larger than every budget
    batch = [image(generator, 8, 8), image(generator, 8, 6), image(generator, 12, 12)]
    assert [limited.adapter.item_rules.item_spec("image", tuple(i.pixel_values.shape), "float32", i.grid_thw)
            .need(WINDOWS) for i in batch] == [4, 4, 9]
    before = limited.stats()
    assert_like_hf(model, batch, limited.encode(batch))
    after = limited.stats()
    assert after.eager_batches == before.eager_batches + 1  # the 9-window item, at its own size
    assert sum(after.replays_per_budget.values()) == sum(before.replays_per_budget.values()) + 2


def test_bad_capacity_limits_are_refused():
    with pytest.raises(ValueError, match="'tiles'"):
        tiny_encoder(BUDGETS, capacity_limits={"tiles": 4})
    with pytest.raises(ValueError, match="positive integer"):
        tiny_encoder(BUDGETS, capacity_limits={WINDOWS: 0})


def test_default_windows_bound_holds_every_frame():
    """`max_windows` never refuses a batch its tokens and sequences allow."""
    for v in range(1, 7):
        for h in range(1, 25):
            for w in range(1, 25):
                windows = frame_windows(2 * h, 2 * w, 2, v)
                assert windows <= max_windows(h * w, 1, v), (v, h, w)
