"""Qwen4-Exp's checks that need a whole Hugging Face model (what the suite checks on a tower alone is
in test_adapter_conformance.py, `family_cases/qwen4_exp.py`): its record (Qwen3.5's adapter under
the family's seam), full saves in one file and in shards, and a tower-only save, load as the family;
the tokens equal what the model's own `get_image_features` / `get_video_features` hand its LLM (the
merger's tokens; the model has no deepstack features), for one image, images of several sizes in
one call, items padded to a larger budget, an image larger than every budget, videos, and the
processor's batch cut by `vitpool.items_from`; a malformed item is refused by its index; the
transformers drop-in answers the model's own calls. CPU, fp32, a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import qwen4_exp as qwen4_exp_case

import vitpool
from vitpool import ConfigError, GraphEncoder, Image, InvalidItemError, Video
from vitpool.families.qwen3_5.adapter import Qwen3_5Adapter
from vitpool.families.qwen4_exp import RECORD
from vitpool.families.qwen4_exp import adapter as qwen4_exp_adapter
from vitpool.families.qwen4_exp.adapter import Qwen4ExpAdapter
from vitpool.models.family import GRID_PROCESSOR_OUTPUT
from vitpool.models.registry import find_family, record_of

pytestmark = pytest.mark.skipif(bool(qwen4_exp_case.TOO_OLD), reason=str(qwen4_exp_case.TOO_OLD))

TOLERANCE = 1e-4
ROW_WIDTH = qwen4_exp_case.ROW_WIDTH
TOWER_TYPE = qwen4_exp_case.TOWER_TYPE


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return qwen4_exp_case.full_model()


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


def load(path: Path, budgets: tuple[int, ...] = qwen4_exp_case.BUDGETS) -> GraphEncoder:
    return GraphEncoder.from_pretrained(path, budgets=list(budgets), device="cpu", dtype=torch.float32)


def pixels(num_rows: int, seed: int) -> torch.Tensor:
    # pixels: [rows, C*T*P*P]
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
        output = features(torch.as_tensor(item.pixel_values), grid)
    assert not hasattr(output, "deepstack_features")  # the merger's tokens are all the LLM gets
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


def test_the_record_runs_the_qwen4_exp_tower_with_qwen3_5s_adapter(encoder, hf_model):
    assert record_of("qwen4_exp") is RECORD and record_of(TOWER_TYPE) is RECORD
    assert find_family(TOWER_TYPE) is RECORD.towers[TOWER_TYPE]
    assert RECORD.model_types == ("qwen4_exp",) and set(RECORD.towers) == {TOWER_TYPE}
    assert RECORD.processor_output == GRID_PROCESSOR_OUTPUT and RECORD.grid_processor
    assert RECORD.vllm_layout is None and not RECORD.dynamo  # neither checked against this model
    assert type(encoder.adapter) is Qwen4ExpAdapter and isinstance(encoder.adapter, Qwen3_5Adapter)
    assert type(encoder.adapter.tower) is type(hf_model.model.visual)
    assert type(hf_model.model.visual).__name__ == "Qwen4ExpVisionModel"
    assert not hasattr(hf_model.model.visual, "deepstack_merger_list")


@pytest.mark.parametrize("save", ["single_save", "sharded_save"])
def test_a_full_save_loads_the_towers_weights_alone(request, hf_model, save):
    path = request.getfixturevalue(save)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen4_exp"
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
    # 4 + 15 + 1 + 8 = 28 tokens: one replay of the 32-token budget holds them all; 10 x 8 and
    # 8 x 4 patches resample the 6 x 6 position table up and down
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
    # get_video_features runs a clip as its (t, h, w) grid, one attention sequence per temporal patch
    items = [video(3, 4, 6, 7), image(4, 6, 8), video(2, 2, 2, 9), video(2, 2, 6, 10)]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_a_tower_only_save_loads_and_gives_the_full_saves_tokens(hf_model, encoder, tmp_path):
    hf_model.model.visual.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == TOWER_TYPE
    tower_only = load(tmp_path)
    assert type(tower_only.adapter) is Qwen4ExpAdapter
    items = [image(4, 4, 11), video(2, 2, 4, 12)]
    got = tower_only.encode(items)
    assert_like_hf(hf_model, items, got)
    for embedding, want in zip(got, encoder.encode(items)):
        assert torch.equal(embedding.tokens, want.tokens)


def test_the_processors_batch_cut_by_items_from_matches_the_models_batch(hf_model, encoder, single_save):
    """Qwen4-Exp's processor is Qwen3-VL's (`Qwen3VLProcessor`, with `Qwen2VLImageProcessor`): its
    PIL image processor's batch, built here with the tiny tower's patch size and the checkpoints'
    mean and std, cut by `vitpool.items_from` (the record's `processor_output`), gives the tokens
    the model computes for the whole batch at once."""
    pil = pytest.importorskip("PIL.Image")
    from transformers import Qwen2VLImageProcessorPil

    config = hf_model.config.vision_config
    side = config.patch_size * config.spatial_merge_size  # a token's side in pixels
    processor = Qwen2VLImageProcessorPil(
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.spatial_merge_size,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": side * side * 4, "longest_edge": side * side * 16},
    )
    pictures = [
        pil.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
        for seed, (h, w) in enumerate([(20, 28), (36, 16), (16, 16)])
    ]
    batch = processor(images=pictures, return_tensors="pt")
    items = vitpool.items_from(batch, family="qwen4_exp")
    by_checkpoint = vitpool.items_from(batch, model=single_save)  # its config.json says qwen4_exp
    by_keys = vitpool.items_from(batch)  # the grid families' keys, cut alike
    for cut in (items, by_checkpoint, by_keys):
        assert [type(item) for item in cut] == [Image] * len(pictures)
    grids = [tuple(row) for row in batch["image_grid_thw"].tolist()]
    assert [tuple(item.grid_thw) for item in items] == grids
    for item, other in zip(items, by_checkpoint):
        assert torch.equal(torch.as_tensor(item.pixel_values), torch.as_tensor(other.pixel_values))
    embeddings = encoder.encode(items)
    with torch.no_grad():  # the model's own call: all images of the request at once
        want = hf_model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    assert len(want) == len(embeddings)
    for embedding, tokens in zip(embeddings, want):
        assert embedding.tokens.shape == tokens.shape
        assert relative_error(embedding.tokens, tokens) <= TOLERANCE


@pytest.mark.parametrize("bad_index", [0, 1, 2])
@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (Image(pixels(12, seed=32), (1, 4, 4)), "needs t*h*w = 16"),  # 12 rows; the grid needs 16
        (Image(torch.randn(16, ROW_WIDTH + 1), (1, 4, 4)), f"{ROW_WIDTH + 1} features per row"),
        (Image(pixels(12, seed=33), (1, 3, 4)), "multiples of the spatial merge size 2"),
        (Image(pixels(32, seed=34), (2, 4, 4)), "use Video for clips"),
    ],
    ids=["rows", "width", "merge", "clip"],
)
def test_a_malformed_item_is_refused_by_index(encoder, bad_index, bad, words):
    items = [image(4, 4, seed=30), video(2, 2, 4, seed=31)]
    items.insert(bad_index, bad)
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode(items)
    assert raised.value.index == bad_index
    assert f"item {bad_index}" in str(raised.value) and words in str(raised.value)


def test_a_tower_with_deepstack_mergers_is_refused():
    """Qwen3.5's forward returns the merger's tokens alone: a Qwen3-VL-like tower would lose its
    deepstack features, so the family's adapter refuses one by name."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    vision = {**qwen4_exp_case.TINY_VISION, "deepstack_visual_indexes": [1]}
    tower = Qwen3VLVisionModel._from_config(Qwen3VLVisionConfig(**vision), dtype=torch.float32)
    with pytest.raises(ConfigError, match="Qwen4-Exp: .*Qwen3VLVisionModel has deepstack mergers"):
        Qwen4ExpAdapter(tower)


def test_a_transformers_without_the_model_is_named(monkeypatch, sharded_save):
    real_find_spec = qwen4_exp_adapter.importlib.util.find_spec

    def find_spec(name: str, *args):
        return None if name == qwen4_exp_adapter.TRANSFORMERS_MODULE else real_find_spec(name, *args)

    monkeypatch.setattr(qwen4_exp_adapter.importlib.util, "find_spec", find_spec)
    message = "Qwen4-Exp needs a transformers with its model .* pip install 'transformers>=5.24.0'"
    with pytest.raises(ConfigError, match=message):
        qwen4_exp_adapter.build_tower(hf_model_config(), torch.float32)
    with pytest.raises(ConfigError, match=message):
        qwen4_exp_adapter.read_tower_config(sharded_save)


def hf_model_config():
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig

    return Qwen4ExpVisionConfig(**qwen4_exp_case.TINY_VISION)


def test_the_drop_in_answers_get_image_features_and_get_video_features():
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = qwen4_exp_case.full_model(seed=7)
    images = [image(4, 6, 40), image(2, 2, 41), image(6, 4, 42)]
    clips = [video(2, 4, 4, 43)]
    calls = [
        (model.model.get_image_features, images),
        (model.model.get_video_features, clips),
    ]

    def answers() -> list[list[torch.Tensor]]:
        outputs = []
        for features, items in calls:
            rows = torch.cat([one.pixel_values for one in items])
            grids = torch.tensor([one.grid_thw for one in items])
            with torch.no_grad():
                outputs.append(list(features(rows, grids).pooler_output))
        return outputs

    wanted = answers()
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=list(qwen4_exp_case.BUDGETS)))
    got = answers()
    for got_call, wanted_call in zip(got, wanted, strict=True):
        assert [tuple(t.shape) for t in got_call] == [tuple(t.shape) for t in wanted_call]
        for got_tokens, want in zip(got_call, wanted_call, strict=True):
            assert relative_error(got_tokens, want) <= TOLERANCE
    restore_vision_tower(model, original)
    assert torch.equal(answers()[0][0], wanted[0][0])
