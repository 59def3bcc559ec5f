"""HunYuan V4 VL (`HYV4VLVisionModel` with its patch merger): the static forward against the Hugging
Face model's own `get_image_features` / `get_video_features` (fp32, SDPA) on one image, on items of
different sizes in one call and on the batch the model runs, on videos, in every budget and padded
into a larger one; the buffer rows a budget needs; the position table's shifted resampling; loading
full checkpoints (as saved, sharded, in the model's state_dict layout) and a tower-only save; bad
items named by their index; `vitpool.items_from` on the real image and video processors; the
transformers drop-in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import hy_v4_vl as hy_v4_vl_case
from family_cases.hy_v4_vl import (
    BAD_ITEMS,
    EDGE,
    MERGE,
    PATCH,
    ROW_WIDTH,
    TEXT_WIDTH,
    encoder_of,
    hf_model,
    image_features,
    item_tokens,
)
from safetensors.torch import load_file, save_file

import vitpool
from vitpool import CheckpointError, ConfigError, GraphEncoder, Image, InvalidItemError, Video
from vitpool.kernels.attention import ATTENTION_NAME
from vitpool.specs import BatchPlan

pytestmark = pytest.mark.skipif(bool(hy_v4_vl_case.TOO_OLD), reason=str(hy_v4_vl_case.TOO_OLD))

TOLERANCE = 1e-4
BUDGETS = [16, 32, 64]


def item(t: int, h: int, w: int, seed: int) -> Image | Video:
    """An item of t frames of h x w patches with fresh random pixels, as the processors lay them out."""
    pixels = torch.randn(t * h * w, ROW_WIDTH, generator=torch.Generator().manual_seed(seed))
    return (Video if t > 1 else Image)(pixels, (t, h, w))


@pytest.fixture(scope="module")
def model():
    return hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model) -> GraphEncoder:
    return encoder_of(model, BUDGETS)


def assert_matches(model, encoder: GraphEncoder, items: list) -> None:
    for position, (embedding, one) in enumerate(zip(encoder.encode(items), items, strict=True)):
        assert embedding.tokens.shape == (item_tokens(*one.grid_thw), TEXT_WIDTH), position
        assert torch.isfinite(embedding.tokens).all(), position
        assert relative_error(embedding.tokens, image_features(model, one)) <= TOLERANCE, position


def test_one_image_matches_get_image_features(model, encoder):
    assert_matches(model, encoder, [item(1, 4, 6, seed=1)])


def test_images_of_different_sizes_in_one_call(model, encoder):
    # wide, tall, square, one row of blocks, wider and taller than the position table (EDGE)
    items = [item(1, 4, 6, 2), item(1, 8, 2, 3), item(1, 6, 6, 4), item(1, 2, 20, 5), item(1, 12, 10, 6)]
    assert_matches(model, encoder, items)
    # what the model runs: all images in one call, split per image by get_image_features
    pixels = torch.cat([one.pixel_values for one in items])
    grids = torch.tensor([one.grid_thw for one in items])
    with torch.no_grad():
        wanted = model.model.get_image_features(pixels, grids).pooler_output
    for got, want in zip(encoder.encode(items), wanted, strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    # an image larger than any budget (eager, alone) beside a small one
    assert_matches(model, encoder, [item(1, 16, 16, 7), item(1, 2, 2, 8)])


def test_videos_match_get_video_features(model, encoder):
    """Every frame attends alone and is merged alone: t times a frame's tokens, frame after frame."""
    items = [item(2, 4, 4, 30), item(1, 4, 6, 31), item(3, 2, 6, 32), item(2, 10, 12, 33)]
    assert_matches(model, encoder, items)
    videos = [one for one in items if one.grid_thw[0] > 1]
    pixels = torch.cat([one.pixel_values for one in videos])
    grids = torch.tensor([one.grid_thw for one in videos])
    with torch.no_grad():
        wanted = model.model.get_video_features(pixels, grids).pooler_output
    for got, want in zip(encoder.encode(videos), wanted, strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    # a clip's frames are not images side by side: frame 2 alone gives frame 2's tokens
    clip = items[0]
    second = Image(clip.pixel_values[16:], (1, 4, 4))
    frame_tokens = item_tokens(1, 4, 4)
    got = encoder.encode([clip])[0].tokens[frame_tokens:]
    assert relative_error(got, image_features(model, second)) <= TOLERANCE


def test_every_budget_matches_get_image_features(model, encoder):
    items = [item(1, 4, 4, 9), item(1, 2, 4, 10)]  # 6 + 3 tokens, 24 rows
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
    """The same clip alone in the smallest and the largest budget with garbage in the padding rows'
    pixels, and beside neighbours: its tokens are HF's."""
    adapter = encoder.adapter
    one = item(2, 2, 6, 11)  # 24 rows, 8 tokens, 2 sequences
    spec = adapter.item_rules.item_spec("video", (24, ROW_WIDTH), "float32", one.grid_thw)
    want = image_features(model, one)
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        num_rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(num_rows, ROW_WIDTH) * 100
        batch[:24] = one.pixel_values
        with torch.no_grad():
            [tokens] = adapter.forward(batch, adapter.build_metadata([spec], num_rows, budget))
        assert tokens.shape == (budget.num_tokens, TEXT_WIDTH) and torch.isfinite(tokens).all()
        assert relative_error(tokens[:8], want) <= TOLERANCE, budget
    crowded = encoder.encode([item(1, 6, 4, 12), one, item(1, 2, 2, 13)])[1].tokens
    assert relative_error(crowded, want) <= TOLERANCE


def test_metadata_of_a_clip_and_an_image(encoder):
    adapter = encoder.adapter
    budget = next(b for b in encoder.budgets if b.num_tokens == 32)
    num_rows = adapter.max_rows(32)  # 4 * (32 - 1)
    clip = adapter.item_rules.item_spec("video", (16, ROW_WIDTH), "float32", (2, 2, 4))  # 2 x (1 x 2 blocks)
    image = adapter.item_rules.item_spec("image", (16, ROW_WIDTH), "float32", (1, 4, 4))  # 2 x 2 blocks
    assert (clip.num_tokens, image.num_tokens) == (6, 6)
    metadata = adapter.build_metadata([clip, image], num_rows, budget)
    assert metadata["cu_seqlens"][:5].tolist() == [0, 8, 16, 32, num_rows]
    assert set(metadata["cu_seqlens"][4:].tolist()) == {num_rows}
    assert metadata["merge_index"][:4].tolist() == [
        [0, 1, 4, 5],
        [2, 3, 6, 7],
        [8, 9, 12, 13],
        [10, 11, 14, 15],
    ]
    newline = num_rows // 4
    # per frame, each row of blocks then its newline; no begin or end tokens
    assert metadata["token_index"][:12].tolist() == [
        0,
        1,
        newline,
        2,
        3,
        newline,
        4,
        5,
        newline,
        6,
        7,
        newline,
    ]
    assert metadata["token_index"][12:].abs().sum() == 0
    # both frames read the same table taps; padding rows read row 0 with weight 0
    assert torch.equal(metadata["interp_indices"][:8], metadata["interp_indices"][8:16])
    assert metadata["interp_weights"][:32].sum(1).allclose(torch.ones(32))
    assert metadata["interp_weights"][32:].abs().sum() == 0
    with pytest.raises(ValueError, match="the buffers hold"):
        adapter.build_metadata([image] * 6, num_rows, budget)  # 36 tokens


def test_a_budget_holds_the_rows_of_every_item_that_fits_it(encoder):
    """A frame of b blocks gives at least b + 1 tokens: a budget of n tokens takes at most 4 (n - 1)
    rows, and a single row of blocks reaches that bound."""
    adapter = encoder.adapter
    for num_tokens in range(2, 60):
        widest = (
            max(
                t * h * w
                for t in (1, 2, 3)
                for h in range(MERGE, 2 * num_tokens, MERGE)
                for w in range(MERGE, 2 * num_tokens, MERGE)
                if item_tokens(t, h, w) <= num_tokens
            )
            if num_tokens >= 2
            else 0
        )
        assert widest == adapter.max_rows(num_tokens), num_tokens


def test_the_position_table_is_resampled_with_the_shifted_scale(model):
    """transformers resamples by scale (n + 0.1) / edge, not to size n: the taps follow it (a
    resampling to size n would differ)."""
    from vitpool.families.hy_v4_vl.adapter import axis_taps

    table = torch.randn(1, 1, EDGE, 1)
    for size in (2, 6, 8, 12, 20):
        rows, weights = axis_taps(size, EDGE, "bilinear")
        got = (table[0, 0, :, 0][rows] * weights).sum(1)
        want = torch.nn.functional.interpolate(
            table, scale_factor=((size + 0.1) / EDGE, 1.0), mode="bilinear", align_corners=False
        )[0, 0, :, 0]
        assert torch.allclose(got, want, atol=1e-6), size
        if size != EDGE:
            to_size = torch.nn.functional.interpolate(table, size=(size, 1), mode="bilinear")[0, 0, :, 0]
            assert not torch.allclose(got, to_size, atol=1e-6), size


def test_the_tower_runs_vitpools_packed_attention(encoder):
    """Hugging Face's other attention path splits sequences on the host (`.tolist()`): no graph."""
    layers = encoder.adapter.tower.layers
    assert [layer.self_attn.config._attn_implementation for layer in layers] == [ATTENTION_NAME] * len(layers)


def test_a_bicubic_position_table_matches_too():
    other = hf_model(seed=5, interpolate_mode="bicubic")
    encoder = encoder_of(other, [16, 64])
    assert encoder.adapter.taps == 16
    assert_matches(other, encoder, [item(1, 4, 6, 14), item(1, 12, 10, 15), item(2, 2, 14, 16)])


def test_an_interpolation_vitpool_does_not_run_is_refused():
    with pytest.raises(ConfigError, match="interpolate_mode 'nearest'"):
        encoder_of(hf_model(interpolate_mode="nearest"), [16])


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([item(1, 2, 4, 17), bad])
    assert raised.value.index == 1 and words in str(raised.value)


# Loading through GraphEncoder.from_pretrained (the registry's "hy_v4_vl_vision" tower).


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(model, loaded: GraphEncoder, seed: int) -> None:
    assert loaded.adapter.tower.config.model_type == "hy_v4_vl_vision"
    assert_matches(model, loaded, [item(1, 4, 6, seed), item(2, 10, 2, seed + 1)])


def saved_state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def test_loads_a_full_model_save(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    # transformers writes the release layout back: `vit.`, `perceive.` (its RMSNorm `norm`), Megatron names
    assert {
        "vit.perceive.proj.0.weight",
        "vit.perceive.norm.weight",
        "vit.layers.0.mlp.dense_h_to_4h.weight",
    } <= set(state)
    assert not any(key.startswith("model.vision_tower.") for key in state)
    assert_loaded(model, load(tmp_path), 20)


def test_loads_a_sharded_full_model_save_opening_only_the_vision_shards(model, tmp_path: Path, monkeypatch):
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    vision_shards = {shard for key, shard in weight_map.items() if key.startswith("vit.")}
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
    """A full checkpoint whose keys are the model's own state_dict (`model.vision_tower.`, ...)."""
    model.config.save_pretrained(tmp_path)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    assert any(key.startswith("model.vision_tower.patch_merger.before_rms.") for key in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_loaded(model, load(tmp_path), 24)


def test_loads_a_tower_only_save(model, tmp_path: Path):
    model.model.vision_tower.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "hy_v4_vl_vision" and raw["out_hidden_size"] == TEXT_WIDTH
    assert_loaded(model, load(tmp_path), 26)


def test_a_missing_or_unexpected_key_is_named(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    (tmp_path / "model.safetensors.index.json").unlink(missing_ok=True)
    del state["vit.perceive.image_newline"]
    state["vit.perceive.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"patch_merger\.image_newline.*patch_merger\.extra\.weight"):
        load(tmp_path)


# vitpool.items_from on the real processors (PIL images; video frames as arrays), built offline


def random_pictures(sizes: list[tuple[int, int]], seed: int = 0) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


# wide, tall, tiny (resized up), square, very wide (wider than the position table: stretched)
SIZES = [(10, 16), (30, 12), (3, 3), (24, 24), (5, 60)]


def test_items_from_gives_each_images_processor_output_and_encodes_as_the_model(model, encoder):
    pytest.importorskip("PIL.Image")
    from transformers import HYV4VLImageProcessorPil

    image_processor = HYV4VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, min_pixels=8 * 8, max_pixels=24 * 24
    )
    pictures = random_pictures(SIZES)
    batch = image_processor(images=pictures, return_tensors="pt")
    grids = batch["image_grid_thw"].tolist()
    assert len({tuple(grid) for grid in grids}) == len(SIZES) and max(w for _, _, w in grids) > EDGE
    items = vitpool.items_from(batch, family="hy_v4_vl")
    assert len(items) == len(pictures)
    for position, (got, picture) in enumerate(zip(items, pictures, strict=True)):
        alone = image_processor(images=[picture], return_tensors="pt")
        assert torch.equal(got.pixel_values, alone["pixel_values"]), position
        assert list(got.grid_thw) == alone["image_grid_thw"][0].tolist(), position
    with torch.no_grad():
        wanted = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    for position, (embedding, want) in enumerate(zip(encoder.encode(items), wanted, strict=True)):
        assert embedding.tokens.shape == want.shape and relative_error(embedding.tokens, want) <= TOLERANCE, (
            position
        )


def test_items_from_cuts_the_video_processors_output(model, encoder):
    pytest.importorskip("torchvision")
    from transformers import HYV4VLVideoProcessor

    video_processor = HYV4VLVideoProcessor(
        patch_size=PATCH,
        merge_size=MERGE,
        size={"longest_edge": 4 * 24 * 24},
        max_image_size={"longest_edge": 24 * 24},
    )
    rng = np.random.default_rng(1)
    clips = [
        rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8) for frames, h, w in [(2, 12, 20), (3, 16, 8)]
    ]
    batch = video_processor(videos=clips, return_tensors="pt")
    items = vitpool.items_from(batch, family="hy_v4_vl")
    assert [type(one) for one in items] == [Video, Video]
    assert [list(one.grid_thw) for one in items] == batch["video_grid_thw"].tolist()
    with torch.no_grad():
        wanted = model.model.get_video_features(
            batch["pixel_values_videos"], batch["video_grid_thw"]
        ).pooler_output
    for embedding, want in zip(encoder.encode(items), wanted, strict=True):
        assert embedding.tokens.shape == want.shape and relative_error(embedding.tokens, want) <= TOLERANCE


def test_items_from_refuses_what_does_not_add_up():
    with pytest.raises(ValueError, match="image_grid_thw"):
        vitpool.items_from({"pixel_values": torch.zeros(16, ROW_WIDTH)}, family="hy_v4_vl")
    with pytest.raises(ValueError, match="accounts? for 24"):
        vitpool.items_from(
            {"pixel_values": torch.zeros(16, ROW_WIDTH), "image_grid_thw": torch.tensor([[1, 4, 6]])},
            family="hy_v4_vl",
        )


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
        wanted = [model.model.get_image_features(*call).pooler_output for call in calls]
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


def test_items_from_cuts_a_batch_of_videos_in_the_processors_keys(model, encoder):
    """Without torchvision (the video processor's backend): a batch in its keys and layout."""
    clips = [item(2, 4, 6, 50), item(3, 2, 4, 51)]
    batch = {
        "pixel_values_videos": torch.cat([one.pixel_values for one in clips]),
        "video_grid_thw": torch.tensor([one.grid_thw for one in clips]),
    }
    items = vitpool.items_from(batch, family="hy_v4_vl")
    assert [type(one) for one in items] == [Video, Video]
    for got, want in zip(items, clips, strict=True):
        assert torch.equal(got.pixel_values, want.pixel_values) and list(got.grid_thw) == list(want.grid_thw)
    with torch.no_grad():
        wanted = model.model.get_video_features(*batch.values()).pooler_output
    for embedding, want in zip(encoder.encode(items), wanted, strict=True):
        assert relative_error(embedding.tokens, want) <= TOLERANCE
