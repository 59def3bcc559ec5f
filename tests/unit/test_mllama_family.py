"""Llama 3.2 Vision's own checks (the shared ones: test_adapter_conformance.py): an image's tiles and
canvas in, and out the rows of its real tiles of what the model computes from pixel_values to the
projected cross-attention states, for one image, images of unlike canvases in one call, padded
budgets and an image over every budget; what is refused (malformed items by their index); the image
slots a budget runs; loading from tower-only saves, full saves (whole and sharded) and the release's
layout; the real image processor's output cut by `vitpool.items_from`, against the model's own
forward on the whole batch, and what that cut refuses; the transformers drop-in. CPU, fp32, tiny
random model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import mllama as case
from safetensors.torch import save_file

import vitpool
from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError
from vitpool.families.mllama import adapter as mllama_adapter
from vitpool.packing import SEQUENCES

TOLERANCE = 1e-4
TILE_TOKENS = case.TOKENS_PER_TILE
BUDGETS = [TILE_TOKENS * tiles for tiles in (1, 4, 8)]  # one, one and two image slots
WIDTH = case.TINY_TEXT["hidden_size"]


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model):
    return case.encoder_of(model, BUDGETS)


def image(canvas: tuple[int, int], seed: int) -> Image:
    """One image's real tiles [h * w, 3, S, S] of random pixels and its canvas (h, w)."""
    generator = torch.Generator().manual_seed(seed)
    return Image(torch.randn(canvas[0] * canvas[1], *case.ROW_SHAPE, generator=generator), canvas)


def assert_matches(model, items, embeddings) -> list[float]:
    assert len(embeddings) == len(items)
    errors = []
    for item, embedding in zip(items, embeddings, strict=True):
        expected = case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape == (len(item.pixel_values) * TILE_TOKENS, WIDTH)
        assert torch.isfinite(embedding.tokens).all()
        errors.append(relative_error(embedding.tokens, expected))
    assert max(errors) <= TOLERANCE, errors
    return errors


# ---- encoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("canvas", case.ASPECT_RATIOS)
def test_one_image_gives_the_models_cross_attention_states(model, encoder, canvas):
    item = image(canvas, 0)
    assert_matches(model, [item], encoder.encode([item]))


def test_the_padding_tiles_change_the_real_tokens_as_in_the_model(model, encoder):
    """Hugging Face masks padding tiles only for one another: the real tokens attend to them, so what
    they hold changes the real tokens. vitpool runs them as the processor pads them (zeros)."""
    item = image((1, 2), 1)
    inputs = case.processor_layout(item)
    inputs["pixel_values"][0, 0, 2:] = torch.randn(
        2, *case.ROW_SHAPE, generator=torch.Generator().manual_seed(2)
    )
    inner = model.model
    with torch.no_grad():
        states = inner.vision_model(**inputs).last_hidden_state
        other_padding = inner.multi_modal_projector(states)[0, 0, :2].reshape(-1, WIDTH)
    expected = case.image_features(model, item)
    got = encoder.encode([item])[0].tokens
    assert relative_error(got, expected) <= TOLERANCE < relative_error(got, other_padding)


def test_images_of_several_canvases_in_one_call(model, encoder):
    canvases = ((1, 1), (1, 3), (2, 2), (2, 1), (4, 1), (1, 1), (3, 1))
    items = [image(canvas, seed) for seed, canvas in enumerate(canvases)]
    errors = assert_matches(model, items, encoder.encode(items))
    assert len(errors) == len(canvases)


def test_an_image_over_every_budget_runs_eager_alone(model):
    encoder = case.encoder_of(model, [TILE_TOKENS, 2 * TILE_TOKENS])
    items = [image((1, 1), 20), image((2, 2), 21), image((1, 2), 22)]
    assert_matches(model, items, encoder.encode(items))
    assert encoder.stats().eager_batches == 1  # the 4-tile image, at its own size


def test_big_then_small_in_one_budget_leaves_no_stale_rows(model):
    """A budget's buffers reused by a smaller batch after a larger one: the padding tiles and rows
    are written again, so the small image matches the model."""
    encoder = case.encoder_of(model, [8 * TILE_TOKENS])
    big = [image((2, 2), 30), image((1, 4), 31)]
    small = [image((1, 1), 32)]
    assert_matches(model, big, encoder.encode(big))
    assert_matches(model, small, encoder.encode(small))
    assert encoder.stats().replays_per_budget[8 * TILE_TOKENS] == 2


def test_a_budgets_image_slots_bound_its_images(model):
    """A budget runs one image slot (4 tiles of compute) per 4 of its tiles by default:
    four one-tile images do not share a 4-tile budget, they go to the 16-tile one."""
    encoder = case.encoder_of(model, [4 * TILE_TOKENS, 16 * TILE_TOKENS])
    slots = {budget.num_tokens // TILE_TOKENS: budget.limit(SEQUENCES) for budget in encoder.budgets}
    assert slots == {4: 1, 16: 4}
    items = [image((1, 1), 40 + seed) for seed in range(4)]
    assert_matches(model, items, encoder.encode(items))
    assert encoder.stats().replays_per_budget.get(16 * TILE_TOKENS) == 1
    assert encoder.stats().replays_per_budget.get(4 * TILE_TOKENS, 0) == 0
    chosen = case.encoder_of(model, [4 * TILE_TOKENS], capacity_limits={SEQUENCES: 4})
    assert [budget.limit(SEQUENCES) for budget in chosen.budgets] == [4]
    assert_matches(model, items, chosen.encode(items))


def test_default_budgets_are_whole_tiles(model, encoder):
    default = GraphEncoder(encoder.adapter, device="cpu", dtype=torch.float32)
    tokens = [budget.num_tokens for budget in default.budgets]
    assert tokens[0] == TILE_TOKENS and tokens[-1] == mllama_adapter.MAX_GRAPH_TILES * TILE_TOKENS
    assert all(value % TILE_TOKENS == 0 for value in tokens)


def test_malformed_items_are_named_by_their_index_and_the_others_still_encode(model, encoder):
    good = image((1, 2), 50)
    side = case.TILE
    bad_items = (
        (Image(torch.randn(2, 3, side + 2, side + 2), (1, 2)), "must be tiles"),
        (Image(torch.randn(1, 4, 3, side, side), (2, 2)), "must be tiles"),  # the processor's image, padded
        (Image(torch.randn(0, *case.ROW_SHAPE), (1, 1)), "no tiles"),
        (Image(torch.randn(2, *case.ROW_SHAPE)), "needs its canvas"),
        (Image(torch.randn(2, *case.ROW_SHAPE), (2,)), "canvas (h, w) in tiles"),
        (
            Image(torch.randn(4, *case.ROW_SHAPE), (1, 2)),
            "canvas (1, 2) has 2",
        ),  # the processor's padding kept
        (Image(torch.randn(3, *case.ROW_SHAPE), (3, 2)), "not one of the model's aspect ratios"),
        (Image(np.zeros((2, *case.ROW_SHAPE), dtype=np.int64), (1, 2)), "floating-point dtype"),
        (Image([[0.0]], (1, 1)), "torch tensor or NumPy array"),
    )
    for position in (1, 2):
        for bad, words in bad_items:
            batch = [good, good]
            batch.insert(position, bad)
            with pytest.raises(InvalidItemError) as raised:
                encoder.encode(batch)
            assert raised.value.index == position and words in str(raised.value)
    assert_matches(model, [good], encoder.encode([good]))


def test_an_empty_call_encodes_nothing(encoder):
    assert encoder.encode([]) == []


# ---- loading ----------------------------------------------------------------------------------


def test_loads_a_tower_only_save_and_refuses_missing_weights(model, encoder, tmp_path):
    config = mllama_adapter.tower_only_config(model.config)
    assert config.model_type == "mllama_vision_model" and config.text_hidden_size == WIDTH
    config.save_pretrained(tmp_path)
    state = {key: value.contiguous() for key, value in encoder.adapter.tower.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [image((1, 3), 60), image((1, 1), 61)]
    assert_matches(model, items, loaded.encode(items))
    del state["multi_modal_projector.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys.*multi_modal_projector.weight"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


def test_a_vision_config_without_the_llms_width_is_refused(model):
    with pytest.raises(ValueError, match="text_hidden_size"):
        mllama_adapter.build_encoder(model.config.vision_config)


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(model, tmp_path, max_shard_size):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        vision_shards = {shard for key, shard in weight_map.items() if key.startswith("vision_model.")}
        assert len(vision_shards) > 2  # the vision weights span several shards
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert isinstance(encoder.adapter, mllama_adapter.MllamaAdapter)
    items = [image((2, 2), 70), image((2, 1), 71)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_the_in_memory_layout(model, tmp_path):
    """transformers 5 saves the release's keys (`vision_model.`, `multi_modal_projector.`, beside
    `language_model.`); a checkpoint written from the model's own state dict holds them under
    `model.`: both load."""
    model.config.save_pretrained(tmp_path)
    state = {key: value.contiguous() for key, value in model.state_dict().items()}
    assert any(key.startswith("model.vision_model.") for key in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [image((1, 4), 72)]
    assert_matches(model, items, encoder.encode(items))


# ---- the processor's output -------------------------------------------------------------------


def processor():
    from transformers import MllamaImageProcessorPil

    return MllamaImageProcessorPil(
        size={"height": case.TILE, "width": case.TILE}, max_image_tiles=case.MAX_NUM_TILES
    )


def pictures(sizes, seed: int):
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


# per sample, the (height, width) of its images: unlike canvases, and fewer images in the second
SAMPLES = (((16, 16), (20, 50), (64, 15)), ((40, 33),))


def batch_of(return_tensors: str = "pt"):
    return processor()(
        [pictures(sizes, seed) for seed, sizes in enumerate(SAMPLES)], return_tensors=return_tensors
    )


def test_items_from_the_processor_encode_as_the_models_forward_on_the_whole_batch(model, encoder):
    out = batch_of()
    items = vitpool.items_from(out)
    canvases = [tuple(item.grid_thw) for item in items]
    assert len(items) == sum(len(sizes) for sizes in SAMPLES)
    assert [len(item.pixel_values) for item in items] == [n for row in out["num_tiles"] for n in row]
    inner = model.model
    with torch.no_grad():
        states = inner.vision_model(
            pixel_values=out["pixel_values"],
            aspect_ratio_ids=out["aspect_ratio_ids"],
            aspect_ratio_mask=out["aspect_ratio_mask"],
        ).last_hidden_state
        projected = inner.multi_modal_projector(states)
    places = [(sample, image) for sample, sizes in enumerate(SAMPLES) for image in range(len(sizes))]
    for item, embedding, (sample, number), canvas in zip(items, encoder.encode(items), places, canvases):
        tiles = canvas[0] * canvas[1]
        expected = projected[sample, number, :tiles].reshape(-1, WIDTH)
        assert relative_error(embedding.tokens, expected) <= TOLERANCE
    # each item is what the processor gives for that image alone
    for item, (sample, number) in zip(items, places):
        [alone] = vitpool.items_from(
            processor()([pictures(SAMPLES[sample], sample)[number]], return_tensors="pt")
        )
        assert tuple(alone.grid_thw) == tuple(item.grid_thw) and torch.equal(
            alone.pixel_values, item.pixel_values
        )


def test_numpy_output_cuts_as_tensors():
    from_np, from_pt = vitpool.items_from(batch_of("np")), vitpool.items_from(batch_of("pt"))
    assert [tuple(i.grid_thw) for i in from_np] == [tuple(i.grid_thw) for i in from_pt]
    assert all(np.array_equal(a.pixel_values, b.pixel_values.numpy()) for a, b in zip(from_np, from_pt))


def broken(**changes):
    out = dict(batch_of())
    out.update(changes)
    return out


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"aspect_ratio_ids": None}, "no aspect_ratio_ids"),
        ({"pixel_values": torch.zeros(4, 3, case.TILE, case.TILE)}, "[batch, images, tiles"),
        ({"pixel_values": [[0.0]]}, "return_tensors='pt'"),
        ({"aspect_ratio_ids": torch.tensor([[1, 3, 6]])}, "[batch, images] = [2, 3]"),
        ({"aspect_ratio_ids": torch.tensor([[1, 3, 9], [6, 0, 0]])}, "aspect ratio id 9 is not one of 1..8"),
        ({"aspect_ratio_ids": torch.tensor([[1, 0, 6], [6, 0, 0]])}, "padding images (id 0) come after"),
        ({"aspect_ratio_ids": torch.tensor([[1, 2, 6], [6, 0, 0]])}, "image 1 of sample 0 (item 1)"),
        ({"aspect_ratio_mask": torch.ones(2, 3, 4, dtype=torch.int64)}, "does not mark the 1 tiles"),
        ({"aspect_ratio_mask": torch.ones(2, 3, dtype=torch.int64)}, "aspect_ratio_mask must be [batch"),
        ({"num_tiles": [[1, 3, 4], [3]]}, "num_tiles [3] of sample 1 disagrees"),
    ],
)
def test_a_batch_that_does_not_add_up_is_refused_naming_what(changes, words):
    with pytest.raises(ValueError) as raised:
        vitpool.items_from({key: value for key, value in broken(**changes).items() if value is not None})
    assert words in str(raised.value)


def test_the_full_processors_output_cuts_without_num_tiles():
    """`MllamaProcessor` drops `num_tiles` and adds the prompt's keys: the ids and mask suffice."""
    out = {key: value for key, value in batch_of().items() if key != "num_tiles"}
    out.update(input_ids=torch.zeros(2, 5, dtype=torch.int64), cross_attention_mask=torch.zeros(2, 5, 3, 4))
    assert [tuple(i.grid_thw) for i in vitpool.items_from(out)] == [
        tuple(i.grid_thw) for i in vitpool.items_from(batch_of())
    ]


# ---- the transformers drop-in -----------------------------------------------------------------


def test_the_drop_in_answers_the_models_forward_through_vitpool():
    """`replace_vision_tower(model, encoder)`: the model's forward gets its cross-attention states from
    vitpool image by image, and its logits stay; then put back."""
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = case.hf_model(seed=8)
    with torch.no_grad():  # open the cross-attention gates (zero at init): the images reach the logits
        for name, parameter in model.model.language_model.named_parameters():
            if "cross_attn_attn_gate" in name or "cross_attn_mlp_gate" in name:
                parameter.fill_(1.0)
    out = batch_of()
    image_token = (
        3  # the processor's <|image|> is outside the tiny vocabulary; the masks say where images are
    )
    input_ids = torch.tensor([[image_token, image_token, image_token, 5, 6, 7], [image_token, 5, 6, 7, 8, 9]])
    # each text token after an image attends to that image's real tiles
    cross = torch.zeros(2, 6, 3, case.MAX_NUM_TILES, dtype=torch.int64)
    for sample, row in enumerate(out["num_tiles"]):
        for number, tiles in enumerate(row):
            cross[sample, number:, number, :tiles] = 1
    inputs = {
        "input_ids": input_ids,
        "pixel_values": out["pixel_values"],
        "aspect_ratio_ids": out["aspect_ratio_ids"],
        "aspect_ratio_mask": out["aspect_ratio_mask"],
        "cross_attention_mask": cross,
    }
    with torch.no_grad():
        want = model(**inputs).logits
        other = model(**{**inputs, "pixel_values": inputs["pixel_values"].flip(-1)}).logits
    assert relative_error(other, want) > 100 * TOLERANCE  # the logits read the images
    tower, projector = model.model.vision_model, model.model.multi_modal_projector
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    try:
        with torch.no_grad():
            got = model(**inputs).logits
    finally:
        restore_vision_tower(model, original)
    assert model.model.vision_model is tower and model.model.multi_modal_projector is projector
    assert got.shape == want.shape and relative_error(got, want) <= TOLERANCE
