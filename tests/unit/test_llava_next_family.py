"""LLaVA-NeXT's own checks (the shared ones: test_adapter_conformance.py): tiles and sizes in, what
the LLM receives out, as Hugging Face's `get_image_features` hands it over, for one image, images of
several sizes in one call and in one padded Hugging Face batch, padded budgets; the packing's
geometry at the flagship's real sizes against Hugging Face's processor (token counts) and
`pack_image_features` (the gather); the registry's choice between this family and LLaVA 1.5 (both
on CLIP's type); loading from full checkpoints (whole, sharded, the releases' layout) and tower-only
saves; malformed items; the real image processor's output cut by `vitpool.items_from`, and Mistral
3's batches (the same keys) still cut as Mistral 3's; the `get_image_features` stand-in and the
drop-in through the model's forward. CPU, fp32, tiny random models."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import llava_next as case
from safetensors.torch import save_file

import vitpool
from vitpool import CheckpointError, ConfigError, GraphEncoder, Image, InvalidItemError
from vitpool.families.llava_next import RECORD
from vitpool.families.llava_next import adapter as next_adapter
from vitpool.families.llava_next.features import LlavaNextFeatures
from vitpool.families.llava_next.processor import tiles as cut_tiles
from vitpool.families.llava_next.rules import LlavaNextRules

TOLERANCE = 1e-4
BUDGETS = list(case.BUDGETS)
RULES = LlavaNextRules.of(3, case.TILE, case.PATCH, tuple(map(tuple, case.PINPOINTS)), 1)
# (height, width) of images of every kind the tiny pinpoints give: 2 x 2 crops unpadded to 7 rows
# (10 x 14), 1 x 3 unpadded to 2 rows (5 x 30), 3 x 1 unpadded to 2 columns (30 x 5), 1 x 2 (3 x 3),
# 3 x 1 unpadded to 6 columns (23 x 9), 1 x 3 unpadded to no row at all (1 x 24)
SIZES = ((10, 14), (5, 30), (30, 5), (3, 3), (23, 9), (1, 24))
# llava-v1.6-mistral-7b-hf: 336-pixel tiles of 14-pixel patches, LlavaNextConfig's default pinpoints
FLAGSHIP_TILE, FLAGSHIP_PATCH = 336, 14
FLAGSHIP_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model):
    return case.encoder_of(model, BUDGETS)


def tiles_of(size: tuple[int, int], seed: int) -> Image:
    """An image of this size: random pixels for its base tile and crops."""
    count = RULES.packed_grid(*size).num_crops + 1
    return Image(torch.randn(count, *case.ROW_SHAPE, generator=torch.Generator().manual_seed(seed)), size)


def assert_matches(model, items, embeddings) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings, strict=True):
        expected = case.features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def padded(images: list[Image], most_tiles: int) -> torch.Tensor:
    """Hugging Face's batch form: [images, most tiles, 3, S, S], zero tiles after each image's own."""
    pixel_values = torch.zeros(len(images), most_tiles, *case.ROW_SHAPE)
    for index, item in enumerate(images):
        pixel_values[index, : len(item.pixel_values)] = item.pixel_values
    return pixel_values


def test_one_image_gives_hugging_faces_tokens(model, encoder):
    # 2 x 2 crops, 8 x 8 features, of which the letterbox's first and last rows are dropped: 16 base
    # tokens, then 6 rows of 8 and a newline
    item = tiles_of((10, 14), 0)
    [embedding] = encoder.encode([item])
    assert embedding.tokens.shape == (case.SIDE**2 + 6 * (8 + 1), case.TINY_TEXT["hidden_size"])
    newlines = embedding.tokens[case.SIDE**2 + 8 :: 9]  # each kept row's last token
    assert torch.equal(newlines, model.model.image_newline.expand(6, -1))
    assert_matches(model, [item], [embedding])


def test_images_of_several_sizes_in_one_call_and_one_padded_hugging_face_batch(model, encoder):
    items = [tiles_of(size, 10 + seed) for seed, size in enumerate(SIZES)]
    embeddings = encoder.encode(items)
    assert_matches(model, items, embeddings)
    with torch.no_grad():
        want = model.model.get_image_features(
            pixel_values=padded(items, case.MAX_ITEM_TILES),
            image_sizes=torch.tensor([list(s) for s in SIZES]),
        ).pooler_output
    for got, wanted in zip(embeddings, want, strict=True):
        assert got.tokens.shape == wanted.shape and relative_error(got.tokens, wanted) <= TOLERANCE


def test_padding_tiles_and_tokens_of_a_larger_budget_change_nothing(model):
    """One budget of 10 tiles: a 3-tile image runs with 7 padding tiles and its padding tokens
    after and before two 5-tile images filled the same buffers (stale rows must not leak)."""
    budget = 10 * case.TOKENS_PER_TILE
    encoder = case.encoder_of(model, [budget])
    small, large = tiles_of((3, 3), 40), [tiles_of((20, 20), 41), tiles_of((13, 14), 42)]
    assert [len(item.pixel_values) for item in (small, *large)] == [3, 5, 5]
    first = encoder.encode([small])
    assert_matches(model, [*large, small], encoder.encode(large) + encoder.encode([small]))
    assert torch.equal(encoder.encode([small])[0].tokens, first[0].tokens)
    assert encoder.stats().replays_per_budget[budget] == 4


def test_budgets_bound_their_tiles_and_default_to_whole_tiles_from_the_smallest_image(encoder):
    assert [dict(budget.limits)["sequences"] for budget in encoder.budgets] == [3, 5, 10]
    default = GraphEncoder(encoder.adapter, device="cpu", dtype=torch.float32)
    tokens = [budget.num_tokens for budget in default.budgets]
    assert tokens[0] == case.MIN_ITEM_TILES * case.TOKENS_PER_TILE
    assert tokens[-1] == case.MAX_ITEM_TILES * case.TOKENS_PER_TILE
    assert all(value % case.TOKENS_PER_TILE == 0 for value in tokens)
    specs = encoder.adapter.sample_specs(3, encoder.budgets[0], random.Random(0))
    assert specs and all(spec.num_rows <= 3 for spec in specs)


def test_several_feature_layers_side_by_side_and_the_last_layer_cut():
    model = case.hf_model(seed=5, vision_feature_layer=[0, -2])
    encoder = case.encoder_of(model, BUDGETS)
    assert encoder.adapter.feature_layers == (0, 2)
    items = [tiles_of((23, 9), 50), tiles_of((3, 3), 51)]
    assert_matches(model, items, encoder.encode(items))


def test_the_full_feature_selection_is_refused_as_hugging_face_fails_on_it():
    model = case.hf_model(seed=6, vision_feature_select_strategy="full")
    item = tiles_of((13, 14), 52)
    with pytest.raises(RuntimeError):  # each tile's class token: the crops' features are no grid
        case.features(model, item)
    with pytest.raises(ConfigError, match="vision_feature_select_strategy='default'"):
        case.encoder_of(model, BUDGETS)


# ---- the packing's geometry at the flagship's sizes ------------------------------------------

# a tile, wide and tall images, thin ones (of each 1 x 3 grid), a 1080p frame, a sliver, a large one
FLAGSHIP_SIZES = ((336, 336), (480, 640), (640, 480), (1000, 300), (300, 1000), (1080, 1920))
FLAGSHIP_SIZES += ((17, 1500), (2000, 2000))
FLAGSHIP_RULES = LlavaNextRules.of(3, FLAGSHIP_TILE, FLAGSHIP_PATCH, FLAGSHIP_PINPOINTS, 1)


def test_token_counts_are_the_processors_placeholders_at_the_flagships_sizes():
    from transformers import LlavaNextProcessor

    processor = SimpleNamespace(
        image_processor=SimpleNamespace(image_grid_pinpoints=[list(pin) for pin in FLAGSHIP_PINPOINTS]),
        patch_size=FLAGSHIP_PATCH,
        num_additional_image_tokens=1,  # the class token, which "default" then drops
    )
    processor._get_unpadded_features = lambda *args: LlavaNextProcessor._get_unpadded_features(
        processor, *args
    )
    for size in FLAGSHIP_SIZES:
        tiles = FLAGSHIP_RULES.packed_grid(*size).num_crops + 1
        spec = FLAGSHIP_RULES.item_spec("image", (tiles, 3, FLAGSHIP_TILE, FLAGSHIP_TILE), "float32", size)
        tile = (FLAGSHIP_TILE, FLAGSHIP_TILE)
        assert spec.num_tokens == LlavaNextProcessor._get_number_of_features(processor, *size, *tile) - 1


def test_the_gather_is_hugging_faces_packing_at_the_flagships_sizes(model):
    """Each feature a distinct value: the gathered rows are `pack_image_features`'s, token for token."""
    from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

    rules = FLAGSHIP_RULES
    side = FLAGSHIP_TILE // FLAGSHIP_PATCH
    adapter = SimpleNamespace(item_rules=rules)
    hf = SimpleNamespace(
        config=SimpleNamespace(
            vision_config=SimpleNamespace(image_size=FLAGSHIP_TILE, patch_size=FLAGSHIP_PATCH),
            image_grid_pinpoints=[list(pin) for pin in FLAGSHIP_PINPOINTS],
        )
    )
    for size in FLAGSHIP_SIZES:
        tiles = rules.packed_grid(*size).num_crops + 1
        features = torch.arange(tiles * side**2, dtype=torch.float64)[:, None].reshape(tiles, side**2, 1)
        newline = torch.tensor([-1.0], dtype=torch.float64)
        [packed], _ = LlavaNextModel.pack_image_features(
            hf, [features], torch.tensor([size]), "default", newline
        )
        rows = next_adapter.LlavaNextAdapter._item_gather(adapter, tiles, size)
        table = torch.cat([features.reshape(-1), newline])
        assert torch.equal(table[rows], packed[:, 0]), size


# ---- the registry and checkpoints ------------------------------------------------------------


def test_clips_own_type_stays_llava_1_5s_and_a_full_checkpoint_finds_its_own():
    from vitpool.models.registry import FAMILIES, record_of, tower_family

    assert record_of("clip_vision_model").name == "llava"
    assert FAMILIES["clip_vision_model"] is record_of("llava").towers["clip_vision_model"]
    assert record_of(next_adapter.TOWER_MODEL_TYPE) is RECORD and record_of("llava_next") is RECORD
    assert tower_family("llava_next", "clip_vision_model") is RECORD.towers["clip_vision_model"]
    assert tower_family("llava", "clip_vision_model") is record_of("llava").towers["clip_vision_model"]


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(model, tmp_path, max_shard_size):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        vision_shards = {
            shard for key, shard in weight_map.items() if "language_model" not in key and "lm_head" not in key
        }
        assert len(vision_shards) > 2  # the vision weights span several shards
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [tiles_of((13, 14), 60), tiles_of((5, 30), 61)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_the_releases_layout(model, tmp_path):
    """The releases keep CLIP's inner level (`vision_tower.vision_model.*`) and its position ids,
    beside `multi_modal_projector.*`, `image_newline` and the language model's tensors, unread."""
    state = {
        f"{prefix}{key}": value
        for prefix, module in (
            ("vision_tower.vision_model.", model.model.vision_tower),
            ("multi_modal_projector.", model.model.multi_modal_projector),
        )
        for key, value in module.state_dict().items()
    }
    state["vision_tower.vision_model.embeddings.position_ids"] = torch.arange(case.SIDE**2 + 1)[None]
    state["image_newline"] = model.model.image_newline.detach()
    state["language_model.model.embed_tokens.weight"] = torch.zeros(case.TINY_TEXT["vocab_size"], 48)
    save_file({key: value.contiguous() for key, value in state.items()}, str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(tmp_path)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [tiles_of((30, 5), 63)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_a_tower_only_save_and_refuses_missing_weights(model, encoder, tmp_path):
    config = next_adapter.tower_only_config(model.config)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llava_next_vision"
    state = {key: value.contiguous() for key, value in encoder.adapter.tower.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [tiles_of((23, 9), 64)]
    assert_matches(model, items, loaded.encode(items))
    del state["image_newline"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys.*image_newline"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


def test_a_vision_config_without_the_projectors_fields_or_of_another_model_is_refused(model):
    with pytest.raises(ValueError, match="a LLaVA-NeXT vision config needs .*text_hidden_size"):
        next_adapter.build_encoder(model.config.vision_config)
    other = case.full_config()
    other.model_type = "llava"
    with pytest.raises(CheckpointError, match="'llava' checkpoint: vitpool's llava_next family"):
        next_adapter.tower_only_config(other)


# ---- items -----------------------------------------------------------------------------------


def test_malformed_items_are_named_by_index_and_the_others_still_encode(model, encoder):
    good = tiles_of((3, 3), 70)
    bad_items = (
        (Image(torch.randn(5, *case.ROW_SHAPE), (3, 3)), "1 x 2 crops and a base tile, 3 tiles"),
        (Image(torch.randn(1, *case.ROW_SHAPE), (3, 3)), "3 tiles"),  # the base tile alone
        (Image(torch.randn(3, *case.ROW_SHAPE)), "original size (H, W)"),
        (Image(torch.randn(3, *case.ROW_SHAPE), (0, 3)), "original size (H, W)"),
        (Image(torch.randn(3, 3, case.TILE + 2, case.TILE + 2), (3, 3)), "must be tiles"),
        (Image(torch.randn(0, *case.ROW_SHAPE), (3, 3)), "must be tiles"),
        (Image(torch.randint(0, 255, (3, *case.ROW_SHAPE), dtype=torch.uint8), (3, 3)), "dtype"),
        (vitpool.Video(torch.randn(3, *case.ROW_SHAPE)), "images only"),
    )
    for bad, words in bad_items:
        with pytest.raises(InvalidItemError) as raised:
            encoder.encode([good, bad])
        assert raised.value.index == 1 and words in str(raised.value), (words, str(raised.value))
    assert_matches(model, [good], encoder.encode([good]))


def image_processor():
    from transformers import LlavaNextImageProcessorPil

    # the release's settings (CLIP's mean and std, bicubic) at the tiny tower's tile and pinpoints
    return LlavaNextImageProcessorPil(
        size={"shortest_edge": case.TILE},
        crop_size={"height": case.TILE, "width": case.TILE},
        image_grid_pinpoints=case.PINPOINTS,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )


def random_images(sizes, seed: int = 0) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.mark.parametrize("return_tensors", ["pt", "np"])
def test_items_from_the_processor_are_the_images_alone_and_encode_as_hugging_face(
    model, encoder, return_tensors
):
    pytest.importorskip("PIL")
    processor = image_processor()
    images = random_images(SIZES, seed=1)
    batch = processor(images=images, return_tensors=return_tensors)
    items = vitpool.items_from(batch)  # found by its keys and shape: no family= needed
    named = vitpool.items_from(dict(batch), family="llava_next")
    assert all(np.array_equal(a.pixel_values, b.pixel_values) for a, b in zip(items, named, strict=True))
    for item, image, size in zip(items, images, SIZES, strict=True):  # each as the processor makes it alone
        alone = processor(images=[image], return_tensors="pt")
        assert torch.equal(torch.as_tensor(item.pixel_values), alone["pixel_values"][0])
        assert tuple(item.grid_thw) == size == tuple(alone["image_sizes"][0].tolist())
    with torch.no_grad():
        want = model.model.get_image_features(
            **{key: torch.as_tensor(value) for key, value in batch.items()}
        ).pooler_output
    embeddings = encoder.encode([Image(torch.as_tensor(i.pixel_values), i.grid_thw) for i in items])
    for embedding, wanted in zip(embeddings, want, strict=True):
        assert relative_error(embedding.tokens, wanted) <= TOLERANCE


def test_a_mistral_3_batch_of_the_same_keys_is_still_cut_as_mistral_3s():
    pixels = torch.randn(2, 3, 16, 12)
    sizes = torch.tensor([[16, 8], [8, 12]])
    found = vitpool.items_from({"pixel_values": pixels, "image_sizes": sizes})
    named = vitpool.items_from({"pixel_values": pixels, "image_sizes": sizes}, family="mistral3")
    assert [tuple(i.pixel_values.shape) for i in found] == [tuple(i.pixel_values.shape) for i in named]
    assert [tuple(i.pixel_values.shape) for i in found] == [(3, 16, 8), (3, 8, 12)]
    # four dimensions that are not Mistral 3's either: both accounts
    with pytest.raises(
        ValueError, match=r"holds 2 images; image_sizes has 1 rows; or, for LLaVA-NeXT.*\[images, tiles"
    ):
        vitpool.items_from({"pixel_values": pixels, "image_sizes": sizes[:1]})
    with pytest.raises(
        ValueError, match=r"shape \(3, 16, 12\); Mistral 3's .*, for LLaVA-NeXT.*\[images, tiles"
    ):
        vitpool.items_from({"pixel_values": pixels[0], "image_sizes": sizes})
    tiles = {"pixel_values": torch.randn(2, 3, *case.ROW_SHAPE), "image_sizes": sizes}
    with pytest.raises(ValueError, match="Mistral 3's processor gives padded images"):
        vitpool.items_from(tiles, family="mistral3")


def _batch(**changes):
    """A hand-made batch: a 2 x 2 image (5 tiles), then a 1 x 2 one (3 tiles) padded to 5."""
    generator = torch.Generator().manual_seed(7)
    pixels = torch.zeros(2, 5, *case.ROW_SHAPE)
    pixels[0] = torch.rand(5, *case.ROW_SHAPE, generator=generator) + 0.1
    pixels[1, :3] = torch.rand(3, *case.ROW_SHAPE, generator=generator) + 0.1
    batch = {"pixel_values": pixels, "image_sizes": torch.tensor([[13, 14], [3, 3]])}
    batch.update(changes)
    return {key: value for key, value in batch.items() if value is not None}


def _with_tile(image: int, tile: int, value: float) -> torch.Tensor:
    pixels = _batch()["pixel_values"].clone()
    pixels[image, tile] = value
    return pixels


def test_the_cutter_cuts_each_image_before_its_padding_and_a_prompt_is_no_matter():
    prompt = {"input_ids": torch.zeros(1, 9, dtype=torch.long), "attention_mask": torch.ones(1, 9)}
    cut = vitpool.items_from(_batch(**prompt))
    assert [(len(item.pixel_values), tuple(item.grid_thw)) for item in cut] == [(5, (13, 14)), (3, (3, 3))]
    assert torch.equal(cut[1].pixel_values, _batch()["pixel_values"][1, :3])
    assert [(i.modality, i.grid) for i in cut_tiles(_batch())] == [("image", (13, 14)), ("image", (3, 3))]


# (changes to the batch, words of the ValueError)
BAD_BATCHES = [
    ({"image_sizes": None}, "no image_sizes"),
    ({"pixel_values": torch.rand(2, 5, 3, case.TILE)}, "[images, tiles, channels, height, width]"),
    ({"image_sizes": torch.tensor([[13, 14]])}, "image_sizes has 1 rows"),
    ({"image_sizes": torch.tensor([[13, 14], [3, 0]])}, "image_sizes row 1 is [3, 0]"),
    (
        {"pixel_values": _with_tile(1, 4, 0.5)},
        "image 1: its tiles are ['real', 'real', 'real', 'zero', 'real']",
    ),
    ({"pixel_values": _with_tile(0, slice(None), 0.0)}, "image 0: its tiles are ['zero', 'zero', 'zero'"),
    ({"pixel_values": list(_batch()["pixel_values"])}, "return_tensors='pt'"),
]


@pytest.mark.parametrize(("change", "message"), BAD_BATCHES)
def test_what_does_not_add_up_is_named(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        vitpool.items_from(_batch(**change), family="llava_next")


def test_a_batch_of_no_images_is_no_items_as_the_models_forward_runs_none(encoder):
    empty = {"pixel_values": torch.zeros(0, 5, *case.ROW_SHAPE), "image_sizes": torch.zeros(0, 2)}
    assert vitpool.items_from(empty, family="llava_next") == []
    assert encoder.encode([]) == []  # GraphEncoder's contract: an empty call is no error


# ---- the transformers drop-in ----------------------------------------------------------------


def test_the_stand_in_answers_get_image_features_as_the_model(model, encoder):
    stand_in = LlavaNextFeatures(encoder, torch.float32, torch.device("cpu"), model.config)
    images = [tiles_of((23, 9), 80), tiles_of((13, 14), 81), tiles_of((3, 3), 82)]
    sizes = torch.tensor([item.grid_thw for item in images])
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=padded(images, 5), image_sizes=sizes).pooler_output
    for pixel_values in (padded(images, 5), torch.cat([item.pixel_values for item in images])):
        got = stand_in.get_image_features(pixel_values=pixel_values, image_sizes=sizes).pooler_output
        for got_image, wanted in zip(got, want, strict=True):
            assert relative_error(got_image, wanted) <= TOLERANCE
    with pytest.raises(ConfigError, match="vision_feature_layer=-2"):
        stand_in.get_image_features(padded(images, 5), sizes, vision_feature_layer=-1)
    with pytest.raises(ConfigError, match="not \\[images, tiles"):
        stand_in.get_image_features(padded(images, 5)[0], sizes)


def test_the_drop_in_answers_the_models_forward(model):
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    images = [tiles_of((13, 14), 90), tiles_of((3, 3), 91)]
    sizes = torch.tensor([item.grid_thw for item in images])
    pixel_values = padded(images, 5)
    tokens = [case.IMAGE_TOKEN_ID] * sum(RULES.image_tokens(len(i.pixel_values), i.grid_thw) for i in images)
    input_ids = torch.tensor([[1, 2, *tokens, 3]])
    with torch.no_grad():
        want = model(input_ids=input_ids, pixel_values=pixel_values, image_sizes=sizes).logits
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    try:
        with torch.no_grad():
            got = model(input_ids=input_ids, pixel_values=pixel_values, image_sizes=sizes).logits
    finally:
        restore_vision_tower(model, original)
    assert model.model.vision_tower is tower and model.model.multi_modal_projector is projector
    assert relative_error(got, want) <= TOLERANCE
