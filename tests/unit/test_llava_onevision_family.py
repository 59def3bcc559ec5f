"""LLaVA-OneVision's own checks (the shared ones: test_adapter_conformance.py): tiles and sizes in,
what the LLM receives out, as Hugging Face's `get_image_features` / `get_video_features` hand it
over, for one image, images of several sizes (pooled or not, a base tile alone) and videos in one
call and in one padded Hugging Face batch, padded budgets; the packing's geometry at the flagship's
real sizes against Hugging Face's processor (token counts) and `pack_image_features` (the gather);
loading from full checkpoints (whole, sharded, the releases' layout) and tower-only saves; malformed
items; the real image processor's output cut by `vitpool.items_from`; the `get_image_features`
stand-in. CPU, fp32, tiny random models."""

from __future__ import annotations

import functools
import json
import math
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import llava_onevision as case
from safetensors.torch import save_file

import vitpool
from vitpool import CheckpointError, ConfigError, GraphEncoder, Image, InvalidItemError, Video
from vitpool.families.llava_onevision import RECORD
from vitpool.families.llava_onevision import adapter as onevision_adapter
from vitpool.families.llava_onevision.features import LlavaOnevisionFeatures
from vitpool.families.llava_onevision.processor import items as cut_items
from vitpool.families.llava_onevision.rules import LlavaOnevisionRules
from vitpool.families.llava_onevision.taps import NEWLINE, bilinear_taps, item_taps

TOLERANCE = 1e-4
BUDGETS = list(case.BUDGETS)
# (height, width) of images of every kind the tiny pinpoints give: 2 x 2 crops pooled (13 x 14),
# 1 x 3 unpadded to 2 rows (5 x 30), 3 x 1 unpadded to 2 columns (30 x 5), 1 x 1 (3 x 3), 3 x 2 pooled
# after unpadding (23 x 9), 1 x 3 unpadded to no row at all (1 x 24)
SIZES = ((13, 14), (5, 30), (30, 5), (3, 3), (23, 9), (1, 24))
# the releases' pinpoints (LlavaOnevisionConfig's and the image processor's defaults)
FLAGSHIP_PINPOINTS = tuple((384 * h, 384 * w) for h in range(1, 7) for w in range(1, 7))


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model):
    return case.encoder_of(model, BUDGETS)


def tiles_of(size: tuple[int, int], seed: int, alone: bool = False) -> Image:
    """An image of this size: random pixels for its base tile and crops (its base tile alone)."""
    rules = LlavaOnevisionRules(3, case.TILE, 2, tuple(map(tuple, case.PINPOINTS)), 2, 1)
    count = 1 if alone else rules.packed_grid(*size).num_crops + 1
    return Image(torch.randn(count, *case.ROW_SHAPE, generator=torch.Generator().manual_seed(seed)), size)


def frames(count: int, seed: int) -> Video:
    return Video(torch.randn(count, *case.ROW_SHAPE, generator=torch.Generator().manual_seed(seed)))


def assert_matches(model, items, embeddings) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings, strict=True):
        expected = case.features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def test_one_image_gives_hugging_faces_tokens(model, encoder):
    item = tiles_of((13, 14), 0)  # 2 x 2 crops: 16 + 5 pooled rows of 5 and a newline
    [embedding] = encoder.encode([item])
    assert embedding.tokens.shape == (16 + 5 * 6, case.TINY_TEXT["hidden_size"])
    assert_matches(model, [item], [embedding])


def test_images_of_several_sizes_and_videos_in_one_call(model, encoder):
    items = [tiles_of(size, 10 + seed) for seed, size in enumerate(SIZES)]
    items += [tiles_of((9, 30), 20, alone=True), frames(3, 21), frames(1, 22)]
    embeddings = encoder.encode(items)
    assert [e.tokens.shape[0] for e in embeddings] == [46, 42, 52, 36, 52, 16, 17, 13, 5]
    assert_matches(model, items, embeddings)


def test_a_padded_hugging_face_batch_gives_each_images_tokens(model, encoder):
    """Hugging Face's batch form: [images, most tiles, 3, S, S], zero tiles after each image's own,
    and a sample of two images whose second and third run their base tiles alone."""
    images = [tiles_of((13, 14), 30), tiles_of((5, 30), 31, alone=True), tiles_of((23, 9), 32, alone=True)]
    pixel_values = torch.zeros(3, 7, *case.ROW_SHAPE)
    for index, item in enumerate(images):
        pixel_values[index, : len(item.pixel_values)] = item.pixel_values
    with torch.no_grad():
        want = model.model.get_image_features(
            pixel_values=pixel_values,
            image_sizes=torch.tensor([item.grid_thw for item in images]),
            batch_num_images=torch.tensor([1, 2]),
        ).pooler_output
    for got, wanted in zip(encoder.encode(images), want, strict=True):
        assert got.tokens.shape == wanted.shape
        assert relative_error(got.tokens, wanted) <= TOLERANCE


def test_padding_tiles_and_tokens_of_a_larger_budget_change_nothing(model):
    """One budget of 10 tiles: a 2-tile image runs with 8 padding tiles and its padding tokens
    after and before a 10-tile image filled the same buffers (stale rows must not leak)."""
    budget = 10 * case.TOKENS_PER_TILE
    encoder = case.encoder_of(model, [budget])
    small, large = tiles_of((3, 3), 40), tiles_of((20, 20), 41)
    assert (len(small.pixel_values), len(large.pixel_values)) == (2, 10)
    first = encoder.encode([small])
    assert_matches(model, [large, small], encoder.encode([large]) + encoder.encode([small]))
    assert torch.equal(encoder.encode([small])[0].tokens, first[0].tokens)
    assert encoder.stats().replays_per_budget[budget] == 4


def test_budgets_bound_their_tiles_and_default_to_whole_tiles(encoder):
    """Tokens do not bound tiles here (an unpadded or pooled image gives fewer tokens than its tiles
    could): each budget bounds its tiles by what its buffers hold, and the user's bound lowers it."""
    assert [dict(budget.limits)["sequences"] for budget in encoder.budgets] == [2, 5, 10]
    bounded = GraphEncoder(
        encoder.adapter, budgets=BUDGETS, device="cpu", dtype=torch.float32, max_frames_per_batch=4
    )
    assert [dict(budget.limits)["sequences"] for budget in bounded.budgets] == [2, 4, 4]
    default = GraphEncoder(encoder.adapter, device="cpu", dtype=torch.float32)
    tokens = [budget.num_tokens for budget in default.budgets]
    assert tokens[0] == case.TOKENS_PER_TILE and tokens[-1] == case.MAX_ITEM_TILES * case.TOKENS_PER_TILE
    assert all(value % case.TOKENS_PER_TILE == 0 for value in tokens)


def test_an_image_of_few_tokens_and_many_tiles_runs_in_a_budget_of_its_tiles(model, encoder):
    """A 1 x 24 image keeps no crop row: 16 tokens from 4 tiles, more tiles than the smallest
    budget (2 tiles, 38 tokens) holds, so it runs in the next (5 tiles)."""
    item = tiles_of((1, 24), 45)
    before = dict(encoder.stats().replays_per_budget)
    assert_matches(model, [item], encoder.encode([item]))
    after = encoder.stats().replays_per_budget
    assert after.get(BUDGETS[1], 0) == before.get(BUDGETS[1], 0) + 1
    assert after.get(BUDGETS[0], 0) == before.get(BUDGETS[0], 0)


def test_several_feature_layers_side_by_side():
    """vision_feature_layer as a list: those hidden states concatenated, the projector twice as wide."""
    model = case.hf_model(seed=5, vision_feature_layer=[-2, -1])
    encoder = case.encoder_of(model, BUDGETS)
    items = [tiles_of((13, 14), 50), frames(2, 51)]
    assert_matches(model, items, encoder.encode(items))


def test_the_default_feature_selection_is_refused():
    module = onevision_adapter.build_encoder(case.full_config(vision_feature_select_strategy="default"))
    with pytest.raises(ConfigError, match="vision_feature_select_strategy='full'"):
        onevision_adapter.LlavaOnevisionAdapter(module)


# ---- the packing at the flagship's sizes -----------------------------------------------------


def flagship_rules() -> LlavaOnevisionRules:
    return LlavaOnevisionRules(3, 384, 14, FLAGSHIP_PINPOINTS, 9, 4)


def random_sizes(count: int, seed: int) -> list[tuple[int, int]]:
    """Image sizes from a few pixels to 3000, of every aspect ratio (log-uniform sides)."""
    rng = random.Random(seed)
    return [
        tuple(max(1, int(math.exp(rng.uniform(0, math.log(3000))))) for _ in range(2)) for _ in range(count)
    ]


def test_token_counts_are_the_processors_placeholders_at_the_flagships_sizes():
    """LlavaOnevisionProcessor's count of an image's placeholder tokens, for the releases'
    pinpoints, 384-pixel tiles of 14-pixel patches and anyres_max_9."""
    from transformers import LlavaOnevisionProcessor

    processor = SimpleNamespace(
        image_processor=SimpleNamespace(image_grid_pinpoints=[list(pin) for pin in FLAGSHIP_PINPOINTS]),
        num_image_tokens=729,
        vision_aspect_ratio="anyres_max_9",
    )
    processor._get_unpadded_features = functools.partial(
        LlavaOnevisionProcessor._get_unpadded_features, processor
    )
    rules = flagship_rules()
    sizes = [*random_sizes(400, 0), (384, 384), (1080, 1920), (2160, 3840), (20, 2000), (3000, 3000)]
    counts = {size: rules.image_tokens(rules.packed_grid(*size).num_crops + 1, size) for size in sizes}
    want = {
        size: LlavaOnevisionProcessor._get_number_of_features(processor, *size, 384, 384) for size in sizes
    }
    assert counts == want
    assert any(rules.packed_grid(*size).is_pooled for size in sizes)
    assert any(
        not rules.packed_grid(*size).is_pooled and rules.packed_grid(*size).num_crops > 1 for size in sizes
    )
    assert (
        rules.tokens_per_tile == 753 and rules.max_item_tiles == 37
    )  # a 6 x 1 grid: (729 + 162 * 28) / 7, up


def test_the_gather_is_hugging_faces_packing_at_the_flagships_sizes():
    """`pack_image_features` and `apply_pooling` of random projected features (a 4-wide stand-in
    for the LLM's width) against the taps' gather, for images of many sizes and a video."""
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    rules = flagship_rules()
    hf = SimpleNamespace(
        config=SimpleNamespace(
            vision_config=SimpleNamespace(image_size=384, patch_size=14),
            image_grid_pinpoints=[list(pin) for pin in FLAGSHIP_PINPOINTS],
        )
    )
    generator = torch.Generator().manual_seed(0)
    newline = torch.randn(4, generator=generator)
    for size in [*random_sizes(12, 1), (1080, 1920), (20, 2000)]:
        tiles = rules.packed_grid(*size).num_crops + 1
        features = torch.randn(tiles, 729, 4, generator=generator)
        [want], _ = LlavaOnevisionModel.pack_image_features(
            hf, [features], torch.tensor([size]), image_newline=newline, vision_aspect_ratio="anyres_max_9"
        )
        assert relative_error(gathered(rules, "image", features, newline, size), want) <= 1e-5, size
    features = torch.randn(3, 729, 4, generator=generator)
    want = torch.cat([LlavaOnevisionModel.apply_pooling(hf, features).reshape(-1, 4), newline[None]])
    assert relative_error(gathered(rules, "video", features, newline, ()), want) <= 1e-5


def gathered(rules, modality, features, newline, layout) -> torch.Tensor:
    """An item's tokens as the graph gathers them from its tiles' features [tiles, side², width],
    after checking that they are as many as its rules count."""
    tiles = features.shape[0]
    taps, weights = item_taps(rules, modality, tiles, layout)
    table = torch.cat([features.reshape(-1, features.shape[-1]), newline[None]])
    taps = torch.where(taps == NEWLINE, table.shape[0] - 1, taps)
    counted = rules.video_tokens(tiles) if modality == "video" else rules.image_tokens(tiles, layout)
    assert taps.shape[0] == counted
    return (table[taps] * weights[..., None]).sum(1)


# a video frame's pooling at the flagship's size, a large image's, a tiny one's
@pytest.mark.parametrize(
    ("rows", "cols", "out_rows", "out_cols"), [(27, 27, 14, 14), (81, 142, 63, 111), (5, 3, 4, 2)]
)
def test_bilinear_taps_are_pytorchs_interpolation(rows, cols, out_rows, out_cols):
    grid = torch.randn(1, 3, rows, cols, generator=torch.Generator().manual_seed(rows))
    want = torch.nn.functional.interpolate(grid, [out_rows, out_cols], mode="bilinear")[0].flatten(1).T
    source_rows, source_cols, weights = bilinear_taps(rows, cols, out_rows, out_cols)
    got = (grid[0].flatten(1).T[source_rows * cols + source_cols] * weights[..., None]).sum(1)
    assert relative_error(got, want) <= 1e-6


# ---- loading ---------------------------------------------------------------------------------


def test_siglips_own_type_stays_gemma_3s():
    from vitpool.models.registry import FAMILIES, record_of

    assert record_of("siglip_vision_model").name == "gemma3"
    assert FAMILIES["siglip_vision_model"] is record_of("gemma3").towers["siglip_vision_model"]
    assert record_of(onevision_adapter.TOWER_MODEL_TYPE) is RECORD and record_of("llava_onevision") is RECORD
    from vitpool.models.registry import tower_family  # a full checkpoint's SigLIP tower: its own family's

    assert tower_family("llava_onevision", "siglip_vision_model") is RECORD.towers["siglip_vision_model"]
    assert tower_family("gemma3", "siglip_vision_model") is record_of("gemma3").towers["siglip_vision_model"]


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(model, tmp_path, max_shard_size):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        text = ("language_model", "lm_head")
        vision_shards = {shard for key, shard in weight_map.items() if not key.startswith(text)}
        assert len(vision_shards) > 2  # the vision weights span several shards
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [tiles_of((13, 14), 60), tiles_of((5, 30), 61, alone=True), frames(2, 62)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_the_releases_layout(model, tmp_path):
    """The releases keep SigLIP's inner level: `vision_tower.vision_model.*`, beside
    `multi_modal_projector.*`, `image_newline` and the language model's tensors, which stay unread."""
    state = {
        f"{prefix}{key}": value
        for prefix, module in (
            ("vision_tower.vision_model.", model.model.vision_tower),
            ("multi_modal_projector.", model.model.multi_modal_projector),
        )
        for key, value in module.state_dict().items()
    }
    state["image_newline"] = model.model.image_newline.detach()
    state["language_model.model.embed_tokens.weight"] = torch.zeros(case.TINY_TEXT["vocab_size"], 48)
    save_file({key: value.contiguous() for key, value in state.items()}, str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(tmp_path)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [tiles_of((30, 5), 63)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_a_tower_only_save_and_refuses_missing_weights(model, encoder, tmp_path):
    config = onevision_adapter.tower_only_config(model.config)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llava_onevision_vision"
    state = {key: value.contiguous() for key, value in encoder.adapter.tower.state_dict().items()}
    assert "image_newline" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [tiles_of((23, 9), 64), frames(1, 65)]
    assert_matches(model, items, loaded.encode(items))
    del state["image_newline"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys.*image_newline"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


def test_a_vision_config_without_the_projectors_fields_or_of_another_model_is_refused(model):
    with pytest.raises(ValueError, match="text_hidden_size"):
        onevision_adapter.build_encoder(model.config.vision_config)
    other = case.full_config()
    other.model_type = "llava_next"
    with pytest.raises(CheckpointError, match="'llava_next' checkpoint"):
        onevision_adapter.tower_only_config(other)


# ---- items -----------------------------------------------------------------------------------


def test_a_malformed_item_is_named_and_the_others_still_encode(model, encoder):
    good = tiles_of((3, 3), 70)
    bad_items = (
        # the batch's padded tile count, not the image's own
        (Image(torch.randn(7, *case.ROW_SHAPE), (3, 3)), "1 x 1 crops and a base tile, 2 tiles"),
        (Image(torch.randn(2, *case.ROW_SHAPE)), "original size (H, W)"),
        (Image(torch.randn(2, *case.ROW_SHAPE), (0, 3)), "zero or negative side"),
        (Image(torch.randn(2, *case.ROW_SHAPE), (1, 3, 3)), "original size (H, W)"),
        (Image(torch.randn(2, 3, case.TILE + 2, case.TILE + 2), (3, 3)), "must be tiles"),
        (Video(torch.randn(2, *case.ROW_SHAPE), (2, 4, 4)), "a video is its frames alone"),
    )
    for bad, words in bad_items:
        with pytest.raises(InvalidItemError) as raised:
            encoder.encode([good, bad])
        assert raised.value.index == 1 and words in str(raised.value)
    assert_matches(model, [good], encoder.encode([good]))


def image_processor():
    from transformers import LlavaOnevisionImageProcessorPil

    # the releases' settings (SigLIP's mean and std) at the tiny tower's tile and pinpoints
    return LlavaOnevisionImageProcessorPil(
        size={"height": case.TILE, "width": case.TILE},
        image_grid_pinpoints=case.PINPOINTS,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )


def random_images(sizes, seed: int = 0) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def test_items_from_the_processor_are_the_images_alone_and_encode_as_hugging_face(model, encoder):
    pytest.importorskip("PIL")
    processor = image_processor()
    images = random_images(SIZES, seed=1)
    batch = processor(images=images, return_tensors="pt")
    items = vitpool.items_from(batch, family="llava_onevision")
    assert [type(item) for item in items] == [Image] * len(images)
    for item, image, size in zip(items, images, SIZES, strict=True):  # each as the processor makes it alone
        alone = processor(images=[image], return_tensors="pt")
        assert torch.equal(torch.as_tensor(item.pixel_values), alone["pixel_values"][0])
        assert tuple(item.grid_thw) == size == tuple(alone["image_sizes"][0].tolist())
    embeddings = encoder.encode(items)
    with torch.no_grad():
        want = model.model.get_image_features(**batch).pooler_output
    for embedding, wanted in zip(embeddings, want, strict=True):
        assert relative_error(embedding.tokens, wanted) <= TOLERANCE


def test_items_from_a_multi_image_sample_are_base_tiles_and_encode_as_hugging_face(model, encoder):
    """A nested list: one sample of one image (its crops) and one of three (each its base tile)."""
    pytest.importorskip("PIL")
    images = random_images(SIZES[:4], seed=2)
    batch = image_processor()(images=[images[:1], images[1:]], return_tensors="np")
    items = vitpool.items_from(batch, family="llava_onevision")
    assert [len(item.pixel_values) for item in items] == [5, 1, 1, 1]
    with torch.no_grad():
        want = model.model.get_image_features(
            **{key: torch.as_tensor(value) for key, value in batch.items()}
        ).pooler_output
    embeddings = encoder.encode([Image(torch.as_tensor(item.pixel_values), item.grid_thw) for item in items])
    for embedding, wanted in zip(embeddings, want, strict=True):
        assert relative_error(embedding.tokens, wanted) <= TOLERANCE


def test_a_llava_onevision_batch_is_told_from_mistral_3s_by_its_wider_keys():
    """Its keys hold Mistral 3's (pixel_values, image_sizes), whose cutter differs: the batch's
    batch_num_images makes it this family's (a Mistral 3 batch, without it, is not this one's)."""
    batch = _batch()
    assert len(vitpool.items_from(batch)) == len(vitpool.items_from(batch, family="llava_onevision")) == 3
    without = {key: value for key, value in batch.items() if key != "batch_num_images"}
    with pytest.raises(ValueError):  # Mistral 3's cutter refuses its padded, many-tile layout
        vitpool.items_from(without, family="mistral3")
    # without family= it is LLaVA-NeXT's layout (pixel_values [images, tiles, ...], image_sizes)
    assert len(vitpool.items_from(without)) == 3


def _batch(**changes):
    """A hand-made batch: a 2-crop image (3 tiles) alone, then a sample of two base tiles; padded
    to 3 tiles; and two videos of two frames."""
    pixels = torch.zeros(3, 3, *case.ROW_SHAPE)
    pixels[0] = torch.rand(3, *case.ROW_SHAPE) + 0.1
    pixels[1:, 0] = torch.rand(2, *case.ROW_SHAPE) + 0.1
    batch = {
        "pixel_values": pixels,
        "image_sizes": torch.tensor([[5, 14], [9, 9], [3, 30]]),
        "batch_num_images": torch.tensor([1, 2]),
    }
    batch.update(changes)
    return {key: value for key, value in batch.items() if value is not None}


def test_the_cutter_cuts_each_image_before_its_padding_and_each_video():
    videos = torch.rand(2, 2, *case.ROW_SHAPE) + 0.1
    cut = cut_items(_batch(pixel_values_videos=videos))
    assert [(item.modality, len(item.pixel_values), item.grid) for item in cut] == [
        ("image", 3, (5, 14)),
        ("image", 1, (9, 9)),
        ("image", 1, (3, 30)),
        ("video", 2, None),
        ("video", 2, None),
    ]
    assert torch.equal(cut[4].pixel_values, videos[1])
    items = vitpool.items_from(_batch(pixel_values_videos=videos), family="llava_onevision")
    assert [type(item) for item in items] == [Image] * 3 + [Video] * 2


def _with_tile(image: int, tile: int, value: float) -> torch.Tensor:
    pixels = _batch()["pixel_values"].clone()
    pixels[image, tile] = value
    return pixels


# (changes to the batch, words of the ValueError)
BAD_BATCHES = [
    ({"image_sizes": None}, "no image_sizes"),
    ({"batch_num_images": None}, "no batch_num_images"),
    ({"pixel_values": torch.rand(3, *case.ROW_SHAPE)}, "[images, tiles, channels, height, width]"),
    ({"image_sizes": torch.tensor([[5, 14], [9, 9]])}, "image_sizes has 2 rows"),
    ({"batch_num_images": torch.tensor([1, 1])}, "counts 2"),
    ({"image_sizes": torch.tensor([[5, 14], [9, 0], [3, 30]])}, "image_sizes row 1 is [9, 0]"),
    # a real tile after the padding
    ({"pixel_values": _with_tile(1, 2, 0.5)}, "image 1: its tiles are ['real', 'zero', 'real']"),
    # an image of a sample of several with crops
    ({"batch_num_images": torch.tensor([2, 1])}, "image 0 is one of a sample of several"),
    ({"pixel_values_videos": torch.zeros(1, 2, *case.ROW_SHAPE)}, "video 0: frames [0, 1] are all zeros"),
    ({"pixel_values_videos": torch.rand(2, *case.ROW_SHAPE)}, "[videos, frames, channels, height, width]"),
]


@pytest.mark.parametrize(("change", "message"), BAD_BATCHES)
def test_what_does_not_add_up_is_named(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        vitpool.items_from(_batch(**change), family="llava_onevision")


def test_videos_of_the_real_video_processor_encode_as_hugging_face(model, encoder):
    pytest.importorskip("torchvision")
    from transformers import LlavaOnevisionVideoProcessor

    processor = LlavaOnevisionVideoProcessor(size={"height": case.TILE, "width": case.TILE})
    clip = np.random.default_rng(3).integers(0, 256, (4, 20, 30, 3), dtype=np.uint8)
    batch = processor(videos=[clip], return_tensors="pt")
    [item] = vitpool.items_from(batch, family="llava_onevision")
    assert_matches(model, [item], encoder.encode([item]))


# ---- the transformers drop-in's stand-in -----------------------------------------------------


def test_the_stand_in_answers_get_image_features_as_the_model(model, encoder):
    """`get_image_features` of a padded batch with a sample of two (base tiles alone), and of the
    same tiles stacked [tiles, 3, S, S]; the tower itself (what get_video_features calls) refuses."""
    stand_in = LlavaOnevisionFeatures(encoder, torch.float32, torch.device("cpu"), model.config)
    images = [tiles_of((23, 9), 80), tiles_of((13, 14), 81, alone=True), tiles_of((3, 3), 82, alone=True)]
    padded = torch.zeros(3, 7, *case.ROW_SHAPE)
    for index, item in enumerate(images):
        padded[index, : len(item.pixel_values)] = item.pixel_values
    stacked = torch.cat([item.pixel_values for item in images])
    arguments = {
        "image_sizes": torch.tensor([item.grid_thw for item in images]),
        "batch_num_images": torch.tensor([1, 2]),
    }
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=padded, **arguments).pooler_output
    for pixel_values in (padded, stacked):
        got = stand_in.get_image_features(pixel_values=pixel_values, **arguments).pooler_output
        for got_image, wanted in zip(got, want, strict=True):
            assert relative_error(got_image, wanted) <= TOLERANCE
    with pytest.raises(ConfigError, match="vision_aspect_ratio='anyres_max_2'"):
        stand_in.get_image_features(pixel_values=padded, vision_aspect_ratio="anyres_max_9", **arguments)
    with pytest.raises(ConfigError, match="get_image_features only"):
        stand_in(torch.zeros(2, *case.ROW_SHAPE))
