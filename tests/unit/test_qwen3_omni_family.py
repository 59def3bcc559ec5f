"""Qwen3-Omni's vision encoder as a vitpool family (the checks every adapter shares are in
test_adapter_conformance.py): what a tiny full Qwen3-Omni's thinker hands its LLM
(`get_image_features` / `get_video_features`: tokens and deepstack features) equals what vitpool
gives for each item, for one image, images of several sizes in one call, a video, and items
padded into a larger budget; the full save (sharded, the tower under `thinker.visual.`), a saved
thinker and a tower-only save load as the family; a malformed item is refused by its index; the
image processor's output becomes items through `vitpool.items_from`; and the transformers drop-in
stands in for the thinker's tower. CPU, fp32, random weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases.qwen3_omni_moe import BUDGETS, HIDDEN, ROW_WIDTH, TINY_VISION, full_model

import vitpool
from vitpool import GraphEncoder, Image, InvalidItemError, Video
from vitpool.families.qwen3_omni_moe.adapter import Qwen3OmniMoeAdapter
from vitpool.models.family import GRID_PROCESSOR_OUTPUT
from vitpool.models.registry import find_family, record_of

TOLERANCE = 1e-5
NUM_DEEPSTACK = len(TINY_VISION["deepstack_visual_indexes"])
# What `vitpool.models.loading` says of a config whose vision config is not at its top level
# (Qwen3-Omni nests it in `thinker_config`): the full save's tests wait for the loader to read it.


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return full_model()


@pytest.fixture(scope="module")
def full_save(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("omni_full")
    hf_model.save_pretrained(path, max_shard_size="200KB")  # several shards: only the tower's are read
    return path


@pytest.fixture(scope="module")
def thinker_save(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("omni_thinker")
    hf_model.thinker.save_pretrained(path, max_shard_size="100KB")
    return path


@pytest.fixture(scope="module")
def encoder(thinker_save) -> GraphEncoder:
    return load(thinker_save)


def load(path: Path, budgets: tuple[int, ...] = BUDGETS) -> GraphEncoder:
    return GraphEncoder.from_pretrained(path, budgets=list(budgets), device="cpu", dtype=torch.float32)


def load_full_save(path: Path) -> GraphEncoder:
    return load(path)  # the vision config nested in `thinker_config` (`loading._vision_part`)


def pixels(num_rows: int, seed: int) -> torch.Tensor:
    # pixels: [rows, C*T*P*P]
    return torch.randn(num_rows, ROW_WIDTH, generator=torch.Generator().manual_seed(seed))


def image(h: int, w: int, seed: int) -> Image:
    return Image(pixels(h * w, seed), (1, h, w))


def video(t: int, h: int, w: int, seed: int) -> Video:
    return Video(pixels(t * h * w, seed), (t, h, w))


def hf_outputs(model: torch.nn.Module, item) -> list[torch.Tensor]:
    """What the thinker hands its LLM for this item, run alone: its tokens, then its deepstack
    features."""
    thinker = model.thinker
    features = thinker.get_video_features if isinstance(item, Video) else thinker.get_image_features
    with torch.no_grad():
        output = features(torch.as_tensor(item.pixel_values), torch.tensor([item.grid_thw]))
    [tokens] = output.pooler_output
    return [tokens, *(feature for [feature] in output.deepstack_features)]


def assert_like_hf(model: torch.nn.Module, items: list, embeddings: list) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings, strict=True):
        want = hf_outputs(model, item)
        t, h, w = item.grid_thw
        assert len(want) == len(embedding.outputs) == 1 + NUM_DEEPSTACK
        assert len(embedding.deepstack) == NUM_DEEPSTACK
        for got, expected in zip(embedding.outputs, want, strict=True):
            assert got.shape == expected.shape == (t * h * w // 4, HIDDEN)
            assert torch.isfinite(got).all()
            assert relative_error(got, expected) <= TOLERANCE


def test_the_record_names_the_tower_the_checkpoints_and_the_processor_output():
    family = find_family("qwen3_omni_moe_vision_encoder")
    assert family is not None
    for model_type in ("qwen3_omni_moe", "qwen3_omni_moe_thinker", "qwen3_omni_moe_vision_encoder"):
        assert record_of(model_type).name == "qwen3_omni_moe"
    record = record_of("qwen3_omni_moe")
    assert record.processor_output == GRID_PROCESSOR_OUTPUT
    assert record.vllm_layout is None


def test_one_image_matches_the_thinkers_image_features(hf_model, encoder):
    assert isinstance(encoder.adapter, Qwen3OmniMoeAdapter)
    items = [image(6, 10, seed=1)]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_images_of_several_sizes_share_one_replay(hf_model, encoder):
    before = encoder.stats()
    # 4 + 15 + 1 + 8 = 28 tokens: one replay of the 32-token budget holds them all
    sizes = [(4, 4), (6, 10), (2, 2), (8, 4)]
    items = [image(h, w, seed) for seed, (h, w) in enumerate(sizes, start=2)]
    assert_like_hf(hf_model, items, encoder.encode(items))
    after = encoder.stats()
    assert sum(after.replays_per_budget.values()) == sum(before.replays_per_budget.values()) + 1
    assert after.eager_batches == before.eager_batches


def test_videos_and_images_together_match_the_thinkers_video_features(hf_model, encoder):
    items = [video(3, 4, 6, 7), image(4, 6, 8), video(2, 2, 2, 9)]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_padding_rows_of_a_larger_budget_change_no_item(hf_model, thinker_save):
    """One budget, far larger than the items: most of its rows are padding, before and after a
    batch that fills it (stale rows must not leak into a smaller batch)."""
    large_only = load(thinker_save, budgets=(64,))
    small = [image(2, 2, seed=10)]  # 1 token of 64
    filling = [image(16, 16, seed=11)]  # 64 tokens
    for items in (small, filling, small, [image(4, 2, 12), video(2, 2, 4, 13)]):
        before = large_only.stats()
        assert_like_hf(hf_model, items, large_only.encode(items))
        after = large_only.stats()
        assert after.replays_per_budget.get(64, 0) == before.replays_per_budget.get(64, 0) + 1
    assert large_only.stats().padding_rows >= 2 * (64 - 1) * 4


def test_a_malformed_item_is_refused_by_its_index(encoder):
    good = image(2, 2, seed=14)
    bad = Image(pixels(12, seed=15), (1, 4, 4))  # 12 rows for a grid of 16
    with pytest.raises(InvalidItemError, match="needs t\\*h\\*w = 16") as raised:
        encoder.encode([good, bad])
    assert raised.value.index == 1 and str(raised.value).startswith("item 1:")
    [result, error] = encoder.encode_each([good, bad])
    assert isinstance(error, InvalidItemError) and error.index == 1
    assert result.tokens.shape == (1, HIDDEN)


def test_a_saved_thinker_keeps_the_tower_under_visual_and_loads(hf_model, thinker_save, encoder):
    config = json.loads((thinker_save / "config.json").read_text())
    assert config["model_type"] == "qwen3_omni_moe_thinker"
    weight_map = json.loads((thinker_save / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1  # sharded
    assert any(key.startswith("visual.merger_list.") for key in weight_map)
    assert any(key.startswith("audio_tower.") for key in weight_map)  # skipped by the loader
    assert type(encoder.adapter.tower) is type(hf_model.thinker.model.visual)


def test_the_full_save_keeps_the_tower_under_the_thinker_and_loads(hf_model, full_save, encoder):
    """The sharded full save: the tower under `thinker.visual.` beside the LLM and the audio tower,
    the tower's config under `thinker_config.vision_config`."""
    config = json.loads((full_save / "config.json").read_text())
    assert config["model_type"] == "qwen3_omni_moe" and "vision_config" not in config
    assert config["thinker_config"]["vision_config"]["model_type"] == "qwen3_omni_moe_vision_encoder"
    weight_map = json.loads((full_save / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert any(key.startswith("thinker.visual.merger_list.") for key in weight_map)
    assert any(key.startswith("thinker.model.layers.") for key in weight_map)
    loaded = load_full_save(full_save)
    assert isinstance(loaded.adapter, Qwen3OmniMoeAdapter)
    items = [image(4, 6, 16), video(2, 2, 4, 17)]
    got = loaded.encode(items)
    assert_like_hf(hf_model, items, got)
    for embedding, want in zip(got, encoder.encode(items), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(embedding.outputs, want.outputs, strict=True))


def test_a_tower_only_save_loads_and_gives_the_thinkers_outputs(hf_model, encoder, tmp_path):
    hf_model.thinker.model.visual.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_omni_moe_vision_encoder"
    tower_only = load(tmp_path)
    items = [image(2, 4, 18), video(2, 4, 4, 19)]
    got = tower_only.encode(items)
    assert_like_hf(hf_model, items, got)
    for embedding, want in zip(got, encoder.encode(items), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(embedding.outputs, want.outputs, strict=True))


def test_the_image_processors_output_becomes_items(hf_model, encoder):
    """Qwen3-Omni's image processor (Qwen2VLImageProcessor, here at the tiny tower's patch size)
    returns Qwen-style `pixel_values` and `image_grid_thw`; `items_from` cuts them per image."""
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(
        patch_size=4,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=8 * 8,
        max_pixels=40 * 40,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    generator = np.random.default_rng(20)
    pictures = [generator.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in ((24, 40), (16, 16))]
    batch = processor(images=pictures, return_tensors="pt")
    items = vitpool.items_from(batch, family="qwen3_omni_moe")
    grids = [tuple(row) for row in batch["image_grid_thw"].tolist()]
    assert [tuple(item.grid_thw) for item in items] == grids
    embeddings = encoder.encode(items)
    with torch.no_grad():
        whole = hf_model.thinker.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    for k, embedding in enumerate(embeddings):
        want = [whole.pooler_output[k], *(feature[k] for feature in whole.deepstack_features)]
        for got, expected in zip(embedding.outputs, want, strict=True):
            assert relative_error(got, expected) <= TOLERANCE


def test_the_drop_in_stands_in_for_the_thinkers_tower(hf_model, encoder):
    """`replace_vision_tower(model.thinker, encoder)`: the thinker's own `get_image_features`
    answers through vitpool with what its tower gave, deepstack features included."""
    from vitpool.integrations.transformers import replace_vision_tower, restore_vision_tower

    items = [image(4, 4, 21), image(2, 6, 22)]
    pixel_values = torch.cat([item.pixel_values for item in items])
    grid_thw = torch.tensor([item.grid_thw for item in items])
    with torch.no_grad():
        want = hf_model.thinker.get_image_features(pixel_values, grid_thw)
    original = replace_vision_tower(hf_model.thinker, encoder)
    try:
        with torch.no_grad():
            got = hf_model.thinker.get_image_features(pixel_values, grid_thw)
    finally:
        restore_vision_tower(hf_model.thinker, original)
    assert hf_model.thinker.model.visual is original
    pairs = [(got.pooler_output, want.pooler_output)]
    pairs += list(zip(got.deepstack_features, want.deepstack_features, strict=True))
    assert len(pairs) == 1 + NUM_DEEPSTACK
    for got_parts, want_parts in pairs:
        for got_part, want_part in zip(got_parts, want_parts, strict=True):
            assert relative_error(got_part, want_part) <= TOLERANCE
