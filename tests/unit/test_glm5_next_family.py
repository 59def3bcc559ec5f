"""GLM-5's checks that need a whole Hugging Face model (what the suite checks on a tower alone is in
test_adapter_conformance.py, `family_cases/glm5_next.py`): its record (GLM-4.1V's adapter on the
GLM-5 tower), full saves in one file and in shards, and a tower-only save, load as the family; the
tokens equal what the model's own `get_image_features` / `get_video_features` hand its LLM (the
merger and its clamped SwiGLU included), for one image, images of several sizes in one call, items
padded to a larger budget, videos, and the processor's batch cut by `vitpool.items_from`; a
malformed item is refused by its index. CPU, fp32, a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import glm5_next as glm5_case

import vitpool
from vitpool import GraphEncoder, Image, InvalidItemError, Video
from vitpool.families.glm4v.adapter import Glm4vAdapter
from vitpool.families.glm5_next import RECORD
from vitpool.models.family import GRID_PROCESSOR_OUTPUT
from vitpool.models.registry import find_family, record_of

TOLERANCE = 1e-5
ROW_WIDTH = glm5_case.ROW_WIDTH


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return glm5_case.full_model()


@pytest.fixture(scope="module")
def sharded_save(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharded")
    hf_model.save_pretrained(path, max_shard_size="100KB")  # several shards: only the tower's are read
    return path


@pytest.fixture(scope="module")
def single_save(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("single")
    hf_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def encoder(sharded_save) -> GraphEncoder:
    return load(sharded_save)


def load(path: Path, budgets: tuple[int, ...] = glm5_case.BUDGETS) -> GraphEncoder:
    return GraphEncoder.from_pretrained(path, budgets=list(budgets), device="cpu", dtype=torch.float32)


def pixels(num_rows: int, seed: int) -> torch.Tensor:
    # pixels: [rows, C*T*P*P]; scaled up so that the clamped SwiGLUs clamp often
    return 2 * torch.randn(num_rows, ROW_WIDTH, generator=torch.Generator().manual_seed(seed))


def image(h: int, w: int, seed: int) -> Image:
    return Image(pixels(h * w, seed), (1, h, w))


def video(t: int, h: int, w: int, seed: int) -> Video:
    return Video(pixels(t * h * w, seed), (t, h, w))


def hf_tokens(model: torch.nn.Module, item: Image | Video) -> torch.Tensor:
    """What the Hugging Face model hands its LLM for this item, run alone."""
    features = model.model.get_video_features if isinstance(item, Video) else model.model.get_image_features
    grid = torch.as_tensor(item.grid_thw).reshape(1, 3)
    with torch.no_grad():
        output = features(torch.as_tensor(item.pixel_values), grid)
    [tokens] = output.pooler_output
    return tokens


def assert_like_hf(model: torch.nn.Module, items: list, embeddings: list) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings):
        want = hf_tokens(model, item)
        t, h, w = (int(v) for v in torch.as_tensor(item.grid_thw).reshape(3))
        assert embedding.tokens.shape == want.shape == (t * h * w // 4, model.config.text_config.hidden_size)
        assert len(embedding.outputs) == 1 and embedding.deepstack == []  # tokens alone, no deepstack
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def test_the_record_runs_the_glm5_tower_with_the_glm4v_adapter(encoder, hf_model):
    assert record_of("glm5_next") is RECORD and record_of(glm5_case.TOWER_TYPE) is RECORD
    assert find_family(glm5_case.TOWER_TYPE) is RECORD.towers[glm5_case.TOWER_TYPE]
    assert RECORD.processor_output == GRID_PROCESSOR_OUTPUT and RECORD.grid_processor
    assert RECORD.vllm_layout is None  # not checked against a vLLM tower
    assert isinstance(encoder.adapter, Glm4vAdapter)
    tower = encoder.adapter.tower
    assert type(tower) is type(hf_model.model.visual)
    assert type(tower).__name__ == "Glm5NextVisionModel"
    # GLM-OCR's tower: no learned position table for the adapter's grid table to reach
    assert not hasattr(tower, "embeddings") and not hasattr(tower, "post_conv_layernorm")
    # what GLM-5 changed, loaded from the save's config: the clamp and the merger's width
    assert tower.blocks[0].mlp.swiglu_limit == tower.merger.swiglu_limit == glm5_case.SWIGLU_LIMIT
    assert tower.merger.gate_proj.out_features == glm5_case.TINY_VISION["projection_intermediate_size"]
    assert encoder.adapter.item_rules.output_row_shapes == ((glm5_case.TINY_VISION["out_hidden_size"],),)


def test_the_clamp_bites_on_these_items(hf_model):
    """Parity below covers the clamped SwiGLUs: without the clamp the tokens are others."""
    item = image(6, 10, seed=1)
    unclamped = glm5_case.full_model()
    for module in unclamped.model.visual.modules():
        if hasattr(module, "swiglu_limit"):
            module.swiglu_limit = float("inf")
    assert relative_error(hf_tokens(unclamped, item), hf_tokens(hf_model, item)) > 1e-2


@pytest.mark.parametrize("save", ["single_save", "sharded_save"])
def test_a_full_save_loads_the_towers_weights_alone(request, hf_model, save):
    path = request.getfixturevalue(save)
    assert json.loads((path / "config.json").read_text())["model_type"] == "glm5_next"
    index = path / "model.safetensors.index.json"
    if save == "sharded_save":
        weight_map = json.loads(index.read_text())["weight_map"]
        assert len(set(weight_map.values())) > 2
        assert any(key.startswith("model.visual.") for key in weight_map)
        assert any(key.startswith("model.language_model.") for key in weight_map)
    else:
        assert not index.exists() and (path / "model.safetensors").exists()
    loaded = load(path)
    want = hf_model.model.visual.state_dict()
    got = loaded.adapter.tower.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    items = [image(6, 10, seed=1)]
    assert_like_hf(hf_model, items, loaded.encode(items))


def test_one_image_matches_get_image_features(hf_model, encoder):
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


def test_items_padded_to_a_larger_budget_match(hf_model, sharded_save):
    """A 64-token budget, items of 4 and 4 + 6 tokens: most rows are padding, a sequence of their own."""
    padded = load(sharded_save, budgets=(64,))
    alone = [image(4, 4, seed=20)]
    together = [image(4, 4, seed=20), image(4, 6, seed=21)]
    for items in (alone, together):
        before = padded.stats()
        embeddings = padded.encode(items)
        after = padded.stats()
        assert after.replays_per_budget.get(64, 0) == before.replays_per_budget.get(64, 0) + 1
        item_rows = sum(item.pixel_values.shape[0] for item in items)
        assert after.padding_rows - before.padding_rows == 64 * 4 - item_rows  # 4 rows a token
        assert_like_hf(hf_model, items, embeddings)


def test_an_image_larger_than_every_budget_runs_eager(hf_model, encoder):
    before = encoder.stats().eager_batches
    items = [image(18, 16, seed=6)]  # 72 tokens
    assert_like_hf(hf_model, items, encoder.encode(items))
    assert encoder.stats().eager_batches == before + 1


def test_videos_and_images_together_match_get_video_features(hf_model, encoder):
    # get_video_features runs a clip as one (1, h, w) grid per temporal patch: the adapter must too
    items = [video(3, 4, 6, 7), image(4, 6, 8), video(2, 2, 2, 9), video(2, 2, 6, 10)]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_a_tower_only_save_loads_and_gives_the_full_saves_tokens(hf_model, encoder, tmp_path):
    hf_model.model.visual.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == glm5_case.TOWER_TYPE
    tower_only = load(tmp_path)
    assert isinstance(tower_only.adapter, Glm4vAdapter)
    items = [image(4, 4, 11), video(2, 2, 4, 12)]
    got = tower_only.encode(items)
    assert_like_hf(hf_model, items, got)
    for embedding, want in zip(got, encoder.encode(items)):
        assert torch.equal(embedding.tokens, want.tokens)


def image_processor(config: Any) -> Any:
    """GLM-5's own PIL image processor, built offline at the tiny tower's sizes. It sizes images by
    tokens (`min_image_tokens` / `max_image_tokens`, not `size`) and pads each to whole tokens."""
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    return Glm5NextImageProcessorPil(
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.spatial_merge_size,
        min_image_tokens=4,
        max_image_tokens=48,
    )


def test_the_processors_batch_cut_by_items_from_matches_the_models_batch(hf_model, encoder, single_save):
    """The image processor's batch and videos laid out as `Glm5NextVideoProcessor` lays them
    (flattened patch rows and a (t, h, w) row each; that processor needs torchvision), cut by
    `vitpool.items_from` (the record's `processor_output`), give the tokens the model computes for
    the whole batch at once: every image in one `get_image_features` call, every video in one
    `get_video_features` call."""
    pil = pytest.importorskip("PIL.Image")
    processor = image_processor(hf_model.config.vision_config)
    pictures = [
        pil.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
        for seed, (h, w) in enumerate([(12, 20), (16, 8), (9, 30)])
    ]
    batch = dict(processor(images=pictures, return_tensors="pt"))
    assert batch["image_grid_thw"].tolist() == [[1, 6, 10], [1, 8, 4], [1, 6, 16]]
    image_rows = batch["pixel_values"].split(batch["image_grid_thw"].prod(-1).tolist())
    for picture, rows in zip(pictures, image_rows):  # each image's rows as the processor makes them alone
        assert torch.equal(rows, processor(images=[picture], return_tensors="pt")["pixel_values"])
    video_grids = torch.tensor([[2, 4, 6], [1, 2, 2]])
    batch["pixel_values_videos"] = pixels(int(video_grids.prod(-1).sum()), seed=40)
    batch["video_grid_thw"] = video_grids
    items = vitpool.items_from(batch, family="glm5_next")
    by_checkpoint = vitpool.items_from(batch, model=single_save)  # its config.json says glm5_next
    kinds = [Image] * len(pictures) + [Video] * len(video_grids)
    assert [type(item) for item in by_checkpoint] == [type(item) for item in items] == kinds
    grids = [tuple(row) for row in [*batch["image_grid_thw"].tolist(), *video_grids.tolist()]]
    assert [tuple(item.grid_thw) for item in items] == grids
    embeddings = encoder.encode(items)
    model = hf_model.model
    with torch.no_grad():  # the model's own calls: all images of the request at once, then all videos
        want = [
            *model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output,
            *model.get_video_features(batch["pixel_values_videos"], video_grids).pooler_output,
        ]
    assert len(want) == len(embeddings)
    for embedding, tokens in zip(embeddings, want):
        assert embedding.tokens.shape == tokens.shape
        assert relative_error(embedding.tokens, tokens) <= TOLERANCE


@pytest.mark.parametrize("bad_index", [0, 1, 2])
def test_an_item_whose_grid_does_not_match_its_rows_is_refused_by_index(encoder, bad_index):
    items = [image(4, 4, seed=30), image(2, 4, seed=31)]
    bad = Image(pixels(12, seed=32), (1, 4, 4))  # 12 rows; the grid needs 16
    items.insert(bad_index, bad)
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode(items)
    assert raised.value.index == bad_index
    assert f"item {bad_index}" in str(raised.value) and "needs t*h*w = 16" in str(raised.value)


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (Image(torch.randn(16, ROW_WIDTH + 1), (1, 4, 4)), "features per row"),  # another patch size
        (Image(pixels(32, seed=33), (2, 4, 4)), "an Image has grid t == 1"),  # a clip given as an Image
        (Image(pixels(12, seed=34), (1, 3, 4)), "multiples of the spatial merge size 2"),
    ],
)
def test_other_malformed_items_are_refused_by_index(encoder, bad, words):
    items = [video(2, 2, 2, seed=35), bad, image(2, 2, seed=36)]
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode(items)
    assert raised.value.index == 1
    assert "item 1" in str(raised.value) and words in str(raised.value)
