"""Mistral 3 (`PixtralVisionModel` + `Mistral3MultiModalProjector`): the static forward against the
Hugging Face model's own `get_image_features` (fp32, SDPA) on each image alone and on the padded
batch the processor makes; images of one token, which `get_image_features` cannot take alone; the
feature layer the projector reads; loading full checkpoints (as saved, sharded, and in the model's
state_dict layout) and a tower-only save; bad items; `vitpool.items_from` on the real
`PixtralImageProcessorPil`; the transformers drop-in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases.mistral3 import (
    BAD_ITEMS,
    COMPANION,
    MERGE,
    PATCH,
    ROW_SHAPE,
    TEXT_WIDTH,
    TINY_TEXT,
    TINY_VISION,
    encoder_module,
    encoder_of,
    hf_model,
    image_features,
    padded_batch,
)
from safetensors.torch import load_file, save_file

import vitpool
from vitpool import CheckpointError, ConfigError, GraphEncoder, Image, InvalidItemError
from vitpool.families.mistral3.adapter import tower_only_config
from vitpool.packing import Budget
from vitpool.specs import BatchPlan

TOLERANCE = 1e-4
BUDGETS = [16, 32, 64]


def picture(height: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(3, height, width, generator=torch.Generator().manual_seed(seed))


def item(height: int, width: int, seed: int) -> Image:
    return Image(picture(height, width, seed), (height, width))


def tokens_of(item_: Image) -> int:
    height, width = item_.grid_thw
    return (height // (PATCH * MERGE)) * (width // (PATCH * MERGE))


@pytest.fixture(scope="module")
def model():
    return hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model) -> GraphEncoder:
    return encoder_of(model, BUDGETS)


def assert_matches(model, encoder: GraphEncoder, items: list[Image]) -> None:
    for position, (embedding, one) in enumerate(zip(encoder.encode(items), items, strict=True)):
        assert embedding.tokens.shape == (tokens_of(one), TEXT_WIDTH), position
        assert relative_error(embedding.tokens, image_features(model, one)) <= TOLERANCE, position


def test_one_image_matches_get_image_features(model, encoder):
    assert_matches(model, encoder, [item(8, 12, seed=1)])


def test_images_of_different_sizes_and_aspect_ratios_in_one_call(model, encoder):
    items = [item(8, 12, 2), item(12, 4, 3), item(16, 16, 4), item(4, 20, 5), item(20, 8, 6)]
    assert_matches(model, encoder, items)
    # what the model runs: one padded batch, each image attending over itself
    pixels, sizes = padded_batch([one.pixel_values for one in items])
    with torch.no_grad():
        wanted = model.model.get_image_features(pixels, sizes).pooler_output
    for got, want in zip(encoder.encode(items), wanted, strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    # an image larger than any budget (90 tokens: eager, alone) beside a small one
    assert_matches(model, encoder, [item(40, 36, 7), item(4, 8, 8)])


def test_one_token_images_are_served(model, encoder):
    """get_image_features fails on a batch of one token in all (its squeeze(0) drops the token
    axis before the split); the model's math is defined, and vitpool gives what the model gives the
    image beside another."""
    single = item(PATCH * MERGE, PATCH * MERGE, 9)
    with pytest.raises(RuntimeError, match="split_with_sizes"), torch.no_grad():
        model.model.get_image_features(single.pixel_values[None], torch.tensor([[4, 4]]))
    pixels, sizes = padded_batch([single.pixel_values, COMPANION])
    with torch.no_grad():
        beside = model.model.get_image_features(pixels, sizes).pooler_output[0]
    [alone] = encoder.encode([single])
    assert alone.tokens.shape == (1, TEXT_WIDTH)
    assert relative_error(alone.tokens, beside) <= TOLERANCE
    assert_matches(model, encoder, [single, item(4, 4, 10), item(8, 4, 11)])


def test_every_budget_matches_get_image_features(model, encoder):
    items = [item(8, 16, 12), item(4, 8, 13)]  # 10 tokens, 40 rows
    rules = encoder.adapter.item_rules
    rows = [rules.pixel_rows(one.pixel_values) for one in items]
    specs = tuple(
        rules.item_spec("image", tuple(r.shape), "float32", one.grid_thw) for one, r in zip(items, rows)
    )
    for budget in encoder.budgets:
        [outcomes] = encoder.run_plans([(BatchPlan(budget, specs), rows)], "cpu")
        for one, embedding in zip(items, outcomes, strict=True):
            assert relative_error(embedding.tokens, image_features(model, one)) <= TOLERANCE, budget


def test_padding_rows_do_not_change_real_rows(encoder):
    """The same image alone in the smallest and the largest budget with garbage in the padding
    rows' pixels, and beside neighbours: its tokens are the same."""
    adapter = encoder.adapter
    one = item(8, 12, 14)  # 4 x 6 patches
    rows = adapter.item_rules.pixel_rows(one.pixel_values)
    spec = adapter.item_rules.item_spec("image", tuple(rows.shape), "float32", one.grid_thw)
    alone = {}
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        num_rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(num_rows, *ROW_SHAPE) * 100
        batch[:24] = rows
        with torch.no_grad():
            alone[budget.num_tokens] = adapter.forward(
                batch, adapter.build_metadata([spec], num_rows, budget)
            )[0][:6]
    crowded = encoder.encode([item(16, 12, 15), one, item(4, 4, 16)])[1].tokens
    first = alone[encoder.budgets[0].num_tokens]
    assert relative_error(alone[encoder.budgets[-1].num_tokens], first) <= TOLERANCE
    assert relative_error(crowded, first) <= TOLERANCE


def test_metadata_of_a_grid_and_its_padding(encoder):
    adapter = encoder.adapter
    budget = Budget(16, (), 4)
    spec = adapter.item_rules.item_spec("image", (24, *ROW_SHAPE), "float32", (1, 4, 6))
    metadata = adapter.build_metadata([spec, spec], 64, budget)
    assert metadata["cu_seqlens"].tolist() == [0, 24, 48, 64, 64, 64]
    # (row, column) row-major, each image from (0, 0); padding rows at (0, 0)
    assert metadata["position_ids"][:7].tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [1, 0]]
    assert (
        metadata["position_ids"][24:26].tolist() == [[0, 0], [0, 1]]
        and metadata["position_ids"][48:].abs().sum() == 0
    )
    # the merger's unfold: blocks row-major, a block's patches row-major; the second image from row 24
    features = torch.randn(24, 5)
    unfolded = torch.nn.functional.unfold(features.T.reshape(1, 5, 4, 6), kernel_size=MERGE, stride=MERGE)
    gathered = features[metadata["merge_index"][:6]].transpose(1, 2).reshape(6, -1)
    assert torch.equal(gathered, unfolded[0].T)
    assert torch.equal(metadata["merge_index"][6:12], metadata["merge_index"][:6] + 24)
    assert metadata["merge_index"][12:].abs().sum() == 0
    with pytest.raises(ValueError, match="the buffers hold"):
        adapter.build_metadata([spec] * 5, 64, budget)


@pytest.mark.parametrize("layer", [-2, 1, 0])
def test_the_projector_reads_its_feature_layer(layer):
    """A model whose projector reads an earlier layer's output (or the patch embeddings): the
    adapter runs only the layers it reads and still gives what get_image_features gives."""
    other = hf_model(seed=5, vision_feature_layer=layer)
    encoder = encoder_of(other, [16])
    assert encoder.adapter.num_layers_run == (layer if layer >= 0 else 3 + layer)
    items = [item(8, 12, 17), item(4, 8, 18)]
    pixels, sizes = padded_batch([one.pixel_values for one in items])
    with torch.no_grad():
        # hidden states asked for: get_image_features reads its layer index as that request, and
        # layer 0 would ask for none
        wanted = other.model.get_image_features(pixels, sizes, output_hidden_states=True).pooler_output
    for embedding, want in zip(encoder.encode(items), wanted, strict=True):
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def test_several_feature_layers_are_refused():
    with pytest.raises(ConfigError, match="several layers"):
        encoder_module(hf_model(vision_feature_layer=[-1, -2]))


# Loading through GraphEncoder.from_pretrained (the registry's "pixtral" tower).


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(model, loaded: GraphEncoder, seed: int) -> None:
    assert_matches(model, loaded, [item(8, 12, seed), item(4, 4, seed + 1)])


def saved_state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def test_loads_a_full_model_save(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    # transformers writes the releases' layout back: the tower and projector at the top
    assert any(key.startswith("vision_tower.") for key in state)
    assert any(key.startswith("multi_modal_projector.") for key in state)
    assert any(key.startswith("language_model.") for key in state)
    assert_loaded(model, load(tmp_path), 20)


def test_loads_a_sharded_full_model_save_opening_only_the_vision_shards(model, tmp_path: Path, monkeypatch):
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    vision_shards = {
        shard
        for key, shard in weight_map.items()
        if key.startswith(("vision_tower.", "multi_modal_projector."))
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


def test_loads_the_models_state_dict_layout(model, tmp_path: Path):
    """A full checkpoint whose keys are the model's own state_dict (`model.vision_tower.`, ...)."""
    model.config.save_pretrained(tmp_path)
    state = {key: value.clone() for key, value in model.state_dict().items()}  # lm_head is tied
    assert any(key.startswith("model.multi_modal_projector.") for key in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_loaded(model, load(tmp_path), 24)


def test_loads_a_tower_only_save(model, tmp_path: Path):
    tower_only_config(model.config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert (
        raw["model_type"] == "pixtral"
        and raw["text_hidden_size"] == TEXT_WIDTH
        and raw["spatial_merge_size"] == 2
    )
    save_file(encoder_module(model).state_dict(), str(tmp_path / "model.safetensors"))
    assert_loaded(model, load(tmp_path), 26)


def test_a_missing_or_unexpected_key_is_named(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    del state["multi_modal_projector.patch_merger.merging_layer.weight"]
    state["multi_modal_projector.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"patch_merger\.merging_layer\.weight.*multi_modal_projector\.extra"
    ):
        load(tmp_path)


def test_a_pixtral_tower_without_mistral3s_projector_is_refused(tmp_path: Path):
    """Pixtral-12B (LLaVA) has the same tower and another projector: its config is refused by name,
    as is a Pixtral tower saved without the projector's settings."""
    from transformers import LlavaConfig, PixtralVisionConfig

    LlavaConfig(
        vision_config={"model_type": "pixtral", **TINY_VISION}, text_config=dict(TINY_TEXT)
    ).save_pretrained(tmp_path / "llava")
    with pytest.raises(ValueError, match="'llava' checkpoint has another projector"):
        load(tmp_path / "llava")
    PixtralVisionConfig(**TINY_VISION).save_pretrained(tmp_path / "tower")
    with pytest.raises(ValueError, match="text_hidden_size"):
        load(tmp_path / "tower")


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([item(4, 8, 30), bad])
    assert raised.value.index == 1 and words in str(raised.value)


def test_patch_rows_with_a_grid_are_the_same_item(encoder):
    one = item(8, 12, 31)
    rows = encoder.adapter.item_rules.pixel_rows(one.pixel_values)
    assert rows.shape == (24, *ROW_SHAPE)
    as_rows, as_image, as_batch = encoder.encode(
        [Image(rows, (1, 4, 6)), one, Image(one.pixel_values[None], (8, 12))]
    )
    assert torch.equal(as_rows.tokens, as_image.tokens) and torch.equal(as_batch.tokens, as_image.tokens)


# vitpool.items_from on the real image processor (PIL backend)


def pixtral_processor():
    pytest.importorskip("PIL.Image")
    from transformers import PixtralImageProcessorPil

    # what PixtralProcessor asks of it: patches of patch_size * spatial_merge_size pixels
    return PixtralImageProcessorPil(
        patch_size={"height": PATCH * MERGE, "width": PATCH * MERGE}, size={"longest_edge": 24}
    )


def random_pictures(sizes: list[tuple[int, int]], seed: int = 0) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


SIZES = [(10, 16), (30, 12), (3, 3), (24, 24)]  # wide, tall (resized), one token, square


def test_items_from_cuts_each_image_to_its_size_and_encodes_as_the_model(model, encoder):
    processor = pixtral_processor()
    pictures = random_pictures(SIZES)
    batch = processor(images=pictures, return_tensors="pt")
    assert len({tuple(size) for size in batch["image_sizes"].tolist()}) == len(SIZES)  # padding is cut away
    items = vitpool.items_from(batch)  # the keys alone name the family
    assert len(items) == len(pictures)
    for position, (got, picture_) in enumerate(zip(items, pictures, strict=True)):
        alone = processor(images=[picture_], return_tensors="pt")
        assert torch.equal(got.pixel_values, alone["pixel_values"][0]), position
        assert list(got.grid_thw) == alone["image_sizes"][0].tolist(), position
    with torch.no_grad():
        wanted = model.model.get_image_features(batch["pixel_values"], batch["image_sizes"]).pooler_output
    for position, (embedding, want) in enumerate(zip(encoder.encode(items), wanted, strict=True)):
        assert embedding.tokens.shape == want.shape and relative_error(embedding.tokens, want) <= TOLERANCE, (
            position
        )
    assert [embedding.tokens.shape[0] for embedding in encoder.encode(items)][2] == 1  # the 3 x 3 picture


def test_items_from_numpy_output_and_a_named_family(encoder):
    processor = pixtral_processor()
    pictures = random_pictures(SIZES, seed=1)
    as_tensors = vitpool.items_from(processor(images=pictures, return_tensors="pt"), family="mistral3")
    as_arrays = vitpool.items_from(dict(processor(images=pictures, return_tensors="np")), family="mistral3")
    for array_item, tensor_item in zip(as_arrays, as_tensors, strict=True):
        assert isinstance(array_item.pixel_values, np.ndarray)
        assert torch.equal(
            torch.from_numpy(np.ascontiguousarray(array_item.pixel_values)), tensor_item.pixel_values
        )
    for from_arrays, from_tensors in zip(encoder.encode(as_arrays), encoder.encode(as_tensors), strict=True):
        assert torch.equal(from_arrays.tokens, from_tensors.tokens)


def test_items_from_refuses_what_does_not_add_up():
    pixels, sizes = torch.zeros(2, 3, 8, 8), torch.tensor([[8, 4], [4, 8]])
    with pytest.raises(ValueError, match="image_sizes"):
        vitpool.items_from({"pixel_values": pixels}, family="mistral3")
    with pytest.raises(ValueError, match="2 images; image_sizes has 1 rows"):
        vitpool.items_from({"pixel_values": pixels, "image_sizes": sizes[:1]})
    with pytest.raises(ValueError, match=r"row 1 is \[4, 12\]"):
        vitpool.items_from({"pixel_values": pixels, "image_sizes": torch.tensor([[8, 4], [4, 12]])})
    with pytest.raises(ValueError, match="padded images"):
        vitpool.items_from({"pixel_values": pixels[0], "image_sizes": sizes})
    cut = vitpool.items_from({"pixel_values": pixels, "image_sizes": sizes})
    assert [tuple(one.pixel_values.shape) for one in cut] == [(3, 8, 4), (3, 4, 8)]


# The transformers drop-in: the model's get_image_features answered through vitpool


def test_the_drop_in_answers_get_image_features_and_the_models_forward():
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = hf_model(seed=7)
    images = [picture(8, 12, 40), picture(4, 4, 41), picture(12, 8, 42)]
    pixels, sizes = padded_batch(images)
    num_tokens = 6 + 1 + 6
    image_token = model.config.image_token_index
    input_ids = torch.tensor([[1, 2, *[image_token] * num_tokens, 3, 4]])
    with torch.no_grad():
        wanted = model.model.get_image_features(pixels, sizes).pooler_output
        wanted_logits = model(input_ids=input_ids, pixel_values=pixels, image_sizes=sizes).logits
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    with torch.no_grad():
        got = model.model.get_image_features(pixels, sizes).pooler_output
        logits = model(input_ids=input_ids, pixel_values=pixels, image_sizes=sizes).logits
        # the one-token image alone, which Hugging Face's own get_image_features cannot take
        [single] = model.model.get_image_features(pixels[1:2, :, :4, :4], sizes[1:2]).pooler_output
    for got_tokens, want in zip(got, wanted, strict=True):
        assert relative_error(got_tokens, want) <= TOLERANCE
    assert relative_error(logits, wanted_logits) <= TOLERANCE
    assert relative_error(single, wanted[1]) <= TOLERANCE
    restore_vision_tower(model, original)
    with torch.no_grad():
        assert torch.equal(model.model.get_image_features(pixels, sizes).pooler_output[0], wanted[0])
