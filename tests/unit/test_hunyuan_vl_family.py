"""HunYuan-VL (`HunYuanVLVisionTransformer` with its patch merger): the static forward against the
Hugging Face model's own `get_image_features` (fp32, SDPA) on one image, on images of different
sizes in one call and on the batch the model runs, in every budget and padded into a larger one;
the metadata the merger's gathers read; the buffer rows a budget needs; loading full checkpoints
(as saved, sharded, in the model's state_dict layout) and a tower-only save; bad items;
`vitpool.items_from` on the real `HunYuanVLImageProcessorPil`; the transformers drop-in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases.hunyuan_vl import (
    BAD_ITEMS,
    EDGE,
    MERGE,
    PATCH,
    ROW_WIDTH,
    TEXT_WIDTH,
    encoder_of,
    hf_model,
    image_features,
    image_tokens,
)
from safetensors.torch import load_file, save_file

import vitpool
from vitpool import CheckpointError, ConfigError, GraphEncoder, Image, InvalidItemError
from vitpool.kernels.attention import ATTENTION_NAME
from vitpool.packing import Budget
from vitpool.specs import BatchPlan

TOLERANCE = 1e-4
BUDGETS = [16, 32, 64]


def item(h: int, w: int, seed: int) -> Image:
    """An image of h x w patches with fresh random pixels, as the processor lays them out."""
    return Image(torch.randn(h * w, ROW_WIDTH, generator=torch.Generator().manual_seed(seed)), (1, h, w))


@pytest.fixture(scope="module")
def model():
    return hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model) -> GraphEncoder:
    return encoder_of(model, BUDGETS)


def assert_matches(model, encoder: GraphEncoder, items: list[Image]) -> None:
    for position, (embedding, one) in enumerate(zip(encoder.encode(items), items, strict=True)):
        _, h, w = one.grid_thw
        assert embedding.tokens.shape == (image_tokens(h, w), TEXT_WIDTH), position
        assert torch.isfinite(embedding.tokens).all(), position
        assert relative_error(embedding.tokens, image_features(model, one)) <= TOLERANCE, position


def test_one_image_matches_get_image_features(model, encoder):
    assert_matches(model, encoder, [item(4, 6, seed=1)])


def test_images_of_different_sizes_in_one_call(model, encoder):
    # wide, tall, square, one row of blocks, wider and taller than the position table (EDGE)
    items = [item(4, 6, 2), item(8, 2, 3), item(6, 6, 4), item(2, 20, 5), item(12, 10, 6)]
    assert_matches(model, encoder, items)
    # what the model runs: all images in one call, split per image by get_image_features
    pixels = torch.cat([one.pixel_values for one in items])
    grids = torch.tensor([one.grid_thw for one in items])
    with torch.no_grad():
        wanted = model.model.get_image_features(pixels, grids).pooler_output
    for got, want in zip(encoder.encode(items), wanted, strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    # an image larger than any budget (146 tokens: eager, alone) beside a small one
    assert_matches(model, encoder, [item(16, 16, 7), item(2, 2, 8)])


def test_every_budget_matches_get_image_features(model, encoder):
    items = [item(4, 4, 9), item(2, 4, 10)]  # 8 + 5 tokens, 24 rows
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


def test_padding_rows_and_neighbours_do_not_change_an_images_tokens(model, encoder):
    """The same image alone in the smallest and the largest budget with garbage in the padding
    rows' pixels, and beside neighbours: its tokens are HF's."""
    adapter = encoder.adapter
    one = item(4, 6, 11)  # 24 rows, 10 tokens
    spec = adapter.item_rules.item_spec("image", (24, ROW_WIDTH), "float32", one.grid_thw)
    want = image_features(model, one)
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        num_rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(num_rows, ROW_WIDTH) * 100
        batch[:24] = one.pixel_values
        with torch.no_grad():
            [tokens] = adapter.forward(batch, adapter.build_metadata([spec], num_rows, budget))
        assert tokens.shape == (budget.num_tokens, TEXT_WIDTH)
        assert relative_error(tokens[:10], want) <= TOLERANCE, budget
    crowded = encoder.encode([item(6, 4, 12), one, item(2, 2, 13)])[1].tokens
    assert relative_error(crowded, want) <= TOLERANCE


def test_metadata_of_two_grids_and_their_padding(encoder):
    adapter = encoder.adapter
    budget = Budget(32, (), 4)
    num_rows = adapter.max_rows(32)  # 4 * (32 - 3)
    first = adapter.item_rules.item_spec("image", (24, ROW_WIDTH), "float32", (1, 4, 6))  # 2 x 3 blocks
    second = adapter.item_rules.item_spec("image", (8, ROW_WIDTH), "float32", (1, 2, 4))  # 1 x 2 blocks
    assert (first.num_tokens, second.num_tokens) == (10, 5)
    metadata = adapter.build_metadata([first, second], num_rows, budget)
    assert metadata["cu_seqlens"].tolist() == [0, 24, 32, num_rows, num_rows, num_rows]
    # the merger's conv: block (bh, bw) reads rows (bh*2 + i) * w + bw*2 + j, (i, j) its kernel positions
    features = torch.randn(24, 5)
    blocks = features[metadata["merge_index"][:6]].transpose(1, 2).reshape(6, 5, MERGE, MERGE)
    unfolded = (
        features.T.reshape(5, 4, 6).unfold(1, MERGE, MERGE).unfold(2, MERGE, MERGE)
    )  # [5, bh, bw, i, j]
    assert torch.equal(blocks, unfolded.permute(1, 2, 0, 3, 4).reshape(6, 5, MERGE, MERGE))
    # the second image (2 x 4 patches) from row 24
    assert metadata["merge_index"][6:8].tolist() == [[24, 25, 28, 29], [26, 27, 30, 31]]
    assert metadata["merge_index"][8:].abs().sum() == 0
    # tokens: begin, a row of blocks and its newline per row of blocks, end; then the second image
    newline, begin, end = num_rows // 4, num_rows // 4 + 1, num_rows // 4 + 2
    assert metadata["token_index"][:15].tolist() == [
        begin,
        0,
        1,
        2,
        newline,
        3,
        4,
        5,
        newline,
        end,
        begin,
        6,
        7,
        newline,
        end,
    ]
    assert metadata["token_index"][15:].abs().sum() == 0
    # table taps: the padding rows read row 0 with weight 0
    assert metadata["interp_weights"][:32].sum(1).allclose(torch.ones(32))
    assert (
        metadata["interp_weights"][32:].abs().sum() == 0 and metadata["interp_indices"][32:].abs().sum() == 0
    )
    with pytest.raises(ValueError, match="the buffers hold"):
        adapter.build_metadata([first] * 4, num_rows, budget)  # 40 tokens


def test_a_budget_holds_the_rows_of_every_image_that_fits_it(encoder):
    """An image of b blocks gives at least b + 3 tokens: a budget of n tokens takes at most
    4 * (n - 3) rows, and a single row of blocks reaches that bound."""
    adapter = encoder.adapter
    for num_tokens in range(4, 60):
        widest = 0
        for h in range(MERGE, 2 * num_tokens, MERGE):
            for w in range(MERGE, 2 * num_tokens, MERGE):
                if image_tokens(h, w) <= num_tokens:
                    widest = max(widest, h * w)
        assert widest == adapter.max_rows(num_tokens), num_tokens


def test_the_tower_runs_vitpools_packed_attention(encoder):
    """Hugging Face's other attention path splits sequences on the host (`.tolist()`): no graph."""
    layers = encoder.adapter.tower.layers
    assert [layer.self_attn.config._attn_implementation for layer in layers] == [ATTENTION_NAME] * len(layers)


def test_a_bicubic_position_table_matches_too():
    other = hf_model(seed=5, interpolate_mode="bicubic")
    encoder = encoder_of(other, [16, 64])
    assert encoder.adapter.taps == 16
    assert_matches(other, encoder, [item(4, 6, 14), item(12, 10, 15), item(2, 14, 16)])


def test_an_interpolation_vitpool_does_not_run_is_refused():
    with pytest.raises(ConfigError, match="interpolate_mode 'nearest'"):
        encoder_of(hf_model(interpolate_mode="nearest"), [16])


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([item(2, 4, 17), bad])
    assert raised.value.index == 1 and words in str(raised.value)


# Loading through GraphEncoder.from_pretrained (the registry's "hunyuan_vl_vision" tower).


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(model, loaded: GraphEncoder, seed: int) -> None:
    assert loaded.adapter.tower.config.model_type == "hunyuan_vl_vision"
    assert_matches(model, loaded, [item(4, 6, seed), item(10, 2, seed + 1)])


def saved_state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def test_loads_a_full_model_save(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    # transformers writes Tencent's release layout back: `vit.`, `perceive.`, Megatron-style names
    assert "vit.perceive.proj.0.weight" in state and "vit.layers.0.mlp.dense_h_to_4h.weight" in state
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
    state = {key: value.clone() for key, value in model.state_dict().items()}  # lm_head is tied
    assert any(key.startswith("model.vision_tower.patch_merger.") for key in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_loaded(model, load(tmp_path), 24)


def test_loads_a_tower_only_save(model, tmp_path: Path):
    model.model.vision_tower.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "hunyuan_vl_vision" and raw["text_hidden_size"] == TEXT_WIDTH
    assert_loaded(model, load(tmp_path), 26)


def test_a_missing_or_unexpected_key_is_named(model, tmp_path: Path):
    model.save_pretrained(tmp_path)
    state = saved_state(tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    del state["vit.perceive.image_newline"]
    state["vit.perceive.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"patch_merger\.image_newline.*patch_merger\.extra\.weight"):
        load(tmp_path)


# vitpool.items_from on the real image processor (PIL backend)


def processor():
    pytest.importorskip("PIL.Image")
    from transformers import HunYuanVLImageProcessorPil

    return HunYuanVLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, min_pixels=8 * 8, max_pixels=24 * 24
    )


def random_pictures(sizes: list[tuple[int, int]], seed: int = 0) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


# wide, tall, tiny (resized up), square, very wide (wider than the position table: stretched)
SIZES = [(10, 16), (30, 12), (3, 3), (24, 24), (5, 60)]


def test_items_from_gives_each_images_processor_output_and_encodes_as_the_model(model, encoder):
    image_processor = processor()
    pictures = random_pictures(SIZES)
    batch = image_processor(images=pictures, return_tensors="pt")
    grids = batch["image_grid_thw"].tolist()
    assert len({tuple(grid) for grid in grids}) == len(SIZES) and max(w for _, _, w in grids) > EDGE
    items = vitpool.items_from(batch, family="hunyuan_vl")
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


def test_items_from_refuses_what_does_not_add_up():
    with pytest.raises(ValueError, match="image_grid_thw"):
        vitpool.items_from({"pixel_values": torch.zeros(16, ROW_WIDTH)}, family="hunyuan_vl")
    with pytest.raises(ValueError, match="accounts? for 24"):
        vitpool.items_from(
            {"pixel_values": torch.zeros(16, ROW_WIDTH), "image_grid_thw": torch.tensor([[1, 4, 6]])},
            family="hunyuan_vl",
        )


# The transformers drop-in: the model's get_image_features answered through vitpool


def test_the_drop_in_answers_get_image_features_and_the_models_forward():
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = hf_model(seed=7)
    items = [item(4, 6, 40), item(2, 2, 41), item(6, 4, 42)]
    pixels = torch.cat([one.pixel_values for one in items])
    grids = torch.tensor([one.grid_thw for one in items])
    spans = [image_tokens(h, w) for _, h, w in grids.tolist()]
    image_token = model.config.image_token_id
    input_ids = [1, 2]
    for span in spans:
        input_ids += [image_token] * span + [3]
    input_ids = torch.tensor([input_ids])
    token_types = (input_ids == image_token).int()  # the processor's mm_token_type_ids
    inputs = {
        "input_ids": input_ids,
        "pixel_values": pixels,
        "image_grid_thw": grids,
        "mm_token_type_ids": token_types,
    }
    with torch.no_grad():
        wanted = model.model.get_image_features(pixels, grids).pooler_output
        wanted_logits = model(**inputs).logits
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    with torch.no_grad():
        got = model.model.get_image_features(pixels, grids).pooler_output
        logits = model(**inputs).logits
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in wanted]
    for got_tokens, want in zip(got, wanted, strict=True):
        assert relative_error(got_tokens, want) <= TOLERANCE
    assert relative_error(logits, wanted_logits) <= TOLERANCE
    restore_vision_tower(model, original)
    with torch.no_grad():
        assert torch.equal(model.model.get_image_features(pixels, grids).pooler_output[0], wanted[0])
