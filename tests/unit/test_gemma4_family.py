"""Gemma 4 (`Gemma4VisionModel` + `embed_vision`): the static forward against the Hugging Face
model's own `get_image_features` (fp32, SDPA) on each image alone and on the padded batch the
processor makes; that the processor's padding rows change nothing, in Hugging Face's model and in
vitpool's buffers; the pooler's gather against Hugging Face's pooling by positions; the settings
the releases differ in; loading full checkpoints (as saved, sharded, with vestigial keys) and a
tower-only save; bad items; `vitpool.items_from` on the real `Gemma4ImageProcessorPil`; the
transformers drop-in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases.gemma4 import (
    BAD_ITEMS,
    IMAGE_TOKEN,
    MAX_SIDE,
    PATCH,
    POOL,
    ROW_WIDTH,
    TEXT_WIDTH,
    TINY_TEXT,
    TINY_VISION,
    encoder_module,
    encoder_of,
    grid_positions,
    hf_model,
    image_features,
    padded_batch,
)
from safetensors.torch import load_file, save_file

import vitpool
from vitpool import CheckpointError, ConfigError, GraphEncoder, Image, InvalidItemError
from vitpool.families.gemma4.adapter import Gemma4Adapter, tower_only_config
from vitpool.packing import Budget
from vitpool.specs import BatchPlan

TOLERANCE = 1e-4
BUDGETS = [16, 64, 256]


def item(h: int, w: int, seed: int) -> Image:
    """An image of h x w patches: its patch rows (values in [0, 1], as the processor rescales) and grid."""
    return Image(torch.rand(h * w, ROW_WIDTH, generator=torch.Generator().manual_seed(seed)), (1, h, w))


@pytest.fixture(scope="module")
def model():
    return hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model) -> GraphEncoder:
    return encoder_of(model, BUDGETS)


def assert_matches(model, encoder: GraphEncoder, items: list[Image]) -> None:
    """vitpool's tokens of the items, in one call, against get_image_features of each image alone."""
    for position, (embedding, one) in enumerate(zip(encoder.encode(items), items, strict=True)):
        _, h, w = one.grid_thw
        want = image_features(model, [one])[0]
        assert embedding.tokens.shape == (h * w // POOL**2, TEXT_WIDTH) == want.shape, position
        assert relative_error(embedding.tokens, want) <= TOLERANCE, position


def test_one_image_matches_get_image_features(model, encoder):
    assert_matches(model, encoder, [item(6, 9, seed=1)])


def test_images_of_different_sizes_in_one_call(model, encoder):
    items = [item(6, 9, 2), item(12, 3, 3), item(3, 3, 4), item(15, 12, 5), item(3, 21, 6)]
    # what the model runs: one padded batch of them all
    wanted = image_features(model, items)
    got = encoder.encode(items)
    assert [e.tokens.shape[0] for e in got] == [6, 4, 1, 20, 7]
    for position, (embedding, want) in enumerate(zip(got, wanted, strict=True)):
        assert relative_error(embedding.tokens, want) <= TOLERANCE, position
    # an image larger than any budget (300 tokens: eager, alone) beside a small one
    assert_matches(model, encoder, [item(45, 60, 7), item(3, 6, 8)])


def test_every_budget_matches_get_image_features(model, encoder):
    items = [item(6, 6, 12), item(3, 9, 13)]  # 7 tokens, 63 rows
    specs = tuple(
        encoder.adapter.item_rules.item_spec("image", tuple(i.pixel_values.shape), "float32", i.grid_thw)
        for i in items
    )
    wanted = image_features(model, items)
    for budget in encoder.budgets:
        [outcomes] = encoder.run_plans([(BatchPlan(budget, specs), [i.pixel_values for i in items])], "cpu")
        for embedding, want in zip(outcomes, wanted, strict=True):
            assert relative_error(embedding.tokens, want) <= TOLERANCE, budget


def test_the_processors_padding_changes_nothing_in_hugging_faces_model(model):
    """The claim the adapter rests on: the padded block's length and contents do not reach a real
    token. The same image with no padding rows, with the processor's 630 (70 tokens) and its 2520
    (280 tokens), zero and random padding pixels: the same tokens."""
    one = item(9, 6, 20)
    pixels, positions = one.pixel_values[None], grid_positions(9, 6)[None]
    with torch.no_grad():
        unpadded = model.model.get_image_features(pixels, positions).pooler_output[0]
        for num_rows, fill in ((630, torch.zeros), (630, torch.rand), (2520, torch.rand)):
            padded = torch.cat([pixels, fill(1, num_rows - 54, ROW_WIDTH)], dim=1)
            padded_positions = torch.cat([positions, torch.full((1, num_rows - 54, 2), -1)], dim=1)
            tokens = model.model.get_image_features(padded, padded_positions).pooler_output[0]
            assert relative_error(tokens, unpadded) <= 1e-5, (num_rows, fill)


def test_padding_rows_do_not_change_real_rows(encoder):
    """The same image alone in the smallest and the largest budget with garbage in the padding
    rows' pixels, and beside neighbours: its tokens are the same."""
    adapter = encoder.adapter
    one = item(6, 9, 14)  # 6 tokens
    spec = adapter.item_rules.item_spec("image", (54, ROW_WIDTH), "float32", one.grid_thw)
    alone = {}
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        num_rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(num_rows, ROW_WIDTH) * 100
        batch[:54] = one.pixel_values
        with torch.no_grad():
            tokens = adapter.forward(batch, adapter.build_metadata([spec], num_rows, budget))[0]
        assert torch.isfinite(tokens).all()  # every row is written, padding tokens too
        alone[budget.num_tokens] = tokens[:6]
    crowded = encoder.encode([item(12, 12, 15), one, item(3, 3, 16)])[1].tokens
    first = alone[encoder.budgets[0].num_tokens]
    assert relative_error(alone[encoder.budgets[-1].num_tokens], first) <= TOLERANCE
    assert relative_error(crowded, first) <= TOLERANCE


def test_metadata_of_a_grid_and_its_padding(encoder):
    adapter = encoder.adapter
    budget = Budget(16, (), 4)
    spec = adapter.item_rules.item_spec("image", (54, ROW_WIDTH), "float32", (1, 6, 9))
    metadata = adapter.build_metadata([spec, spec], 144, budget)
    assert metadata["cu_seqlens"].tolist() == [0, 54, 108, 144, 144, 144]
    # (x, y), row-major, each image from (0, 0), as the processor writes them; padding at (-1, -1)
    assert torch.equal(metadata["position_ids"][:54], grid_positions(6, 9))
    assert metadata["position_ids"][:10, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert torch.equal(metadata["position_ids"][54:108], grid_positions(6, 9))
    assert (metadata["position_ids"][108:] == -1).all()
    assert torch.equal(metadata["pool_index"][6:12], metadata["pool_index"][:6] + 54)
    assert metadata["pool_index"][12:].abs().sum() == 0
    with pytest.raises(ValueError, match="the buffers hold"):
        adapter.build_metadata([spec] * 5, 144, budget)


def test_the_pool_index_pools_as_hugging_faces_pooler(model, encoder):
    """Each token's k² gathered rows, averaged, are Hugging Face's pooling by positions of the same
    grid inside a padded block: the same tokens, in the same order."""
    pooler = model.model.vision_tower.pooler
    spec = encoder.adapter.item_rules.item_spec("image", (54, ROW_WIDTH), "float32", (1, 6, 9))
    index = encoder.adapter.build_metadata([spec], 54, Budget(16, (), 1))["pool_index"][:6]
    hidden = torch.randn(54, 8)
    padded = torch.cat([hidden, torch.zeros(9 * 16 - 54, 8)])[None]  # the pooler's input: padding zeroed
    positions = torch.cat([grid_positions(6, 9), torch.full((9 * 16 - 54, 2), -1)])[None]
    pooled, mask = pooler._avg_pool_by_positions(padded, positions, 16)
    assert mask[0].tolist() == [True] * 6 + [False] * 10
    assert torch.allclose(hidden[index].mean(dim=1), pooled[0, :6], atol=1e-6)


@pytest.mark.parametrize(
    "settings",
    [
        {"standardize": False, "use_clipped_linears": False},
        {"standardize": False},
        {"use_clipped_linears": False},
    ],
    ids=["plain", "clipped (E2B, E4B)", "standardized (26B, 31B)"],
)
def test_the_releases_settings_match(settings):
    other = hf_model(seed=5, **settings)
    assert_matches(other, encoder_of(other, [16]), [item(6, 9, 17), item(3, 3, 18)])


def test_the_standardization_and_clipping_buffers_are_read(model, encoder):
    """Neutral statistics and bounds (HF's init) give other tokens: the random ones are in use."""
    one = item(6, 9, 19)
    neutral = encoder_module(model)
    with torch.no_grad():
        neutral.vision_tower.std_bias.zero_()
        neutral.vision_tower.std_scale.fill_(1.0)
    changed = GraphEncoder(Gemma4Adapter(neutral), budgets=[16], device="cpu", dtype=torch.float32)
    assert relative_error(changed.encode([one])[0].tokens, encoder.encode([one])[0].tokens) > 1e-2
    unclipped = encoder_module(model)
    for name, buffer in unclipped.vision_tower.named_buffers():
        if name.endswith(("_min", "_max")):
            buffer.fill_(float("-inf") if name.endswith("_min") else float("inf"))
    changed = GraphEncoder(Gemma4Adapter(unclipped), budgets=[16], device="cpu", dtype=torch.float32)
    assert relative_error(changed.encode([one])[0].tokens, encoder.encode([one])[0].tokens) > 1e-2


def test_settings_without_a_reference_are_refused():
    with pytest.raises(ConfigError, match="pooling_kernel_size 1"):
        Gemma4Adapter(encoder_module(hf_model(pooling_kernel_size=1)))
    with pytest.raises(ConfigError, match="1 key-value heads for 2 heads"):
        Gemma4Adapter(encoder_module(hf_model(num_key_value_heads=1)))


def test_the_tower_type_is_its_own():
    """Gemma 4's tower type is its family's alone (Gemma 3 has SigLIP's), and both the full model's
    type and the tower's name the family (the loading tests below load both kinds of save)."""
    from vitpool.families.gemma3 import RECORD as GEMMA3
    from vitpool.families.gemma4 import RECORD
    from vitpool.models.registry import RECORDS, find_family, record_of

    assert full_vision_type() == "gemma4_vision" and list(RECORD.towers) == ["gemma4_vision"]
    assert "gemma4_vision" not in GEMMA3.towers
    assert [r.name for r in RECORDS if "gemma4_vision" in r.towers] == ["gemma4"]
    assert record_of("gemma4") is record_of("gemma4_vision") is RECORD
    assert find_family("gemma4_vision") is RECORD.towers["gemma4_vision"]


def full_vision_type() -> str:
    from family_cases.gemma4 import full_config

    return full_config().vision_config.model_type


# Loading through GraphEncoder.from_pretrained (the registry's "gemma4_vision" tower).


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(model, loaded: GraphEncoder, seed: int) -> None:
    assert_matches(model, loaded, [item(6, 9, seed), item(3, 3, seed + 1)])


def saved_state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


VISION_PREFIXES = ("model.vision_tower.", "model.embed_vision.")


def test_loads_a_full_model_save(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    assert any(key.startswith("model.vision_tower.") for key in state)
    assert "model.vision_tower.std_bias" in state  # the buffers travel with the weights
    assert any(key.startswith("model.embed_vision.") for key in state)
    assert any(key.startswith("model.language_model.") for key in state)
    assert_loaded(model, load(tmp_path), 20)


def test_loads_a_sharded_full_model_save_opening_only_the_vision_shards(model, tmp_path: Path, monkeypatch):
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    vision_shards = {shard for key, shard in weight_map.items() if key.startswith(VISION_PREFIXES)}
    assert len(set(weight_map.values())) > len(vision_shards) > 1
    from vitpool.models import loading

    opened = []
    real_open = loading.safe_open
    monkeypatch.setattr(
        loading, "safe_open", lambda path, **kw: opened.append(Path(path).name) or real_open(path, **kw)
    )
    assert_loaded(model, load(tmp_path), 22)
    assert set(opened) == vision_shards


def test_vestigial_embedder_tensors_are_dropped(model, tmp_path: Path):
    """Some releases carry Gemma 3n's `embed_vision.embedding.*`, which no Gemma 4 module reads."""
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    state["model.embed_vision.embedding.weight"] = torch.zeros(4, TINY_VISION["hidden_size"])
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_loaded(model, load(tmp_path), 24)


def test_loads_a_tower_only_save(model, tmp_path: Path):
    tower_only_config(model.config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "gemma4_vision" and raw["text_hidden_size"] == TEXT_WIDTH
    save_file(encoder_module(model).state_dict(), str(tmp_path / "model.safetensors"))
    assert_loaded(model, load(tmp_path), 26)


def test_a_missing_or_unexpected_key_is_named(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    del state["model.embed_vision.embedding_projection.weight"]
    state["model.vision_tower.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"embed_vision\.embedding_projection\.weight.*vision_tower\.extra"
    ):
        load(tmp_path)


def test_a_tower_without_gemma4s_model_around_it_is_refused(tmp_path: Path):
    """DiffusionGemma has the same tower type in another model: refused by name, as is a Gemma 4
    tower saved without the embedder's width."""
    from transformers import DiffusionGemmaConfig, Gemma4VisionConfig

    DiffusionGemmaConfig(vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT)).save_pretrained(
        tmp_path / "diffusion"
    )
    with pytest.raises(ValueError, match="'diffusion_gemma' checkpoint is another model"):
        load(tmp_path / "diffusion")
    Gemma4VisionConfig(**TINY_VISION).save_pretrained(tmp_path / "tower")
    with pytest.raises(ValueError, match="text_hidden_size"):
        load(tmp_path / "tower")


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([item(6, 6, 30), bad])
    assert raised.value.index == 1 and words in str(raised.value)


# vitpool.items_from on the real image processor (PIL backend)


def gemma4_processor():
    pytest.importorskip("PIL.Image")
    from transformers import Gemma4ImageProcessorPil

    # the tiny tower's patches; 70 tokens (630 patch rows) an image at most, the smallest setting
    return Gemma4ImageProcessorPil(patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=70)


def random_pictures(sizes: list[tuple[int, int]], seed: int = 0) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


SIZES = [(10, 16), (30, 12), (7, 40), (24, 24)]  # wide, tall, very wide, square: all resized


def test_items_from_cuts_each_image_to_its_patches_and_encodes_as_the_model(model, encoder):
    processor = gemma4_processor()
    pictures = random_pictures(SIZES)
    batch = processor(images=pictures, return_tensors="pt")
    assert batch["pixel_values"].shape[1] == 630 and (batch["image_position_ids"] == -1).any()
    items = vitpool.items_from(batch)  # the keys alone name the family
    assert len(items) == len(pictures)
    for position, (got, picture) in enumerate(zip(items, pictures, strict=True)):
        alone = processor(images=[picture], return_tensors="pt")
        real = (alone["image_position_ids"][0] != -1).all(dim=-1)
        assert torch.equal(got.pixel_values, alone["pixel_values"][0][real]), position
        _, h, w = got.grid_thw
        assert torch.equal(alone["image_position_ids"][0][real], grid_positions(h, w)), position
        assert h * w // POOL**2 == alone["num_soft_tokens_per_image"][0], position
        assert max(h, w) <= MAX_SIDE
    with torch.no_grad():
        wanted = model.model.get_image_features(
            batch["pixel_values"], batch["image_position_ids"]
        ).pooler_output
    embeddings = encoder.encode(items)
    assert len({e.tokens.shape[0] for e in embeddings}) > 1  # images of several sizes
    for position, (embedding, want) in enumerate(zip(embeddings, wanted, strict=True)):
        assert embedding.tokens.shape == want.shape and relative_error(embedding.tokens, want) <= TOLERANCE, (
            position
        )


def test_items_from_numpy_output_and_a_named_family(encoder):
    processor = gemma4_processor()
    pictures = random_pictures(SIZES, seed=1)
    as_tensors = vitpool.items_from(processor(images=pictures, return_tensors="pt"), family="gemma4")
    as_arrays = vitpool.items_from(dict(processor(images=pictures, return_tensors="np")), family="gemma4")
    for array_item, tensor_item in zip(as_arrays, as_tensors, strict=True):
        assert isinstance(array_item.pixel_values, np.ndarray)
        assert torch.equal(
            torch.from_numpy(np.ascontiguousarray(array_item.pixel_values)), tensor_item.pixel_values
        )
    for from_arrays, from_tensors in zip(encoder.encode(as_arrays), encoder.encode(as_tensors), strict=True):
        assert torch.equal(from_arrays.tokens, from_tensors.tokens)


def test_items_from_refuses_what_does_not_add_up():
    one = item(6, 9, 40)
    pixels, positions = padded_batch([one, item(3, 3, 41)])
    with pytest.raises(ValueError, match="image_position_ids"):
        vitpool.items_from({"pixel_values": pixels}, family="gemma4")
    with pytest.raises(ValueError, match=r"image_position_ids has shape \(1, 630, 2\)"):
        vitpool.items_from({"pixel_values": pixels, "image_position_ids": positions[:1]})
    with pytest.raises(ValueError, match="max_patches"):
        vitpool.items_from({"pixel_values": pixels[0], "image_position_ids": positions[0]}, family="gemma4")
    shuffled = positions.clone()
    shuffled[0, :2] = shuffled[0, :2].flip(0)  # two real rows swapped: their pixels sit at other positions
    with pytest.raises(ValueError, match="image_position_ids of image 0 are not the processor's"):
        vitpool.items_from({"pixel_values": pixels, "image_position_ids": shuffled})
    empty = positions.clone()
    empty[1] = -1
    with pytest.raises(ValueError, match="image 1 holds padding rows only"):
        vitpool.items_from({"pixel_values": pixels, "image_position_ids": empty})
    with pytest.raises(ValueError, match="images only"):
        vitpool.items_from(
            {"pixel_values": pixels, "image_position_ids": positions, "pixel_values_videos": pixels}
        )
    cut = vitpool.items_from({"pixel_values": pixels, "image_position_ids": positions})
    assert [tuple(i.grid_thw) for i in cut] == [(1, 6, 9), (1, 3, 3)]
    assert torch.equal(cut[0].pixel_values, one.pixel_values)


# The transformers drop-in: the model's get_image_features answered through vitpool


def test_the_drop_in_answers_get_image_features_and_the_models_forward():
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = hf_model(seed=7)
    items = [item(6, 9, 50), item(3, 3, 51), item(9, 6, 52)]
    pixels, positions = padded_batch(items)
    input_ids = torch.tensor([[1, 2, *[IMAGE_TOKEN] * (6 + 1 + 6), 3, 4]])
    with torch.no_grad():
        wanted = model.model.get_image_features(pixels, positions).pooler_output
        wanted_logits = model(input_ids=input_ids, pixel_values=pixels, image_position_ids=positions).logits
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    with torch.no_grad():
        got = model.model.get_image_features(pixels, positions).pooler_output
        logits = model(input_ids=input_ids, pixel_values=pixels, image_position_ids=positions).logits
    for got_tokens, want in zip(got, wanted, strict=True):
        assert relative_error(got_tokens, want) <= TOLERANCE
    assert relative_error(logits, wanted_logits) <= TOLERANCE
    with pytest.raises(ConfigError, match="get_video_features"):
        model.model.vision_tower(pixel_values=pixels, pixel_position_ids=positions)
    restore_vision_tower(model, original)
    with torch.no_grad():
        assert torch.equal(model.model.get_image_features(pixels, positions).pooler_output[0], wanted[0])
