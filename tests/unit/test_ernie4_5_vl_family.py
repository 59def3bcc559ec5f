"""ERNIE-4.5-VL's checks that need a whole Hugging Face model (what the suite checks on the encoder
alone is in test_adapter_conformance.py, `family_cases/ernie4_5_vl_moe.py`): its record; the tokens
equal what the model's own `get_image_features` / `get_video_features` hand its LLM (tower and
resampler) for one image, images of several sizes in one call, items padded to a larger budget,
videos (frame pairs) beside images, and the image processor's batch cut by the record's cutter;
a video's rows bound its batch (`rows`); full saves in one file and in shards, a save keyed as the
loaded model names its tensors, and a tower-only save load as the family; the transformers
drop-in; a malformed item is refused by its index. CPU, fp32, a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import ernie4_5_vl_moe as ernie_case
from safetensors.torch import save_file

from vitpool import GraphEncoder, Image, InvalidItemError, Video
from vitpool.families.ernie4_5_vl_moe import RECORD
from vitpool.families.ernie4_5_vl_moe.adapter import (
    Ernie4_5_VLMoeAdapter,
    Ernie4_5_VLMoeEncoder,
    tower_only_config,
)
from vitpool.families.ernie4_5_vl_moe.rules import ROWS
from vitpool.models.family import GRID_PROCESSOR_OUTPUT, named_object
from vitpool.models.registry import find_family, record_of

TOLERANCE = 1e-5
ROW_WIDTH = ernie_case.ROW_WIDTH
LLM_WIDTH = ernie_case.LLM_WIDTH
BUDGETS = ernie_case.BUDGETS


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return ernie_case.full_model()


@pytest.fixture(scope="module")
def sharded_save(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharded")
    hf_model.save_pretrained(path, max_shard_size="50KB")  # several shards: only the vision ones are read
    return path


@pytest.fixture(scope="module")
def single_save(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("single")
    hf_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def encoder(sharded_save) -> GraphEncoder:
    return load(sharded_save)


def load(path: Path, budgets: tuple[int, ...] = BUDGETS) -> GraphEncoder:
    return GraphEncoder.from_pretrained(path, budgets=list(budgets), device="cpu", dtype=torch.float32)


def pixels(num_rows: int, seed: int) -> torch.Tensor:
    # pixels: [rows, C*P*P]
    return torch.randn(num_rows, ROW_WIDTH, generator=torch.Generator().manual_seed(seed))


def image(h: int, w: int, seed: int) -> Image:
    return Image(pixels(h * w, seed), (1, h, w))


def video(t: int, h: int, w: int, seed: int) -> Video:
    return Video(pixels(t * h * w, seed), (t, h, w))


def hf_tokens(model: torch.nn.Module, item) -> torch.Tensor:
    """What the Hugging Face model hands its LLM for this item, run alone."""
    features = model.model.get_video_features if isinstance(item, Video) else model.model.get_image_features
    grid = torch.as_tensor(item.grid_thw).reshape(1, 3)
    with torch.no_grad():
        [tokens] = features(torch.as_tensor(item.pixel_values), grid).pooler_output
    return tokens


def assert_like_hf(model: torch.nn.Module, items: list, embeddings: list) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings, strict=True):
        want = hf_tokens(model, item)
        t, h, w = (int(v) for v in torch.as_tensor(item.grid_thw).reshape(3))
        frames_per_token = 2 if isinstance(item, Video) else 1
        assert embedding.tokens.shape == want.shape == (t * h * w // 4 // frames_per_token, LLM_WIDTH)
        assert len(embedding.outputs) == 1 and embedding.deepstack == []
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def replays(encoder: GraphEncoder) -> dict[int, int]:
    return dict(encoder.stats().replays_per_budget)


def test_the_record(encoder):
    assert record_of("ernie4_5_vl_moe") is RECORD and record_of(ernie_case.TOWER_TYPE) is RECORD
    assert find_family(ernie_case.TOWER_TYPE) is RECORD.towers[ernie_case.TOWER_TYPE]
    assert RECORD.processor_output == GRID_PROCESSOR_OUTPUT and RECORD.grid_processor
    assert RECORD.vllm_layout is None  # vLLM serves Baidu's config, which vitpool does not load
    assert isinstance(encoder.adapter, Ernie4_5_VLMoeAdapter)
    assert isinstance(encoder.adapter.tower, Ernie4_5_VLMoeEncoder)
    # every budget bounds its rows at 4 per token: its buffers' rows
    assert all(budget.limit(ROWS) == 4 * budget.num_tokens for budget in encoder.budgets)


@pytest.mark.parametrize("save", ["single_save", "sharded_save"])
def test_a_full_save_loads_the_tower_and_resampler_alone(request, hf_model, save):
    path = request.getfixturevalue(save)
    assert json.loads((path / "config.json").read_text())["model_type"] == "ernie4_5_vl_moe"
    index = path / "model.safetensors.index.json"
    if save == "sharded_save":
        weight_map = json.loads(index.read_text())["weight_map"]
        assert len(set(weight_map.values())) > 2
        # Baidu's names, as save_pretrained writes them back
        assert any(key.startswith("model.vision_model.") for key in weight_map)
        assert any(key.startswith("model.resampler_model.spatial_linear.0.") for key in weight_map)
        # shards of the language model only are not opened
        vision_shards = {
            shard for key, shard in weight_map.items() if "vision_model" in key or "resampler" in key
        }
        assert vision_shards < set(weight_map.values())
    else:
        assert not index.exists() and (path / "model.safetensors").exists()
    loaded = load(path)
    for got, want in (
        (loaded.adapter.tower.vision_tower, hf_model.model.vision_tower),
        (loaded.adapter.tower.resampler_model, hf_model.model.resampler_model),
    ):
        got_state, want_state = got.state_dict(), want.state_dict()
        assert got_state.keys() == want_state.keys()
        for key, value in want_state.items():
            assert torch.equal(got_state[key], value), key
    items = [image(6, 10, seed=1), video(2, 4, 4, seed=2)]
    assert_like_hf(hf_model, items, loaded.encode(items))


def test_a_save_in_transformers_names_loads(hf_model, tmp_path):
    """Keys as the loaded model names its tensors (`model.vision_tower.`, `spatial_linear.fc1`)."""
    hf_model.config.save_pretrained(tmp_path)
    state = {
        key: value.contiguous() for key, value in hf_model.state_dict().items() if "language_model" not in key
    }
    assert any(key.startswith("model.resampler_model.spatial_linear.fc1.") for key in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    items = [image(4, 6, seed=3)]
    assert_like_hf(hf_model, items, load(tmp_path).encode(items))


def test_a_tower_only_save_loads_and_gives_the_full_saves_tokens(hf_model, encoder, tmp_path):
    module = Ernie4_5_VLMoeEncoder(hf_model.model.vision_tower, hf_model.model.resampler_model)
    tower_only_config(hf_model.config).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == ernie_case.TOWER_TYPE
    save_file(
        {k: v.contiguous() for k, v in module.state_dict().items()}, str(tmp_path / "model.safetensors")
    )
    tower_only = load(tmp_path)
    items = [image(4, 4, 11), video(4, 2, 4, 12)]
    got = tower_only.encode(items)
    assert_like_hf(hf_model, items, got)
    for embedding, want in zip(got, encoder.encode(items), strict=True):
        assert torch.equal(embedding.tokens, want.tokens)


def test_one_image_matches_get_image_features(hf_model, encoder):
    items = [image(6, 10, seed=1)]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_images_of_several_sizes_share_one_replay(hf_model, encoder):
    before = encoder.stats()
    # 4 + 15 + 1 + 8 = 28 tokens, 112 rows: one replay of the 32-token budget holds them all
    sizes = [(4, 4), (6, 10), (2, 2), (8, 4)]
    items = [image(h, w, seed) for seed, (h, w) in enumerate(sizes, start=2)]
    assert_like_hf(hf_model, items, encoder.encode(items))
    after = encoder.stats()
    assert sum(after.replays_per_budget.values()) == sum(before.replays_per_budget.values()) + 1
    assert after.replays_per_budget[32] == before.replays_per_budget.get(32, 0) + 1
    assert after.eager_batches == before.eager_batches


def test_items_padded_to_a_larger_budget_match(hf_model, sharded_save):
    """A 64-token budget, items of 4 and 4 + 6 tokens (and a video): most rows are padding, a
    sequence of their own, and most output slots pair padding tokens."""
    padded = load(sharded_save, budgets=(64,))
    for items in (
        [image(4, 4, seed=20)],
        [image(4, 4, seed=20), image(4, 6, seed=21)],
        [video(2, 4, 4, seed=22), image(2, 2, seed=23)],
    ):
        before = padded.stats()
        embeddings = padded.encode(items)
        after = padded.stats()
        assert after.replays_per_budget.get(64, 0) == before.replays_per_budget.get(64, 0) + 1
        assert after.padding_rows - before.padding_rows == 64 * 4 - sum(
            i.pixel_values.shape[0] for i in items
        )
        assert_like_hf(hf_model, items, embeddings)


def test_an_image_larger_than_every_budget_runs_eager(hf_model, encoder):
    before = encoder.stats().eager_batches
    items = [image(18, 16, seed=6)]  # 72 tokens
    assert_like_hf(hf_model, items, encoder.encode(items))
    assert encoder.stats().eager_batches == before + 1


def test_videos_and_images_together_match_get_video_features(hf_model, encoder):
    # frames 2k and 2k+1 merge into one token: 8 rows a token
    items = [video(4, 4, 6, 7), image(4, 6, 8), video(2, 2, 2, 9), video(6, 2, 4, 10)]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_a_video_needs_a_budget_of_its_rows_not_its_tokens(hf_model, encoder):
    """A 2-frame 8x8 video gives 16 tokens from 128 rows: the 16-token budget holds 64 rows, so it
    replays the 32-token budget (128 rows); an image of 16 tokens fits the 16-token budget."""
    clip, still = video(2, 8, 8, seed=40), image(8, 8, seed=41)
    rules = encoder.adapter.item_rules
    clip_spec = rules.item_spec("video", tuple(clip.pixel_values.shape), "float32", clip.grid_thw)
    still_spec = rules.item_spec("image", tuple(still.pixel_values.shape), "float32", still.grid_thw)
    assert clip_spec.num_tokens == still_spec.num_tokens == 16
    assert clip_spec.need(ROWS) == 128 and still_spec.need(ROWS) == 64
    for item, budget in ((clip, 32), (still, 16)):
        before = replays(encoder)
        assert_like_hf(hf_model, [item], encoder.encode([item]))
        after = replays(encoder)
        assert {n: after.get(n, 0) - before.get(n, 0) for n in BUDGETS} == {
            n: int(n == budget) for n in BUDGETS
        }


def test_the_processors_batch_cut_by_the_record_matches_the_models_batch(hf_model, encoder):
    """The image processor's batch, cut by the record's `processor_output`, gives the tokens the
    model computes for the whole batch at once."""
    pil = pytest.importorskip("PIL.Image")
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeImageProcessorPil,
    )

    processor = Ernie4_5_VLMoeImageProcessorPil(
        patch_size=ernie_case.PATCH,
        merge_size=2,
        size={"shortest_edge": 16, "longest_edge": 2 * 24 * 24},
    )
    pictures = [
        pil.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
        for seed, (h, w) in enumerate([(12, 20), (16, 8), (9, 30)])
    ]
    batch = processor(images=pictures, return_tensors="pt")
    assert GRID_PROCESSOR_OUTPUT.missing(batch.keys()) == ()
    assert batch["pixel_values"].shape[1] == ROW_WIDTH
    parts = named_object(RECORD.processor_output.split)(batch)
    assert len(parts) == len(pictures) == batch["image_grid_thw"].shape[0]
    assert len({tuple(part.grid) for part in parts}) == len(parts)  # three sizes
    embeddings = encoder.encode([Image(part.pixel_values, part.grid) for part in parts])
    with torch.no_grad():  # the model's own call: all images of the request at once
        want = hf_model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    assert len(want) == len(embeddings)
    for embedding, tokens in zip(embeddings, want, strict=True):
        assert embedding.tokens.shape == tokens.shape
        assert relative_error(embedding.tokens, tokens) <= TOLERANCE


def test_the_transformers_drop_in_answers_get_image_and_video_features(hf_model):
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    items = [image(4, 6, seed=50), image(2, 4, seed=51)]
    pixel_values = torch.cat([item.pixel_values for item in items])
    grids = torch.tensor([item.grid_thw for item in items])
    with torch.no_grad():
        want = hf_model.model.get_image_features(pixel_values, grids).pooler_output
    clip = video(4, 2, 4, seed=52)
    video_grid = torch.tensor([clip.grid_thw])
    with torch.no_grad():
        want_video = hf_model.model.get_video_features(clip.pixel_values, video_grid).pooler_output
    original = replace_vision_tower(hf_model, graph_encoder_for(hf_model, budgets=list(BUDGETS)))
    try:
        with torch.no_grad():
            got = hf_model.model.get_image_features(pixel_values, grids).pooler_output
            # the stand-in keeps the resampler's settings, which get_video_features reads
            got_video = hf_model.model.get_video_features(clip.pixel_values, video_grid).pooler_output
    finally:
        restore_vision_tower(hf_model, original)
    assert hf_model.model.vision_tower is original["tower"]
    for tokens, expected in zip([*got, *got_video], [*want, *want_video], strict=True):
        assert relative_error(tokens, expected) <= TOLERANCE


@pytest.mark.parametrize("bad_index", [0, 1, 2])
def test_an_item_whose_grid_does_not_match_its_rows_is_refused_by_index(encoder, bad_index):
    items = [image(4, 4, seed=30), video(2, 2, 4, seed=31)]
    bad = Image(pixels(12, seed=32), (1, 4, 4))  # 12 rows; the grid needs 16
    items.insert(bad_index, bad)
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode(items)
    assert raised.value.index == bad_index
    assert f"item {bad_index}" in str(raised.value) and "needs t*h*w = 16" in str(raised.value)


def test_a_video_of_an_odd_frame_count_is_refused_by_index(encoder):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([image(4, 4, seed=33), video(3, 2, 4, seed=34)])
    assert raised.value.index == 1 and "temporal merge size 2" in str(raised.value)


def test_a_temporal_merge_size_other_than_two_is_refused():
    module = ernie_case.tiny_encoder_module()
    module.vision_tower.config.temporal_merge_size = 3
    with pytest.raises(ValueError, match="temporal_merge_size 3"):
        Ernie4_5_VLMoeAdapter(module)
