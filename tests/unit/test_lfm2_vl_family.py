"""LFM2-VL's own checks (the shared ones: test_adapter_conformance.py): an image's entries (tiles,
thumbnail, or the whole small image) in and the LLM's tokens out as Hugging Face's
`get_image_features` hands them over, for one image, several images of different sizes and entry
counts in one call, and padded budgets; the position table's resize and the pixel unshuffle against
Hugging Face's own; loading full checkpoints (whole, sharded, the releases' `vision_model.` keys)
and tower-only saves; malformed items; `vitpool.items_from` on hand-made batches and prompts, on
the real image processor and on the full processor (torchvision only); the transformers drop-in.
CPU, fp32, tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import lfm2_vl as case
from safetensors.torch import load_file, save_file

import vitpool
from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError
from vitpool.families.lfm2_vl.adapter import axis_weights, tower_only_config
from vitpool.packing import Budget
from vitpool.specs import BatchPlan

TOLERANCE = 1e-4
BUDGETS = [16, 32, 64]
F = case.FACTOR
TILES_AND_THUMBNAIL = [(8, 8)] * 4 + [(6, 8)]  # a 2 x 2 split image: 4 tiles of 16 tokens, a thumbnail of 12


def item(shapes: list[tuple[int, int]], seed: int) -> Image:
    """An image of these entries: random packed patch rows and its spatial_shapes rows."""
    rows = sum(h * w for h, w in shapes)
    pixels = torch.randn(rows, case.ROW_WIDTH, generator=torch.Generator().manual_seed(seed))
    return Image(pixels, [list(shape) for shape in shapes])


def tokens_of(shapes: list[tuple[int, int]]) -> int:
    return sum((h // F) * (w // F) for h, w in shapes)


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model) -> GraphEncoder:
    return case.encoder_of(model, BUDGETS)


def assert_matches(model, encoder: GraphEncoder, items: list[Image]) -> None:
    for position, (embedding, one) in enumerate(zip(encoder.encode(items), items, strict=True)):
        assert embedding.tokens.shape == (tokens_of(case.shapes_of(one)), case.TEXT_WIDTH), position
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, case.image_features(model, one)) <= TOLERANCE, position


def batch_features(model, items: list[Image]) -> list[torch.Tensor]:
    """Hugging Face's get_image_features on all the items' entries in one padded batch (what the
    model runs on a prompt of these images), its per-entry outputs joined per item."""
    rows = torch.cat([torch.as_tensor(one.pixel_values) for one in items])
    shapes = [shape for one in items for shape in case.shapes_of(one)]
    with torch.no_grad():
        per_entry = model.model.get_image_features(**case.padded_entries(rows, shapes)).pooler_output
    joined, start = [], 0
    for one in items:
        count = len(case.shapes_of(one))
        joined.append(torch.cat(per_entry[start : start + count]))
        start += count
    return joined


def test_one_image_matches_get_image_features(model, encoder):
    assert_matches(model, encoder, [item([(6, 8)], seed=1)])  # larger than the 4 x 4 position table


def test_images_of_different_sizes_and_entry_counts_in_one_call(model, encoder):
    items = [
        item([(2, 6)], 2),  # below the table's side: the antialiased resize
        item(TILES_AND_THUMBNAIL[1:], 3),  # three tiles and a thumbnail
        item([(4, 4)], 4),
        item([(10, 2)], 5),
    ]
    assert_matches(model, encoder, items)
    for got, want in zip(encoder.encode(items), batch_features(model, items), strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    # an image over every budget (4 tiles and a thumbnail: 76 tokens, eager at its own size) beside a
    # small one
    assert_matches(model, encoder, [item(TILES_AND_THUMBNAIL, 6), item([(2, 2)], 7)])


def test_each_entry_is_its_own_sequence(model, encoder):
    """A tile attends within itself: an image's tokens are its entries' tokens encoded one by one,
    joined; a different thumbnail leaves the tiles' tokens as they were."""
    whole = item(TILES_AND_THUMBNAIL[2:], 8)  # two tiles, a thumbnail
    rows, shapes = torch.as_tensor(whole.pixel_values), case.shapes_of(whole)
    parts, start = [], 0
    for shape in shapes:
        parts.append(Image(rows[start : start + shape[0] * shape[1]], [list(shape)]))
        start += shape[0] * shape[1]
    [joined] = encoder.encode([whole])
    separately = torch.cat([embedding.tokens for embedding in encoder.encode(parts)])
    assert relative_error(joined.tokens, separately) <= TOLERANCE
    other_thumbnail = Image(
        torch.cat([rows[:128], torch.randn(48, case.ROW_WIDTH)]), [[8, 8], [8, 8], [6, 8]]
    )
    [changed] = encoder.encode([other_thumbnail])
    assert relative_error(changed.tokens[:32], joined.tokens[:32]) <= TOLERANCE
    assert relative_error(changed.tokens[32:], joined.tokens[32:]) > 0.1


def test_every_budget_matches_get_image_features(model, encoder):
    items = [item([(4, 6), (2, 2)], 9), item([(4, 8)], 10)]  # 15 tokens, 60 rows, 3 sequences
    rules = encoder.adapter.item_rules
    specs = tuple(
        rules.item_spec("image", tuple(one.pixel_values.shape), "float32", one.grid_thw) for one in items
    )
    rows = [one.pixel_values for one in items]
    for budget in encoder.budgets:
        [outcomes] = encoder.run_plans([(BatchPlan(budget, specs), rows)], "cpu")
        for one, embedding in zip(items, outcomes, strict=True):
            assert relative_error(embedding.tokens, case.image_features(model, one)) <= TOLERANCE, budget


def test_padding_rows_do_not_change_real_rows(encoder):
    """The same image alone in the smallest and the largest budget with garbage in the padding
    rows' pixels, and beside neighbours: its tokens are the same."""
    adapter = encoder.adapter
    one = item([(4, 6), (2, 4)], 11)  # 32 rows, 8 tokens
    spec = adapter.item_rules.item_spec("image", tuple(one.pixel_values.shape), "float32", one.grid_thw)
    alone = {}
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        num_rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(num_rows, case.ROW_WIDTH) * 100
        batch[:32] = one.pixel_values
        with torch.no_grad():
            outputs = adapter.forward(batch, adapter.build_metadata([spec], num_rows, budget))[0]
        assert torch.isfinite(outputs).all()
        alone[budget.num_tokens] = outputs[:8]
    crowded = encoder.encode([item([(8, 4)], 12), one, item([(2, 2)], 13)])[1].tokens
    first = alone[encoder.budgets[0].num_tokens]
    assert relative_error(alone[encoder.budgets[-1].num_tokens], first) <= TOLERANCE
    assert relative_error(crowded, first) <= TOLERANCE


@pytest.mark.parametrize("grid", [4, 16])
def test_position_weights_are_siglip2s_resize(grid):
    """The host's separable weights, multiplied out, are the resize of the table Hugging Face
    runs (`F.interpolate`, bilinear with antialiasing, before transformers 5.24; weights computed
    alike from 5.24 on): read off by resizing an identity table, for sizes below, at and above the
    table's."""
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings

    identity = torch.eye(grid * grid).reshape(grid, grid, grid * grid)
    for h, w in [(1, 1), (2, 6), (3, 5), (grid, grid), (grid + 3, 2), (2 * grid, grid + 1), (32, 32)]:
        rows, columns = axis_weights(h, grid), axis_weights(w, grid)
        product = (rows[:, None, :, None] * columns[None, :, None, :]).reshape(h * w, grid * grid)
        resize = Siglip2VisionEmbeddings.resize_positional_embeddings
        assert torch.allclose(product, resize(identity, torch.tensor([[h, w]]), h * w)[0], atol=1e-6), (h, w)
        interpolated = torch.nn.functional.interpolate(
            identity.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False, antialias=True
        )
        assert torch.allclose(product, interpolated[0].reshape(grid * grid, h * w).T, atol=1e-6), (h, w)


def test_metadata_of_entries_and_padding(model, encoder):
    adapter = encoder.adapter
    budget = Budget(16, (("sequences", 8),), 4)
    two = adapter.item_rules.item_spec("image", (28, case.ROW_WIDTH), "float32", [[4, 6], [2, 2]])
    one = adapter.item_rules.item_spec("image", (8, case.ROW_WIDTH), "float32", [[2, 4]])
    metadata = adapter.build_metadata([two, one], 64, budget)
    assert metadata["cu_seqlens"].tolist() == [0, 24, 28, 36, 64, 64, 64, 64, 64, 64]
    # the pixel unshuffle's gather is Hugging Face's pixel_unshuffle of each entry
    features = torch.randn(64, 5)
    projector = model.model.multi_modal_projector
    expected = [
        projector.pixel_unshuffle(features[start : start + h * w].reshape(1, h, w, 5)).reshape(-1, 5 * F * F)
        for start, (h, w) in ((0, (4, 6)), (24, (2, 2)), (28, (2, 4)))
    ]
    merge_index = metadata["merge_index"]
    assert torch.equal(features[merge_index[:9]].reshape(9, -1), torch.cat(expected))
    assert merge_index[9:].abs().sum() == 0  # padding tokens gather row 0
    weights = metadata["position_weights"]
    assert torch.allclose(weights[:24].sum(-1), torch.ones(24, 2)) and weights[36:].abs().sum() == 0
    assert torch.equal(weights[24:28], adapter._shape_tensors((2, 2))[0])
    with pytest.raises(ValueError, match="the buffers hold"):
        adapter.build_metadata([two, one, two, one], 64, budget)  # 72 rows


def test_a_projector_without_its_layernorm(model):
    other = case.hf_model(seed=5, projector_use_layernorm=False)
    assert other.model.multi_modal_projector.layer_norm is None
    encoder = case.encoder_of(other, [16])
    assert_matches(other, encoder, [item([(4, 6), (2, 2)], 14), item([(6, 6)], 15)])


# Loading through GraphEncoder.from_pretrained (the registry's "siglip2_vision_model" tower).


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(model, loaded: GraphEncoder, seed: int) -> None:
    assert_matches(model, loaded, [item([(4, 6), (2, 2)], seed), item([(2, 4)], seed + 1)])


def saved_state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def test_loads_a_full_model_save(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    assert any(key.startswith("model.vision_tower.encoder.") for key in state)
    assert any(key.startswith("model.multi_modal_projector.") for key in state)
    assert_loaded(model, load(tmp_path), 20)


def test_loads_a_sharded_full_model_save_opening_only_the_vision_shards(model, tmp_path: Path, monkeypatch):
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    vision_shards = {
        shard
        for key, shard in weight_map.items()
        if key.startswith(("model.vision_tower.", "model.multi_modal_projector."))
    }
    assert len(set(weight_map.values())) > len(vision_shards) > 1
    from vitpool.models import loading

    opened = []
    real_open = loading.safe_open
    monkeypatch.setattr(
        loading, "safe_open", lambda path, **kw: opened.append(Path(path).name) or real_open(path, **kw)
    )
    assert_loaded(model, load(tmp_path), 22)
    assert set(opened) == vision_shards


def test_loads_the_releases_layout_as_transformers_does(model, tmp_path: Path):
    """The releases keep the tower under `model.vision_tower.vision_model.` (the SigLIP2 class of
    their day); transformers strips that level on load, and so does vitpool."""
    from transformers import Lfm2VlForConditionalGeneration

    model.config.save_pretrained(tmp_path)
    state = {
        key.replace("model.vision_tower.", "model.vision_tower.vision_model.", 1): value.clone()
        for key, value in model.state_dict().items()
    }
    save_file(state, str(tmp_path / "model.safetensors"))
    reloaded = Lfm2VlForConditionalGeneration.from_pretrained(tmp_path).eval()
    for name, value in model.model.vision_tower.state_dict().items():
        assert torch.equal(reloaded.model.vision_tower.state_dict()[name], value), name
    assert_loaded(model, load(tmp_path), 24)


def test_loads_a_tower_only_save(model, tmp_path: Path):
    tower_only_config(model.config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "siglip2_vision_model" and raw["text_hidden_size"] == case.TEXT_WIDTH
    assert raw["downsample_factor"] == F and raw["projector_use_layernorm"] is True
    save_file(case.encoder_module(model).state_dict(), str(tmp_path / "model.safetensors"))
    assert_loaded(model, load(tmp_path), 26)


def test_a_missing_or_unexpected_key_is_named(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    del state["model.multi_modal_projector.linear_1.weight"]
    state["model.multi_modal_projector.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    named = r"multi_modal_projector\.linear_1\.weight.*multi_modal_projector\.extra"
    with pytest.raises(CheckpointError, match=named):
        load(tmp_path)


def test_a_siglip2_tower_without_lfm2_vls_projector_is_refused(tmp_path: Path):
    """SigLIP2 itself (and any other model with its tower) has no LFM2-VL projector: its config is
    refused by name, as is a SigLIP2 tower saved without the projector's settings."""
    from transformers import Siglip2Config, Siglip2VisionConfig

    Siglip2Config(vision_config=dict(case.TINY_VISION)).save_pretrained(tmp_path / "siglip2")
    with pytest.raises(ValueError, match="'siglip2' checkpoint has another projector"):
        load(tmp_path / "siglip2")
    Siglip2VisionConfig(**case.TINY_VISION).save_pretrained(tmp_path / "tower")
    with pytest.raises(ValueError, match="text_hidden_size"):
        load(tmp_path / "tower")


@pytest.mark.parametrize("bad, words", case.BAD_ITEMS, ids=[words for _, words in case.BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([item([(4, 4)], 30), bad])
    assert raised.value.index == 1 and words in str(raised.value)


# vitpool.items_from on hand-made batches: the cutter's rules, without torchvision


def padded_batch(items: list[Image]) -> dict[str, torch.Tensor]:
    rows = torch.cat([torch.as_tensor(one.pixel_values) for one in items])
    return case.padded_entries(rows, [shape for one in items for shape in case.shapes_of(one)])


HAND_ITEMS = [[(4, 6)], TILES_AND_THUMBNAIL, [(2, 2)], [(8, 8)] * 3 + [(4, 8)]]  # 3 x 1 tiles, thumbnail


def hand_items() -> list[Image]:
    return [item(shapes, 40 + number) for number, shapes in enumerate(HAND_ITEMS)]


def assert_cut_as(cut: list[Image], items: list[Image]) -> None:
    assert len(cut) == len(items)
    for got, want in zip(cut, items, strict=True):
        assert torch.equal(torch.as_tensor(got.pixel_values), torch.as_tensor(want.pixel_values))
        assert torch.as_tensor(got.grid_thw).tolist() == torch.as_tensor(want.grid_thw).tolist()


def test_items_from_cuts_by_the_image_processors_tile_grids(model, encoder):
    items = hand_items()
    grids = {"image_rows": torch.tensor([1, 2, 1, 3]), "image_cols": torch.tensor([1, 2, 1, 1])}
    batch = {**padded_batch(items), **grids}
    cut = vitpool.items_from(batch, family="lfm2_vl")
    assert_cut_as(cut, items)
    for got, want in zip(encoder.encode(cut), batch_features(model, items), strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    # without thumbnails (use_thumbnail=False): the grids alone add up
    no_thumbnails = [items[0], item([(8, 8)] * 4, 50)]
    batch = {**padded_batch(no_thumbnails), "image_rows": [1, 2], "image_cols": [1, 2]}
    assert_cut_as(vitpool.items_from(batch, family="lfm2_vl"), no_thumbnails)
    # as NumPy arrays
    arrays = {key: np.asarray(value) for key, value in padded_batch(items[:2]).items()}
    cut = vitpool.items_from({**arrays, "image_rows": np.array([1, 2]), "image_cols": np.array([1, 2])})
    assert isinstance(cut[1].pixel_values, np.ndarray)
    assert_cut_as([Image(torch.from_numpy(one.pixel_values), one.grid_thw) for one in cut], items[:2])


def test_items_from_a_single_entry_needs_no_grid():
    [cut] = vitpool.items_from(padded_batch([item([(4, 6)], 51)]))
    assert cut.pixel_values.shape == (24, case.ROW_WIDTH)


def test_items_from_without_grids_or_token_types_cuts_entry_by_entry(model, encoder):
    """Lfm2VlProcessor's output without mm_token_type_ids: nothing says which image an entry is of,
    so each entry is an item, as `get_image_features` answers; their tokens joined are its own."""
    items = hand_items()
    batch = {**padded_batch(items), "input_ids": torch.zeros(1, 4, dtype=torch.long)}
    cut = vitpool.items_from(batch)
    shapes = [shape for one in items for shape in case.shapes_of(one)]
    assert [case.shapes_of(one) for one in cut] == [[shape] for shape in shapes]
    with torch.no_grad():
        want = model.model.get_image_features(**padded_batch(items)).pooler_output
    for embedding, entry in zip(encoder.encode(cut), want, strict=True):
        assert relative_error(embedding.tokens, entry) <= TOLERANCE


def test_items_from_refuses_what_does_not_add_up():
    items = hand_items()[:2]
    batch = padded_batch(items)
    grids = {"image_rows": [1, 1], "image_cols": [1, 3]}
    with pytest.raises(
        ValueError,
        match=r"give 4 tiles \(5 with a thumbnail after each split image\); "
        r"spatial_shapes has 6",
    ):
        vitpool.items_from({**batch, **grids})
    with pytest.raises(ValueError, match="one grid of at least 1 x 1 per image"):
        vitpool.items_from({**batch, "image_rows": [1, 2], "image_cols": [1]})
    odd_tiles = padded_batch([items[0], item([(8, 8), (8, 4), (8, 8), (8, 8), (6, 8)], 52)])
    with pytest.raises(ValueError, match="the processor cuts one size of tile"):
        vitpool.items_from({**odd_tiles, "image_rows": [1, 2], "image_cols": [1, 2]})
    bad_mask = dict(batch, pixel_attention_mask=batch["pixel_attention_mask"].clone())
    bad_mask["pixel_attention_mask"][0, 30] = 1
    with pytest.raises(ValueError, match=r"entry 0: spatial_shapes row \(4, 6\) says 24 real patches"):
        vitpool.items_from(bad_mask, family="lfm2_vl")
    with pytest.raises(ValueError, match="6 entries; spatial_shapes has 5 rows"):
        vitpool.items_from(dict(batch, spatial_shapes=batch["spatial_shapes"][:5]))
    with pytest.raises(ValueError, match=r"padded entries \[entries, max_patches, C\*P\*P\]"):
        vitpool.items_from(dict(batch, pixel_values=batch["pixel_values"][0]))
    with pytest.raises(ValueError, match="spatial_shapes"):
        no_shapes = {key: value for key, value in batch.items() if key != "spatial_shapes"}
        vitpool.items_from(no_shapes, family="lfm2_vl")


# The full processor's prompt, written by hand as Lfm2VlProcessor writes it (its tokens' ids)

IMAGE_TOKEN, START, END, THUMBNAIL = 5, 6, 7, 8


def prompt_of(images: list[list[tuple[int, int]]], grids: list[tuple[int, int]], text: int = 3) -> list[int]:
    """`<|image_start|>`, per tile `<|img_row_R_col_C|>` and its tokens, `<|img_thumbnail|>` and
    the thumbnail's, `<|image_end|>` (an image not split: its tokens alone), text between images."""
    ids = [text]
    for shapes, (rows, cols) in zip(images, grids, strict=True):
        ids.append(START)
        if rows * cols > 1:
            for number, (h, w) in enumerate(shapes):
                marker = THUMBNAIL if number == rows * cols else 100 + number
                ids += [marker] + [IMAGE_TOKEN] * ((h // F) * (w // F))
        else:
            ids += [IMAGE_TOKEN] * sum((h // F) * (w // F) for h, w in shapes)
        ids += [END, text]
    return ids


def with_prompts(batch: dict, prompts: list[list[int]]) -> dict:
    longest = max(map(len, prompts))
    ids = torch.tensor([prompt + [0] * (longest - len(prompt)) for prompt in prompts])
    return {**batch, "input_ids": ids, "mm_token_type_ids": (ids == IMAGE_TOKEN).long()}


GRIDS = [(1, 1), (2, 2), (1, 1), (3, 1)]


def test_items_from_reads_each_images_entries_from_the_prompt():
    items = hand_items()
    prompts = [prompt_of(HAND_ITEMS[:2], GRIDS[:2]), prompt_of(HAND_ITEMS[2:], GRIDS[2:])]
    assert_cut_as(vitpool.items_from(with_prompts(padded_batch(items), prompts)), items)


def test_items_from_refuses_a_prompt_that_does_not_fit():
    items = hand_items()
    batch = padded_batch(items)
    whole = prompt_of(HAND_ITEMS, GRIDS)
    # the image tokens alone, without markers (use_image_special_tokens=False): tiles join into one run
    plain = [token for token in whole if token not in (START, END, THUMBNAIL) and token < 100]
    with pytest.raises(ValueError, match="use_image_special_tokens=False"):
        vitpool.items_from(with_prompts(batch, [plain]))
    with pytest.raises(ValueError, match="cut short"):
        vitpool.items_from(with_prompts(batch, [whole[: whole.index(END, 40)]]))
    # cut right after the last image's tokens: nothing says that image ends there
    with pytest.raises(ValueError, match="do not follow the processor's markers"):
        vitpool.items_from(with_prompts(batch, [whole[:-2]]))
    wrong_length = whole.copy()
    wrong_length.insert(whole.index(IMAGE_TOKEN), IMAGE_TOKEN)
    with pytest.raises(ValueError, match="runs of image tokens are"):
        vitpool.items_from(with_prompts(batch, [wrong_length]))
    # an image closed by another token than the others: not the processor's prompt
    other_closer = whole.copy()
    other_closer[len(whole) - 2] = 9
    with pytest.raises(ValueError, match="do not follow the processor's markers"):
        vitpool.items_from(with_prompts(batch, [other_closer]))
    no_types = {
        key: value for key, value in with_prompts(batch, [whole]).items() if key != "mm_token_type_ids"
    }
    # without the token types nothing says where an image ends: entry by entry, as the model answers
    assert len(vitpool.items_from(no_types)) == sum(len(shapes) for shapes in HAND_ITEMS)


# vitpool.items_from on the real processors (Lfm2VlImageProcessor exists for torchvision only)

PICTURE_SIZES = [(10, 14), (40, 30), (12, 12), (60, 20)]  # small, split 2 x 2, small, split 3 x 1


def image_processor(**settings):
    pytest.importorskip("torchvision")
    pytest.importorskip("PIL")
    from transformers import Lfm2VlImageProcessor

    # the tiny model's patch and factor; tiles of 8 x 8 patches, at most 16 tokens unsplit
    return Lfm2VlImageProcessor(
        encoder_patch_size=case.PATCH,
        downsample_factor=F,
        tile_size=16,
        min_image_tokens=4,
        max_image_tokens=16,
        max_tiles=4,
        **settings,
    )


def pictures(seed: int = 0) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in PICTURE_SIZES]


def assert_each_as_alone(cut, processor, images) -> None:
    """Each item is its image's output alone, the padding dropped: real patch rows and shapes."""
    assert len(cut) == len(images)
    for got, picture in zip(cut, images, strict=True):
        alone = processor(picture, return_tensors="pt")
        shapes = alone["spatial_shapes"].tolist()
        rows = torch.cat([alone["pixel_values"][entry, : h * w] for entry, (h, w) in enumerate(shapes)])
        assert torch.equal(torch.as_tensor(got.pixel_values), rows)
        assert torch.as_tensor(got.grid_thw).tolist() == shapes


def grouped_features(model, batch, cut) -> list[torch.Tensor]:
    with torch.no_grad():
        per_entry = model.model.get_image_features(
            batch["pixel_values"], batch["spatial_shapes"], batch["pixel_attention_mask"]
        ).pooler_output
    joined, start = [], 0
    for one in cut:
        count = len(case.shapes_of(one))
        joined.append(torch.cat(per_entry[start : start + count]))
        start += count
    return joined


@pytest.mark.parametrize("use_thumbnail, counts", [(True, [1, 5, 1, 4]), (False, [1, 4, 1, 3])])
def test_items_from_the_image_processor_with_its_grids(model, encoder, use_thumbnail, counts):
    processor = image_processor(use_thumbnail=use_thumbnail)
    images = pictures()
    batch = processor(images, return_tensors="pt", return_row_col_info=True)
    # its image_sizes fit Mistral 3's keys too: the family is named
    cut = vitpool.items_from(batch, family="lfm2_vl")
    assert [len(one.grid_thw) for one in cut] == counts
    assert_each_as_alone(cut, processor, images)
    for got, want in zip(encoder.encode(cut), grouped_features(model, batch, cut), strict=True):
        assert got.tokens.shape == want.shape and relative_error(got.tokens, want) <= TOLERANCE
    as_arrays = vitpool.items_from(
        dict(processor(images, return_tensors="np", return_row_col_info=True)), family="lfm2_vl"
    )
    for from_arrays, from_tensors in zip(encoder.encode(as_arrays), encoder.encode(cut), strict=True):
        assert torch.equal(from_arrays.tokens, from_tensors.tokens)
    with pytest.raises(ValueError, match="return_row_col_info=True"):
        vitpool.items_from(processor(images, return_tensors="pt"))


def tiny_tokenizer():
    """A character-level tokenizer with LFM2-VL's special tokens (what the processor reads from
    the real one) and its tile markers as single tokens; no download."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {
        "image_token": "<image>",
        "image_start_token": "<|image_start|>",
        "image_end_token": "<|image_end|>",
        "image_thumbnail_token": "<|img_thumbnail|>",
    }
    vocab = {"<unk>": 0, "<pad>": 1, **{chr(c): c - 30 for c in range(32, 127)}, "\n": 97}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", extra_special_tokens=special
    )
    tokenizer.add_tokens(
        [f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)], special_tokens=True
    )
    return tokenizer


def test_items_from_the_full_processor_reads_its_prompt(model, encoder):
    """Lfm2VlProcessor drops image_rows and image_cols; with mm_token_type_ids the prompt says
    where each image's entries end. Two prompts of two images each, the second's adjacent."""
    from transformers import Lfm2VlProcessor

    image_proc = image_processor()
    processor = Lfm2VlProcessor(image_proc, tiny_tokenizer())
    images = pictures(1)
    texts = ["a<image>b<image>c", "<image><image>d"]
    nested = [images[:2], images[2:]]
    out = processor(
        images=nested, text=texts, return_tensors="pt", padding=True, return_mm_token_type_ids=True
    )
    assert "image_rows" not in out
    cut = vitpool.items_from(out)  # the keys alone name the family
    assert [len(one.grid_thw) for one in cut] == [1, 5, 1, 4]
    assert_each_as_alone(cut, image_proc, images)
    for got, want in zip(encoder.encode(cut), grouped_features(model, out, cut), strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    without_types = processor(images=nested, text=texts, return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="return_mm_token_type_ids=True"):
        vitpool.items_from(without_types)
    plain = processor(
        images=nested,
        text=texts,
        return_tensors="pt",
        padding=True,
        return_mm_token_type_ids=True,
        use_image_special_tokens=False,
    )
    with pytest.raises(ValueError, match="use_image_special_tokens=False"):
        vitpool.items_from(plain)


# The transformers drop-in: the model's get_image_features answered through vitpool


def test_the_drop_in_answers_get_image_features_and_the_models_forward():
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = case.hf_model(seed=7, image_token_id=IMAGE_TOKEN)
    items = [item([(4, 6)], 60), item(TILES_AND_THUMBNAIL[2:], 61)]
    batch = padded_batch(items)
    num_tokens = sum(tokens_of(case.shapes_of(one)) for one in items)
    input_ids = torch.tensor([[1, 2, *[IMAGE_TOKEN] * num_tokens, 3, 4]])
    with torch.no_grad():
        wanted = model.model.get_image_features(**batch).pooler_output
        wanted_logits = model(input_ids=input_ids, **batch).logits
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    with torch.no_grad():
        got = model.model.get_image_features(**batch).pooler_output
        logits = model(input_ids=input_ids, **batch).logits
    assert len(got) == len(wanted) == 4  # one tensor per entry, as Hugging Face answers
    for got_tokens, want in zip(got, wanted, strict=True):
        assert relative_error(got_tokens, want) <= TOLERANCE
    assert relative_error(logits, wanted_logits) <= TOLERANCE
    restore_vision_tower(model, original)
    with torch.no_grad():
        assert torch.equal(model.model.get_image_features(**batch).pooler_output[0], wanted[0])
