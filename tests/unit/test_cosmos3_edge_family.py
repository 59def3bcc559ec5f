"""Cosmos-3 Edge's checks that need a whole Hugging Face model (what the suite checks on the encoder
alone is in test_adapter_conformance.py, `family_cases/cosmos3_edge.py`): its record; the tokens
equal what the model's own `get_image_features` / `get_video_features` hand its LLM (tower and
projector) for one image, images of several sizes (smaller and larger than the position table) in
one call, items padded to a larger budget, videos beside images, and the processors' batches cut
by `vitpool.items_from`; the position weights are `F.interpolate`'s; full saves in one file and in
shards and a tower-only save load as the family; the transformers drop-in; malformed items are
refused by their index. CPU, fp32, a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import cosmos3_edge as edge_case
from safetensors.torch import save_file

import vitpool
from vitpool import GraphEncoder, Image, InvalidItemError, Video
from vitpool.models.family import GRID_PROCESSOR_OUTPUT
from vitpool.models.registry import find_family, record_of

pytestmark = pytest.mark.skipif(bool(edge_case.TOO_OLD), reason=str(edge_case.TOO_OLD))

TOLERANCE = 1e-5
ROW_WIDTH = edge_case.ROW_WIDTH
LLM_WIDTH = edge_case.LLM_WIDTH
BUDGETS = edge_case.BUDGETS


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return edge_case.full_model()


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
    # pixels: [rows, P*P*C]
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
        assert embedding.tokens.shape == want.shape == (t * h * w // 4, LLM_WIDTH)
        assert len(embedding.outputs) == 1 and embedding.deepstack == []
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def replays(encoder: GraphEncoder) -> dict[int, int]:
    return dict(encoder.stats().replays_per_budget)


def test_the_record(encoder, hf_model):
    from vitpool.families.cosmos3_edge import RECORD
    from vitpool.families.cosmos3_edge.adapter import Cosmos3EdgeAdapter, Cosmos3EdgeEncoder

    assert record_of("cosmos3_edge") is RECORD and record_of(edge_case.TOWER_TYPE) is RECORD
    assert find_family(edge_case.TOWER_TYPE) is RECORD.towers[edge_case.TOWER_TYPE]
    assert RECORD.processor_output == GRID_PROCESSOR_OUTPUT and RECORD.grid_processor
    assert isinstance(encoder.adapter, Cosmos3EdgeAdapter)
    assert isinstance(encoder.adapter.tower, Cosmos3EdgeEncoder)
    assert type(encoder.adapter.tower.visual) is type(hf_model.model.visual)
    assert type(encoder.adapter.tower.projector) is type(hf_model.model.projector)
    # the tower runs vitpool's packed attention, the reference model keeps SDPA
    assert "flash" in encoder.adapter.tower.visual.config._attn_implementation
    assert hf_model.model.visual.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("save", ["single_save", "sharded_save"])
def test_a_full_save_loads_the_tower_and_projector_alone(request, hf_model, save):
    path = request.getfixturevalue(save)
    assert json.loads((path / "config.json").read_text())["model_type"] == "cosmos3_edge"
    index = path / "model.safetensors.index.json"
    if save == "sharded_save":
        weight_map = json.loads(index.read_text())["weight_map"]
        assert len(set(weight_map.values())) > 2
        assert any(key.startswith("model.visual.") for key in weight_map)
        assert any(key.startswith("model.projector.") for key in weight_map)
        vision_shards = {
            shard
            for key, shard in weight_map.items()
            if key.startswith(("model.visual.", "model.projector."))
        }
        assert vision_shards < set(weight_map.values())  # shards of the LLM alone exist, not opened
        # transformers writes the layers' parts reversed through its cosmos3_edge renames
        assert any(key.startswith("model.visual.") and ".self_attn.to_q." in key for key in weight_map)
        assert any(key.startswith("model.visual.") and ".mlp.up_proj." in key for key in weight_map)
    else:
        assert not index.exists() and (path / "model.safetensors").exists()
    loaded = load(path)
    for got, want in (
        (loaded.adapter.tower.visual, hf_model.model.visual),
        (loaded.adapter.tower.projector, hf_model.model.projector),
    ):
        got_state, want_state = got.state_dict(), want.state_dict()
        assert got_state.keys() == want_state.keys()
        for key, value in want_state.items():
            assert torch.equal(got_state[key], value), key
    items = [image(6, 10, seed=1), video(2, 4, 4, seed=2)]
    assert_like_hf(hf_model, items, loaded.encode(items))


def test_a_save_in_the_loaded_models_names_loads(hf_model, tmp_path):
    """Keys as the loaded model names its tensors (`self_attn.q_proj`, `mlp.fc1`), LLM left out."""
    hf_model.config.save_pretrained(tmp_path)
    state = {
        key: value.contiguous() for key, value in hf_model.state_dict().items() if "language_model" not in key
    }
    assert any(".self_attn.q_proj." in key and key.startswith("model.visual.") for key in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    items = [image(4, 6, seed=3)]
    assert_like_hf(hf_model, items, load(tmp_path).encode(items))


def test_a_tower_only_save_loads_and_gives_the_full_saves_tokens(hf_model, encoder, tmp_path):
    from vitpool.families.cosmos3_edge.adapter import Cosmos3EdgeEncoder, tower_only_config

    module = Cosmos3EdgeEncoder(hf_model.model.visual, hf_model.model.projector)
    tower_only_config(hf_model.config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == edge_case.TOWER_TYPE
    assert (saved["text_hidden_size"], saved["projector_hidden_size"]) == (
        LLM_WIDTH,
        edge_case.PROJECTOR_HIDDEN,
    )
    state = {key: value.contiguous() for key, value in module.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    tower_only = load(tmp_path)
    items = [image(4, 4, 11), video(3, 2, 4, 12)]
    got = tower_only.encode(items)
    assert_like_hf(hf_model, items, got)
    for embedding, want in zip(got, encoder.encode(items), strict=True):
        assert torch.equal(embedding.tokens, want.tokens)


def test_a_vision_config_without_the_projectors_fields_is_refused():
    from vitpool.families.cosmos3_edge.adapter import build_encoder

    with pytest.raises(ValueError, match="projector_hidden_size"):
        build_encoder(edge_case.full_config().vision_config)


def test_one_image_matches_get_image_features(hf_model, encoder):
    items = [image(6, 10, seed=1)]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_images_of_several_sizes_share_one_replay(hf_model, encoder):
    before = encoder.stats()
    # 4 + 15 + 1 + 8 = 28 tokens: one replay of the 32-token budget; sides below, at and above the
    # 4x4 position table (the resize shrinks, keeps and stretches it)
    sizes = [(4, 4), (6, 10), (2, 2), (8, 4)]
    items = [image(h, w, seed) for seed, (h, w) in enumerate(sizes, start=2)]
    assert_like_hf(hf_model, items, encoder.encode(items))
    after = encoder.stats()
    assert sum(after.replays_per_budget.values()) == sum(before.replays_per_budget.values()) + 1
    assert after.replays_per_budget[32] == before.replays_per_budget.get(32, 0) + 1
    assert after.eager_batches == before.eager_batches


def test_items_padded_to_a_larger_budget_match(hf_model, sharded_save):
    """A 64-token budget, items of 4 and 4 + 6 tokens (and a video): most rows are padding, a
    sequence of their own."""
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
        item_rows = sum(item.pixel_values.shape[0] for item in items)
        assert after.padding_rows - before.padding_rows == 64 * 4 - item_rows
        assert_like_hf(hf_model, items, embeddings)


def test_an_image_larger_than_every_budget_runs_eager(hf_model, encoder):
    before = encoder.stats().eager_batches
    items = [image(18, 16, seed=6)]  # 72 tokens
    assert_like_hf(hf_model, items, encoder.encode(items))
    assert encoder.stats().eager_batches == before + 1


def test_videos_and_images_together_match_get_video_features(hf_model, encoder):
    # one attention sequence per frame, the resized table repeated for every frame
    items = [video(3, 4, 6, 7), image(4, 6, 8), video(2, 2, 2, 9), video(5, 2, 4, 10)]
    assert_like_hf(hf_model, items, encoder.encode(items))


@pytest.mark.parametrize("grid", [(1, 2, 2), (1, 4, 4), (1, 6, 10), (2, 8, 4), (1, 2, 14)])
def test_the_position_weights_resize_the_table_as_hugging_face(hf_model, encoder, grid):
    """The adapter's weights times the table equal `resize_positional_embeddings` (F.interpolate,
    antialiased bilinear, block-major), shrinking, keeping or stretching each side."""
    embeddings = hf_model.model.visual.embeddings
    table = embeddings.position_embedding.weight
    side = embeddings.position_embedding_size
    want = embeddings.resize_positional_embeddings(
        table.reshape(side, side, -1), torch.tensor([grid]), edge_case.MERGE
    )
    weights = encoder.adapter._position_weights(grid)  # [t*h*w, 2, G]
    got = (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1) @ table
    assert got.shape == want.shape == (grid[0] * grid[1] * grid[2], table.shape[1])
    assert relative_error(got, want) <= 1e-6


def picture_batch(processor, sizes: list[tuple[int, int]]):
    pil = pytest.importorskip("PIL.Image")
    pictures = [
        pil.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
        for seed, (h, w) in enumerate(sizes)
    ]
    return processor(images=pictures, return_tensors="pt")


def image_processor(**settings):
    pytest.importorskip("PIL.Image")
    from transformers.models.cosmos3_edge.image_processing_pil_cosmos3_edge import (
        Cosmos3EdgeImageProcessorPil,
    )

    return Cosmos3EdgeImageProcessorPil(
        patch_size=edge_case.PATCH,
        merge_size=edge_case.MERGE,
        size={"shortest_edge": 16, "longest_edge": 2 * 64 * 64},
        **settings,
    )


def test_the_image_processors_batch_cut_by_items_from_matches_the_models_batch(
    hf_model, encoder, single_save
):
    """`Cosmos3EdgeImageProcessorPil`'s batch (GLM-4V's processor, HWC patches), cut by
    `vitpool.items_from`, gives the tokens the model computes for the whole batch at once."""
    batch = picture_batch(image_processor(), [(12, 20), (16, 8), (9, 30)])
    items = vitpool.items_from(batch, family="cosmos3_edge")
    by_checkpoint = vitpool.items_from(batch, model=single_save)  # its config.json says cosmos3_edge
    assert [type(item) for item in by_checkpoint] == [type(item) for item in items] == [Image] * 3
    grids = [tuple(row) for row in batch["image_grid_thw"].tolist()]
    assert [tuple(item.grid_thw) for item in items] == grids and len(set(grids)) == 3
    embeddings = encoder.encode(items)
    with torch.no_grad():  # the model's own call: all images of the request at once
        want = hf_model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    assert len(want) == len(embeddings)
    for embedding, tokens in zip(embeddings, want, strict=True):
        assert embedding.tokens.shape == tokens.shape
        assert relative_error(embedding.tokens, tokens) <= TOLERANCE


def test_a_processor_set_to_a_temporal_patch_of_two_is_refused_as_the_model_fails(hf_model, encoder):
    """Rows twice as wide: the model's patch Linear fails on them; vitpool names the item and width."""
    batch = picture_batch(image_processor(temporal_patch_size=2), [(12, 20), (16, 8)])
    assert batch["pixel_values"].shape[1] == 2 * ROW_WIDTH
    with pytest.raises(RuntimeError), torch.no_grad():
        hf_model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode(vitpool.items_from(batch, family="cosmos3_edge"))
    assert raised.value.index == 0
    assert f"{2 * ROW_WIDTH} features per row; the model takes {ROW_WIDTH}" in str(raised.value)


def test_items_from_cuts_the_video_processors_output(hf_model, encoder):
    pytest.importorskip("torchvision")
    from transformers.models.cosmos3_edge.video_processing_cosmos3_edge import Cosmos3EdgeVideoProcessor

    processor = Cosmos3EdgeVideoProcessor(
        patch_size=edge_case.PATCH,
        merge_size=edge_case.MERGE,
        size={"shortest_edge": 16, "longest_edge": 4 * 24 * 24},
        do_sample_frames=False,
    )
    rng = np.random.default_rng(1)
    clips = [rng.integers(0, 256, (f, h, w, 3), dtype=np.uint8) for f, h, w in [(4, 12, 20), (5, 16, 8)]]
    batch = processor(videos=clips, return_tensors="pt")
    items = vitpool.items_from(batch, family="cosmos3_edge")
    assert [type(one) for one in items] == [Video, Video]
    assert [list(one.grid_thw) for one in items] == batch["video_grid_thw"].tolist()
    with torch.no_grad():
        want = hf_model.model.get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"])
    for embedding, tokens in zip(encoder.encode(items), want.pooler_output, strict=True):
        assert relative_error(embedding.tokens, tokens) <= TOLERANCE


def test_items_from_cuts_images_and_videos_in_the_processors_keys(hf_model, encoder):
    """Without torchvision (the video processor's backend): a batch in the processor's keys."""
    stills, clips = [image(4, 6, 60), image(2, 2, 61)], [video(3, 2, 4, 62), video(2, 4, 4, 63)]
    batch = {
        "pixel_values": torch.cat([one.pixel_values for one in stills]),
        "image_grid_thw": torch.tensor([one.grid_thw for one in stills]),
        "pixel_values_videos": torch.cat([one.pixel_values for one in clips]),
        "video_grid_thw": torch.tensor([one.grid_thw for one in clips]),
    }
    items = vitpool.items_from(batch, family="cosmos3_edge")
    assert [type(one) for one in items] == [Image, Image, Video, Video]
    for got, want in zip(items, [*stills, *clips], strict=True):
        assert torch.equal(got.pixel_values, want.pixel_values) and list(got.grid_thw) == list(want.grid_thw)
    with torch.no_grad():
        want = [
            *hf_model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output,
            *hf_model.model.get_video_features(
                batch["pixel_values_videos"], batch["video_grid_thw"]
            ).pooler_output,
        ]
    for embedding, tokens in zip(encoder.encode(items), want, strict=True):
        assert relative_error(embedding.tokens, tokens) <= TOLERANCE


def test_items_from_refuses_what_does_not_add_up():
    with pytest.raises(ValueError, match="image_grid_thw"):
        vitpool.items_from({"pixel_values": torch.zeros(16, ROW_WIDTH)}, family="cosmos3_edge")
    with pytest.raises(ValueError, match="accounts? for 24"):
        vitpool.items_from(
            {"pixel_values": torch.zeros(16, ROW_WIDTH), "image_grid_thw": torch.tensor([[1, 4, 6]])},
            family="cosmos3_edge",
        )


def test_the_transformers_drop_in_answers_get_image_and_video_features(hf_model):
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    stills = [image(4, 6, seed=50), image(2, 4, seed=51)]
    pixel_values = torch.cat([item.pixel_values for item in stills])
    grids = torch.tensor([item.grid_thw for item in stills])
    clip = video(4, 2, 4, seed=52)
    video_grid = torch.tensor([clip.grid_thw])
    with torch.no_grad():
        want = hf_model.model.get_image_features(pixel_values, grids).pooler_output
        want_video = hf_model.model.get_video_features(clip.pixel_values, video_grid).pooler_output
    original = replace_vision_tower(hf_model, graph_encoder_for(hf_model, budgets=list(BUDGETS)))
    try:
        with torch.no_grad():
            got = hf_model.model.get_image_features(pixel_values, grids).pooler_output
            got_video = hf_model.model.get_video_features(clip.pixel_values, video_grid).pooler_output
    finally:
        restore_vision_tower(hf_model, original)
    assert hf_model.model.visual is original["tower"] and hf_model.model.projector is original["projector"]
    assert [tuple(t.shape) for t in [*got, *got_video]] == [tuple(t.shape) for t in [*want, *want_video]]
    for tokens, expected in zip([*got, *got_video], [*want, *want_video], strict=True):
        assert relative_error(tokens, expected) <= TOLERANCE


BAD_AT_AN_INDEX = [
    (Image(pixels(12, seed=32), (1, 4, 4)), "needs t*h*w = 16"),  # the grid does not match the rows
    (Video(pixels(20, seed=33), (2, 2, 4)), "needs t*h*w = 16"),
    (Image(pixels(16, seed=34).reshape(16, 3, 2, 2), (1, 4, 4)), "must be 2-D"),
    (Image(pixels(16, seed=35)[:, :-1], (1, 4, 4)), f"{ROW_WIDTH - 1} features per row"),
    (Image(pixels(16, seed=36).to(torch.int32), (1, 4, 4)), "floating-point dtype"),
    (Image(pixels(0, seed=37), (1, 0, 4)), "zero or negative"),  # an empty item
]


@pytest.mark.parametrize("bad_index", [0, 1, 2])
@pytest.mark.parametrize("bad, words", BAD_AT_AN_INDEX, ids=[words for _, words in BAD_AT_AN_INDEX])
def test_a_malformed_item_is_refused_by_its_index(encoder, bad, words, bad_index):
    items = [image(4, 4, seed=30), video(2, 2, 4, seed=31)]
    items.insert(bad_index, bad)
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode(items)
    assert raised.value.index == bad_index
    assert f"item {bad_index}" in str(raised.value) and words in str(raised.value)


def test_an_empty_call_gives_no_embeddings_and_runs_nothing(encoder):
    before = encoder.stats()
    assert encoder.encode([]) == []
    assert encoder.stats().replays_per_budget == before.replays_per_budget
