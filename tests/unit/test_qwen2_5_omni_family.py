"""Qwen2.5-Omni's vision encoder as a vitpool family (the checks every adapter shares are in
test_adapter_conformance.py): what a tiny full Qwen2.5-Omni's thinker hands its LLM
(`get_image_features` / `get_video_features`, the merger included) equals what vitpool gives for
each item, for one image, images of several sizes (and windows) in one call, a video, and items
padded into a larger budget; the full save (sharded, the tower under `thinker.visual.`), a saved
thinker (sharded) and a tower-only save load as the family; a malformed item is refused by its
index; the Omni processor's output becomes items through `vitpool.items_from`, one token per
placeholder of the prompt; and the transformers drop-in stands in for the thinker's tower. CPU,
fp32, random weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases.qwen2_5_omni import BUDGETS, HIDDEN, ROW_WIDTH, full_model

import vitpool
from vitpool import GraphEncoder, Image, InvalidItemError, Video
from vitpool.families.qwen2_5_omni.adapter import Qwen2_5OmniAdapter
from vitpool.families.qwen2_5_vl.rules import WINDOWS
from vitpool.models.family import GRID_PROCESSOR_OUTPUT
from vitpool.models.registry import find_family, record_of

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return full_model()


@pytest.fixture(scope="module")
def full_save(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("omni_full")
    # several shards, the first without vision weights: only the tower's are read
    hf_model.save_pretrained(path, max_shard_size="100KB")
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


def pixels(num_rows: int, seed: int) -> torch.Tensor:
    # pixels: [rows, C*T*P*P]
    return torch.randn(num_rows, ROW_WIDTH, generator=torch.Generator().manual_seed(seed))


def image(h: int, w: int, seed: int) -> Image:
    return Image(pixels(h * w, seed), (1, h, w))


def video(t: int, h: int, w: int, seed: int) -> Video:
    return Video(pixels(t * h * w, seed), (t, h, w))


def hf_tokens(model: torch.nn.Module, item) -> torch.Tensor:
    """What the thinker hands its LLM for this item, run alone."""
    thinker = model.thinker
    features = thinker.get_video_features if isinstance(item, Video) else thinker.get_image_features
    with torch.no_grad():
        output = features(torch.as_tensor(item.pixel_values), torch.tensor([item.grid_thw]))
    [tokens] = output.pooler_output
    return tokens


def assert_like_hf(model: torch.nn.Module, items: list, embeddings: list) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings, strict=True):
        want = hf_tokens(model, item)
        t, h, w = item.grid_thw
        assert len(embedding.outputs) == 1
        assert embedding.tokens.shape == want.shape == (t * h * w // 4, HIDDEN)
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def test_the_record_names_the_tower_the_checkpoints_and_the_processor_output():
    family = find_family("qwen2_5_omni_vision_encoder")
    assert family is not None
    for model_type in ("qwen2_5_omni", "qwen2_5_omni_thinker", "qwen2_5_omni_vision_encoder"):
        assert record_of(model_type).name == "qwen2_5_omni"
    record = record_of("qwen2_5_omni")
    assert record.processor_output == GRID_PROCESSOR_OUTPUT
    assert record.vllm_layout == "tokens" and record.vllm_checked


def test_one_image_matches_the_thinkers_image_features(hf_model, encoder):
    assert isinstance(encoder.adapter, Qwen2_5OmniAdapter)
    items = [image(6, 10, seed=1)]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_images_of_several_sizes_share_one_replay(hf_model, encoder):
    before = encoder.stats()
    # 4 + 15 + 1 + 8 = 28 tokens: one replay of the 32-token budget holds them all; windows of
    # 2 x 2 tokens, whole and cut at the right and bottom edges (4 + 6 + 1 + 2 windows)
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
    filling = [image(16, 16, seed=11)]  # 64 tokens, 16 windows
    for items in (small, filling, small, [image(4, 2, 12), video(2, 2, 4, 13)]):
        before = large_only.stats()
        assert_like_hf(hf_model, items, large_only.encode(items))
        after = large_only.stats()
        assert after.replays_per_budget.get(64, 0) == before.replays_per_budget.get(64, 0) + 1
    assert large_only.stats().padding_rows >= 2 * (64 - 1) * 4


def test_a_window_limit_splits_a_call_and_keeps_every_item(hf_model, thinker_save):
    """Qwen2.5-VL's windows bound (`capacity_limits`) holds for the Omni tower too."""
    limited = GraphEncoder.from_pretrained(
        thinker_save, budgets=list(BUDGETS), device="cpu", dtype=torch.float32, capacity_limits={WINDOWS: 4}
    )
    items = [image(8, 8, 14), image(8, 6, 15)]  # 4 windows each: two replays
    before = limited.stats()
    assert_like_hf(hf_model, items, limited.encode(items))
    after = limited.stats()
    assert sum(after.replays_per_budget.values()) == sum(before.replays_per_budget.values()) + 2


def test_a_malformed_item_is_refused_by_its_index(encoder):
    good = image(2, 2, seed=16)
    bad = Image(pixels(12, seed=17), (1, 4, 4))  # 12 rows for a grid of 16
    with pytest.raises(InvalidItemError, match="needs t\\*h\\*w = 16") as raised:
        encoder.encode([good, bad])
    assert raised.value.index == 1 and str(raised.value).startswith("item 1:")
    [result, error] = encoder.encode_each([good, bad])
    assert isinstance(error, InvalidItemError) and error.index == 1
    assert result.tokens.shape == (1, HIDDEN)
    odd = Image(pixels(12, seed=18), (1, 3, 4))  # h not a multiple of the merge size
    with pytest.raises(InvalidItemError, match="multiples of the spatial merge size 2") as raised:
        encoder.encode([good, good, odd])
    assert raised.value.index == 2


def test_a_saved_thinker_keeps_the_tower_under_visual_and_loads(hf_model, thinker_save, encoder):
    config = json.loads((thinker_save / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_omni_thinker"
    weight_map = json.loads((thinker_save / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1  # sharded
    assert any(key.startswith("visual.blocks.0.attn.q.") for key in weight_map)  # q, k, v apart
    assert any(key.startswith("audio_tower.") for key in weight_map)  # skipped by the loader
    assert type(encoder.adapter.tower) is type(hf_model.thinker.model.visual)


def test_the_full_save_keeps_the_tower_under_the_thinker_and_loads(hf_model, full_save, encoder):
    """The sharded full save: the tower under `thinker.visual.` beside the LLM and the audio tower,
    the tower's config under `thinker_config.vision_config`."""
    config = json.loads((full_save / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_omni" and "vision_config" not in config
    assert config["thinker_config"]["vision_config"]["model_type"] == "qwen2_5_omni_vision_encoder"
    weight_map = json.loads((full_save / "model.safetensors.index.json").read_text())["weight_map"]
    shards = set(weight_map.values())
    assert len(shards) > 1
    assert any(key.startswith("thinker.visual.merger.") for key in weight_map)
    assert any(key.startswith("thinker.model.layers.") for key in weight_map)
    loaded = load(full_save)
    assert isinstance(loaded.adapter, Qwen2_5OmniAdapter)
    items = [image(4, 6, 19), video(2, 2, 4, 20)]
    got = loaded.encode(items)
    assert_like_hf(hf_model, items, got)
    for embedding, want in zip(got, encoder.encode(items), strict=True):
        assert torch.equal(embedding.tokens, want.tokens)


def test_the_full_saves_shards_without_vision_weights_are_not_read(hf_model, full_save, tmp_path):
    """A copy of the full save whose shards without vision weights are unreadable loads as well."""
    weight_map = json.loads((full_save / "model.safetensors.index.json").read_text())["weight_map"]
    vision_shards = {shard for key, shard in weight_map.items() if key.startswith("thinker.visual.")}
    other_shards = set(weight_map.values()) - vision_shards
    assert other_shards  # the LLM and the audio tower fill a shard of their own
    for file in full_save.iterdir():
        target = tmp_path / file.name
        target.write_bytes(b"not safetensors" if file.name in other_shards else file.read_bytes())
    items = [image(4, 4, 26)]
    assert_like_hf(hf_model, items, load(tmp_path).encode(items))


def test_a_tower_only_save_loads_and_gives_the_thinkers_outputs(hf_model, encoder, tmp_path):
    hf_model.thinker.model.visual.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2_5_omni_vision_encoder"
    tower_only = load(tmp_path)
    assert isinstance(tower_only.adapter, Qwen2_5OmniAdapter)
    items = [image(2, 4, 21), video(2, 4, 4, 22)]
    got = tower_only.encode(items)
    assert_like_hf(hf_model, items, got)
    for embedding, want in zip(got, encoder.encode(items), strict=True):
        assert torch.equal(embedding.tokens, want.tokens)


# The Omni processor's special tokens, as its tokenizer names them
SPECIAL_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}


def omni_processor(monkeypatch) -> object:
    """The real `Qwen2_5OmniProcessor`, built offline: Qwen2VLImageProcessorPil at the tiny
    tower's sizes (patch 14, merge 2, temporal 2, the processor's defaults), a word-level tokenizer
    holding the special tokens, Whisper's feature extractor. Its video processor exists only for
    torchvision and the processor's class check looks it up there: the check is skipped for it and
    a stand-in that is never called (images only) takes its place."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessorPil,
        WhisperFeatureExtractor,
    )
    from transformers.video_processing_utils import BaseVideoProcessor

    class UnusedVideoProcessor(BaseVideoProcessor):
        merge_size = 2
        temporal_patch_size = 2

    check = Qwen2_5OmniProcessor.check_argument_for_proper_class

    def check_all_but_videos(self, name, argument):
        return None if name == "video_processor" else check(self, name, argument)

    monkeypatch.setattr(Qwen2_5OmniProcessor, "check_argument_for_proper_class", check_all_but_videos)
    vocab = {"<unk>": 0, "describe": 1, **{token: k + 2 for k, token in enumerate(SPECIAL_TOKENS.values())}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+"), behavior="removed")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", extra_special_tokens=SPECIAL_TOKENS
    )
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112)
    return Qwen2_5OmniProcessor(
        image_processor=image_processor,
        video_processor=UnusedVideoProcessor(),
        feature_extractor=WhisperFeatureExtractor(feature_size=16),
        tokenizer=tokenizer,
    )


def test_the_processors_output_becomes_items(hf_model, encoder, monkeypatch):
    """The Omni processor's output for a prompt with three images: `items_from` cuts its Qwen-style
    `pixel_values` and `image_grid_thw` per image (the prompt's `input_ids` ignored); each item
    gives as many tokens as the prompt holds placeholders for it, equal to the thinker's
    `get_image_features` of the whole batch."""
    processor = omni_processor(monkeypatch)
    generator = np.random.default_rng(23)
    sides = ((56, 84), (28, 28), (112, 112))  # 4 x 6, 2 x 2 and 8 x 8 patches
    pictures = [generator.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in sides]
    placeholder = "<|vision_bos|> <|IMAGE|> <|vision_eos|>"
    batch = processor(text=[" ".join(["describe", *[placeholder] * 3])], images=pictures, return_tensors="pt")
    items = vitpool.items_from(batch, family="qwen2_5_omni")
    # the keys alone say how to cut it: every grid family's processor output is cut alike
    assert [item.grid_thw for item in vitpool.items_from(batch)] == [item.grid_thw for item in items]
    grids = [tuple(row) for row in batch["image_grid_thw"].tolist()]
    assert [tuple(item.grid_thw) for item in items] == grids == [(1, 4, 6), (1, 2, 2), (1, 8, 8)]
    embeddings = encoder.encode(items)
    placeholders = int((batch["input_ids"] == processor.image_token_id).sum())
    assert sum(embedding.tokens.shape[0] for embedding in embeddings) == placeholders == 6 + 1 + 16
    with torch.no_grad():
        whole = hf_model.thinker.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    for embedding, want in zip(embeddings, whole.pooler_output, strict=True):
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def test_the_drop_in_stands_in_for_the_thinkers_tower(hf_model, encoder):
    """`replace_vision_tower(model.thinker, encoder)`: the thinker's own `get_image_features`
    answers through vitpool with what its tower gave."""
    from vitpool.integrations.transformers import replace_vision_tower, restore_vision_tower

    items = [image(4, 4, 24), image(2, 6, 25)]
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
    assert len(got.pooler_output) == len(want.pooler_output) == 2
    for got_part, want_part in zip(got.pooler_output, want.pooler_output, strict=True):
        assert relative_error(got_part, want_part) <= TOLERANCE
