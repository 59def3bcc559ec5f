"""LFM3-VL (`Lfm3VlVisionModel` and its projector): the static forward against the Hugging Face
model's own `get_image_features` / `get_video_features` (fp32, SDPA) on one image, on items of
different sizes in one call and on the batch the model runs, on videos, in every budget and padded
into a larger one; the convolution's neighbours; other layer patterns, kernel sizes and head
groupings; loading full checkpoints (as saved, sharded, in the model's state_dict layout) and a
tower-only save; bad items named by their index; `vitpool.items_from` on the real image and video
processors; the transformers drop-in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import lfm3_vl as lfm3_vl_case
from family_cases.lfm3_vl import (
    BAD_ITEMS,
    MERGE,
    PATCH,
    ROW_WIDTH,
    TEXT_WIDTH,
    encoder_of,
    hf_model,
    image_features,
)
from safetensors.torch import load_file, save_file

import vitpool
from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError, Video
from vitpool.kernels.attention import ATTENTION_NAME
from vitpool.specs import BatchPlan

pytestmark = pytest.mark.skipif(bool(lfm3_vl_case.TOO_OLD), reason=str(lfm3_vl_case.TOO_OLD))

TOLERANCE = 1e-4
BUDGETS = [16, 32, 64]


def item(t: int, h: int, w: int, seed: int) -> Image | Video:
    """An item of t frames of h x w patches with fresh random pixels, as the processors lay them out."""
    pixels = torch.randn(t * h * w, ROW_WIDTH, generator=torch.Generator().manual_seed(seed))
    return (Video if t > 1 else Image)(pixels, (t, h, w))


def num_tokens(t: int, h: int, w: int) -> int:
    return t * (h // MERGE) * (w // MERGE)


@pytest.fixture(scope="module")
def model():
    return hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model) -> GraphEncoder:
    return encoder_of(model, BUDGETS)


def assert_matches(model, encoder: GraphEncoder, items: list) -> None:
    for position, (embedding, one) in enumerate(zip(encoder.encode(items), items, strict=True)):
        assert embedding.tokens.shape == (num_tokens(*one.grid_thw), TEXT_WIDTH), position
        assert torch.isfinite(embedding.tokens).all(), position
        assert relative_error(embedding.tokens, image_features(model, one)) <= TOLERANCE, position


def test_one_image_matches_get_image_features(model, encoder):
    assert_matches(model, encoder, [item(1, 4, 6, seed=1)])


def test_images_of_different_sizes_in_one_call(model, encoder):
    # wide, tall, square, one row of blocks, one block, large
    items = [item(1, 4, 6, 2), item(1, 8, 2, 3), item(1, 6, 6, 4), item(1, 2, 20, 5), item(1, 2, 2, 6)]
    assert_matches(model, encoder, items)
    # what the model runs: all images in one call, split per image by get_image_features
    pixels = torch.cat([one.pixel_values for one in items])
    grids = torch.tensor([one.grid_thw for one in items])
    with torch.no_grad():
        wanted = model.model.get_image_features(pixels, grids).pooler_output
    for got, want in zip(encoder.encode(items), wanted, strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    # an image larger than any budget (eager, alone) beside a small one
    assert_matches(model, encoder, [item(1, 18, 16, 7), item(1, 2, 4, 8)])


def test_videos_match_get_video_features(model, encoder):
    """Every frame is convolved and attends alone: t times a frame's tokens, frame after frame."""
    items = [item(2, 4, 4, 30), item(1, 4, 6, 31), item(3, 2, 6, 32), item(2, 10, 12, 33)]
    assert_matches(model, encoder, items)
    videos = [one for one in items if one.grid_thw[0] > 1]
    pixels = torch.cat([one.pixel_values for one in videos])
    grids = torch.tensor([one.grid_thw for one in videos])
    with torch.no_grad():
        wanted = model.model.get_video_features(pixels, grids).pooler_output
    for got, want in zip(encoder.encode(videos), wanted, strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    # a clip's frames are not one picture: frame 2 alone gives frame 2's tokens
    clip = items[0]
    second = Image(clip.pixel_values[16:], (1, 4, 4))
    got = encoder.encode([clip])[0].tokens[num_tokens(1, 4, 4) :]
    assert relative_error(got, image_features(model, second)) <= TOLERANCE


def test_every_budget_matches_get_image_features(model, encoder):
    items = [item(1, 4, 4, 9), item(1, 2, 4, 10)]  # 4 + 2 tokens, 24 rows
    rules = encoder.adapter.item_rules
    specs = tuple(
        rules.item_spec("image", tuple(one.pixel_values.shape), "float32", one.grid_thw) for one in items
    )
    for budget in encoder.budgets:
        [outcomes] = encoder.run_plans(
            [(BatchPlan(budget, specs), [one.pixel_values for one in items])], "cpu"
        )
        for one, embedding in zip(items, outcomes, strict=True):
            assert relative_error(embedding.tokens, image_features(model, one)) <= TOLERANCE, budget


def test_padding_rows_and_neighbours_do_not_change_an_items_tokens(model, encoder):
    """The same clip alone in the largest and then the smallest budget with garbage in the padding
    rows' pixels, and beside neighbours: its tokens are HF's."""
    adapter = encoder.adapter
    one = item(2, 2, 6, 11)  # 24 rows, 6 tokens, 2 sequences
    spec = adapter.item_rules.item_spec("video", (24, ROW_WIDTH), "float32", one.grid_thw)
    want = image_features(model, one)
    for budget in (encoder.budgets[-1], encoder.budgets[0]):
        num_rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(num_rows, ROW_WIDTH) * 100
        batch[:24] = one.pixel_values
        with torch.no_grad():
            [tokens] = adapter.forward(batch, adapter.build_metadata([spec], num_rows, budget))
        assert tokens.shape == (budget.num_tokens, TEXT_WIDTH) and torch.isfinite(tokens).all()
        assert relative_error(tokens[:6], want) <= TOLERANCE, budget
    crowded = encoder.encode([item(1, 6, 4, 12), one, item(1, 2, 2, 13)])[1].tokens
    assert relative_error(crowded, want) <= TOLERANCE


def test_the_convolution_gathers_only_within_each_frame(encoder):
    adapter = encoder.adapter
    budget = next(b for b in encoder.budgets if b.num_tokens == 32)
    grids = [(2, 2, 4), (1, 4, 2)]  # 16 + 8 rows, in a buffer of 128
    rules = adapter.item_rules
    specs = [
        rules.item_spec("video" if t > 1 else "image", (t * h * w, ROW_WIDTH), "float32", (t, h, w))
        for t, h, w in grids
    ]
    num_rows = adapter.max_rows(budget.num_tokens)
    index = adapter.build_metadata(specs, num_rows, budget)["conv_index"]
    assert index.shape == (num_rows, 9)
    frame_of_row = torch.tensor([0] * 8 + [1] * 8 + [2] * 8 + [3] * (num_rows - 24))
    inside = index < num_rows
    # each row's centre tap is itself; a neighbour is a row of the same frame; padding has none
    assert torch.equal(index[:24, 4], torch.arange(24))
    assert torch.equal(
        frame_of_row[index.clamp(max=num_rows - 1)][inside], frame_of_row[:, None].expand_as(index)[inside]
    )
    assert not inside[24:].any()
    # the 2 x 4 frame's top-left patch (row 0) has 4 neighbours (itself included), an inner one 6
    assert int(inside[0].sum()) == 4 and int(inside[3].sum()) == 6


@pytest.mark.parametrize(
    "settings",
    [
        {"layer_types": ["full_attention", "conv", "full_attention"], "num_hidden_layers": 3},
        {"conv_kernel_size": 5},
        {"num_key_value_heads": 4},  # no grouping
        {"num_key_value_heads": 1},
    ],
    ids=["attention-first", "kernel-5", "mha", "mqa"],
)
def test_other_configs_match_too(settings):
    model = hf_model(seed=5, **settings)
    encoder = encoder_of(model, [16, 32])
    assert_matches(model, encoder, [item(1, 6, 4, 14), item(2, 4, 2, 15), item(1, 2, 8, 16)])


def test_the_tower_runs_vitpools_packed_attention(encoder):
    vision = encoder.adapter.tower.vision_tower
    assert vision.config._attn_implementation == ATTENTION_NAME
    kinds = {layer.is_attention_layer for layer in vision.layers}
    assert kinds == {True, False}


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([item(1, 2, 4, 17), bad])
    assert raised.value.index == 1 and words in str(raised.value)


# Loading through GraphEncoder.from_pretrained (the registry's "lfm3_vl_vision" tower).


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(model, loaded: GraphEncoder, seed: int) -> None:
    assert loaded.adapter.tower.config.model_type == "lfm3_vl_vision"
    assert_matches(model, loaded, [item(1, 4, 6, seed), item(2, 10, 2, seed + 1)])


def saved_state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def test_loads_a_full_model_save(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    # transformers writes the release's names back (conversion_mapping.py, "lfm3_vl_vision")
    assert {
        "model.vision_tower.patchifier.weight",
        "model.vision_tower.layers.2.self_attn.q_layernorm.weight",
        "model.multi_modal_projector.linear_1.weight",
    } <= set(state)
    assert_loaded(model, load(tmp_path), 20)


def test_loads_a_sharded_full_model_save_opening_only_the_vision_shards(model, tmp_path: Path, monkeypatch):
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    prefixes = ("model.vision_tower.", "model.multi_modal_projector.")
    vision_shards = {shard for key, shard in weight_map.items() if key.startswith(prefixes)}
    assert len(set(weight_map.values())) > len(vision_shards) > 1
    from vitpool.models import loading

    opened = []
    real_open = loading.safe_open
    monkeypatch.setattr(
        loading, "safe_open", lambda path, **kw: opened.append(Path(path).name) or real_open(path, **kw)
    )
    assert_loaded(model, load(tmp_path), 22)
    assert set(opened) == vision_shards


def test_loads_the_models_state_dict_layout(model, tmp_path: Path):
    """A full checkpoint whose keys are the model's own state_dict (`patch_embed`, `q_norm`, ...)."""
    model.config.save_pretrained(tmp_path)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    assert "model.vision_tower.patch_embed.weight" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_loaded(model, load(tmp_path), 24)


def test_loads_a_tower_only_save(model, tmp_path: Path):
    from family_cases.common import save_tower_and_projector
    from family_cases.lfm3_vl import PROJECTOR_WIDTH, encoder_module

    from vitpool.families.lfm3_vl.adapter import tower_only_config

    save_tower_and_projector("lfm3_vl", model.config, encoder_module(model), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "lfm3_vl_vision" and raw["text_hidden_size"] == TEXT_WIDTH
    assert raw["projector_hidden_size"] == PROJECTOR_WIDTH
    assert_loaded(model, load(tmp_path), 26)
    # a bare tower's config (no projector fields) is refused, naming what it lacks
    model.model.vision_tower.config.save_pretrained(tmp_path)
    with pytest.raises((CheckpointError, ValueError), match="text_hidden_size"):
        load(tmp_path)
    assert tower_only_config(model.config).projector_bias is True


def test_a_missing_or_unexpected_key_is_named(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    (tmp_path / "model.safetensors.index.json").unlink(missing_ok=True)
    del state["model.vision_tower.layers.0.conv.spatial_conv.weight"]
    state["model.multi_modal_projector.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"spatial_conv\.weight.*multi_modal_projector\.extra\.weight"):
        load(tmp_path)


def test_another_models_checkpoint_is_refused(tmp_path: Path):
    from vitpool.families.lfm3_vl.adapter import Lfm3VlAdapter

    config = lfm3_vl_case.full_config()
    config.model_type = "lfm3_vl_other"
    with pytest.raises(CheckpointError, match="lfm3_vl_other"):
        Lfm3VlAdapter.tower_only_config(config)


# vitpool.items_from on the real processors (PIL images; video frames as arrays), built offline


def random_pictures(sizes: list[tuple[int, int]], seed: int = 0) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


# wide, tall, tiny (resized up), square, very wide
SIZES = [(10, 16), (30, 12), (3, 3), (24, 24), (5, 60)]


def test_items_from_gives_each_images_processor_output_and_encodes_as_the_model(model, encoder):
    pytest.importorskip("PIL.Image")
    from transformers import Qwen2VLImageProcessorPil  # LFM3-VL's image processor (image_processing_auto)

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE, min_pixels=8 * 8, max_pixels=24 * 24
    )
    pictures = random_pictures(SIZES)
    batch = image_processor(images=pictures, return_tensors="pt")
    grids = batch["image_grid_thw"].tolist()
    assert len({tuple(grid) for grid in grids}) == len(SIZES)
    items = vitpool.items_from(batch, family="lfm3_vl")
    assert len(items) == len(pictures)
    for position, (got, picture) in enumerate(zip(items, pictures, strict=True)):
        alone = image_processor(images=[picture], return_tensors="pt")
        assert torch.equal(got.pixel_values, alone["pixel_values"]), position
        assert list(got.grid_thw) == alone["image_grid_thw"][0].tolist(), position
    with torch.no_grad():
        wanted = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    for position, (embedding, want) in enumerate(zip(encoder.encode(items), wanted, strict=True)):
        assert embedding.tokens.shape == want.shape, position
        assert relative_error(embedding.tokens, want) <= TOLERANCE, position


def test_items_from_cuts_the_video_processors_output(model, encoder):
    pytest.importorskip("torchvision")
    from transformers import Qwen3VLVideoProcessor  # LFM3-VL's video processor (video_processing_auto)

    video_processor = Qwen3VLVideoProcessor(
        patch_size=PATCH,
        temporal_patch_size=2,
        merge_size=MERGE,
        size={"shortest_edge": 64, "longest_edge": 4 * 24 * 24},
    )
    rng = np.random.default_rng(1)
    clips = [
        rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8) for frames, h, w in [(4, 12, 20), (6, 16, 8)]
    ]
    batch = video_processor(videos=clips, return_tensors="pt", do_sample_frames=False)
    items = vitpool.items_from(batch, family="lfm3_vl")
    assert [type(one) for one in items] == [Video, Video]
    assert [list(one.grid_thw) for one in items] == batch["video_grid_thw"].tolist()
    with torch.no_grad():
        wanted = model.model.get_video_features(
            batch["pixel_values_videos"], batch["video_grid_thw"]
        ).pooler_output
    for embedding, want in zip(encoder.encode(items), wanted, strict=True):
        assert embedding.tokens.shape == want.shape and relative_error(embedding.tokens, want) <= TOLERANCE


def test_items_from_cuts_a_batch_of_images_and_videos_in_the_processors_keys(model, encoder):
    """Without the processors: a batch in their keys and layout, images first, then videos."""
    pictures, clips = [item(1, 4, 6, 50), item(1, 2, 2, 51)], [item(2, 4, 6, 52), item(3, 2, 4, 53)]
    batch = {
        "pixel_values": torch.cat([one.pixel_values for one in pictures]),
        "image_grid_thw": torch.tensor([one.grid_thw for one in pictures]),
        "pixel_values_videos": torch.cat([one.pixel_values for one in clips]),
        "video_grid_thw": torch.tensor([one.grid_thw for one in clips]),
    }
    items = vitpool.items_from(batch, family="lfm3_vl")
    assert [type(one) for one in items] == [Image, Image, Video, Video]
    for got, want in zip(items, pictures + clips, strict=True):
        assert torch.equal(got.pixel_values, want.pixel_values) and list(got.grid_thw) == list(want.grid_thw)
    with torch.no_grad():
        wanted = [
            *model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output,
            *model.model.get_video_features(
                batch["pixel_values_videos"], batch["video_grid_thw"]
            ).pooler_output,
        ]
    for embedding, want in zip(encoder.encode(items), wanted, strict=True):
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def test_items_from_refuses_what_does_not_add_up():
    with pytest.raises(ValueError, match="image_grid_thw"):
        vitpool.items_from({"pixel_values": torch.zeros(16, ROW_WIDTH)}, family="lfm3_vl")
    with pytest.raises(ValueError, match="accounts? for 24"):
        vitpool.items_from(
            {"pixel_values": torch.zeros(16, ROW_WIDTH), "image_grid_thw": torch.tensor([[1, 4, 6]])},
            family="lfm3_vl",
        )
    with pytest.raises(ValueError, match="video_grid_thw row 1"):
        vitpool.items_from(
            {
                "pixel_values_videos": torch.zeros(32, ROW_WIDTH),
                "video_grid_thw": torch.tensor([[2, 4, 4], [0, 2, 2]]),
            },
            family="lfm3_vl",
        )
    with pytest.raises(ValueError, match="pixel_values, image_grid_thw"):
        vitpool.items_from({}, family="lfm3_vl")


# The transformers drop-in: the model's get_image_features (and get_video_features) through vitpool


def test_the_drop_in_answers_get_image_and_video_features():
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = hf_model(seed=7)
    images = [item(1, 4, 6, 40), item(1, 2, 2, 41)]
    videos = [item(2, 4, 4, 42)]
    calls = []
    for group in (images, videos):
        pixels = torch.cat([one.pixel_values for one in group])
        calls.append((pixels, torch.tensor([one.grid_thw for one in group])))
    with torch.no_grad():
        wanted = [model.model.get_image_features(*calls[0]).pooler_output]
        wanted.append(model.model.get_video_features(*calls[1]).pooler_output)
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    with torch.no_grad():
        got = [model.model.get_image_features(*calls[0]).pooler_output]
        got.append(model.model.get_video_features(*calls[1]).pooler_output)
    for got_group, want_group in zip(got, wanted, strict=True):
        assert [tuple(t.shape) for t in got_group] == [tuple(t.shape) for t in want_group]
        for got_tokens, want in zip(got_group, want_group, strict=True):
            assert relative_error(got_tokens, want) <= TOLERANCE
    restore_vision_tower(model, original)
    with torch.no_grad():
        assert torch.equal(model.model.get_image_features(*calls[0]).pooler_output[0], wanted[0][0])
