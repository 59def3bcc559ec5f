"""PaddleOCR-VL (`PaddleOCRVisionModel` + `PaddleOCRProjector`): the static forward against the
Hugging Face model's own `get_image_features` on each image alone (fp32); loading from a tower-only
save, a full-model save (which transformers writes in PaddlePaddle's release layout, `visual.` and
`mlp_AR.`), transformers' in-memory layout (`model.visual.`, `model.projector.`) and the release
layout with the keys transformers ignores; key errors and the family's bad inputs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from family_cases.paddleocr_vl import BAD_ITEMS, ROW_SHAPE, full_config, randomize
from safetensors.torch import load_file, save_file

from vitpool import GraphEncoder, Image, InvalidItemError
from vitpool.errors import CheckpointError
from vitpool.families.paddleocr_vl.adapter import (
    PaddleOCREncoder,
    PaddleOCRVLAdapter,
    build_encoder,
    convert_checkpoint,
    tower_only_config,
)
from vitpool.packing import Budget
from vitpool.specs import BatchPlan

TOLERANCE = 1e-5
BUDGETS = [16, 32, 64]


def pixels(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, *ROW_SHAPE, generator=torch.Generator().manual_seed(seed))


def image(h: int, w: int, seed: int) -> Image:
    return Image(pixels(h * w, seed), (1, h, w))


@pytest.fixture(scope="module")
def hf_model():
    from transformers import PaddleOCRVLForConditionalGeneration

    model = PaddleOCRVLForConditionalGeneration(full_config())
    randomize(model.model.visual, 0)
    randomize(model.model.projector, 1)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def encoder_module(hf_model) -> PaddleOCREncoder:
    return PaddleOCREncoder(copy.deepcopy(hf_model.model.visual), copy.deepcopy(hf_model.model.projector))


@pytest.fixture(scope="module")
def encoder(hf_model) -> GraphEncoder:
    return GraphEncoder(
        PaddleOCRVLAdapter(encoder_module(hf_model)), budgets=BUDGETS, device="cpu", dtype=torch.float32
    )


def image_features(hf_model, item: Image) -> torch.Tensor:
    grid = torch.as_tensor(item.grid_thw).reshape(1, 3)
    with torch.no_grad():
        [tokens] = hf_model.model.get_image_features(item.pixel_values, grid).pooler_output
    return tokens


def assert_matches(hf_model, encoder: GraphEncoder, items: list[Image]) -> None:
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        _, h, w = item.grid_thw
        assert embedding.tokens.shape == (h * w // 4, 48)
        assert relative_error(embedding.tokens, image_features(hf_model, item)) <= TOLERANCE


def test_one_image_matches_get_image_features(hf_model, encoder):
    assert_matches(hf_model, encoder, [image(6, 8, seed=1)])


def test_images_of_different_sizes_in_one_call(hf_model, encoder):
    items = [image(4, 4, 2), image(2, 8, 3), image(8, 6, 4), image(2, 2, 5), image(10, 4, 6)]
    assert_matches(hf_model, encoder, items)
    # a grid larger than the 8 x 8 position table (resampled up) and one larger than any budget (eager, alone)
    assert_matches(hf_model, encoder, [image(12, 10, 7), image(20, 16, 8)])


def test_every_budget_matches_get_image_features(hf_model, encoder):
    items = [image(4, 6, 9), image(2, 4, 10)]  # 8 tokens, 32 rows
    for budget in encoder.budgets:
        item_pixels = [torch.as_tensor(item.pixel_values) for item in items]
        specs = tuple(
            encoder.adapter.item_rules.item_spec("image", tuple(p.shape), "float32", item.grid_thw)
            for item, p in zip(items, item_pixels)
        )
        [outcomes] = encoder.run_plans([(BatchPlan(budget, specs), item_pixels)], "cpu")
        for item, embedding in zip(items, outcomes, strict=True):
            assert relative_error(embedding.tokens, image_features(hf_model, item)) <= TOLERANCE, budget


def test_padding_rows_do_not_change_real_rows(encoder):
    """The same image alone in the smallest and the largest budget, and beside neighbours, with
    garbage in the padding rows' pixels: its tokens are the same."""
    adapter = encoder.adapter
    item = image(4, 6, 11)
    spec = adapter.item_rules.item_spec("image", (24, *ROW_SHAPE), "float32", (1, 4, 6))
    alone = {}
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(rows, *ROW_SHAPE) * 100  # padding rows hold garbage
        batch[:24] = item.pixel_values
        metadata = adapter.build_metadata([spec], rows, budget)
        with torch.no_grad():
            alone[budget.num_tokens] = adapter.forward(batch, metadata)[0][: spec.num_tokens]
    neighbour = image(8, 8, 12)
    crowded = encoder.encode([neighbour, item, image(2, 2, 13)])[1].tokens
    first = alone[encoder.budgets[0].num_tokens]
    assert relative_error(alone[encoder.budgets[-1].num_tokens], first) <= TOLERANCE
    assert relative_error(crowded, first) <= TOLERANCE


def test_metadata_of_padding_is_valid(encoder):
    adapter = encoder.adapter
    budget = Budget(16, (), 4)
    spec = adapter.item_rules.item_spec("image", (16, *ROW_SHAPE), "float32", (1, 4, 4))
    metadata = adapter.build_metadata([spec], 64, budget)
    assert metadata["cu_seqlens"].tolist() == [0, 16, 64, 64, 64, 64]
    assert metadata["interp_weights"][16:].abs().sum() == 0
    # token 0 takes rows (0, 1, 4, 5) of the 4 x 4 grid; padding tokens take row 0
    assert metadata["merge_index"][0].tolist() == [0, 1, 4, 5]
    assert metadata["merge_index"][3].tolist() == [10, 11, 14, 15]
    assert metadata["merge_index"][4:].abs().sum() == 0
    with pytest.raises(ValueError, match="the buffers hold"):
        adapter.build_metadata([spec] * 5, 64, budget)


def test_build_encoder_needs_the_llm_width():
    with pytest.raises(ValueError, match="text_hidden_size"):
        build_encoder(full_config().vision_config)
    encoder = build_encoder(tower_only_config(full_config()), torch.bfloat16)
    assert encoder.projector.linear_2.weight.dtype == torch.bfloat16
    assert encoder.projector.linear_2.out_features == 48


def test_tower_only_config_round_trips(tmp_path: Path):
    from transformers import AutoConfig

    tower_only_config(full_config()).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "paddleocr_vl_vision" and raw["text_hidden_size"] == 48
    assert AutoConfig.from_pretrained(tmp_path).text_hidden_size == 48


def test_convert_checkpoint_layouts(hf_model):
    own = encoder_module(hf_model).state_dict()
    assert convert_checkpoint(dict(own), None).keys() == own.keys()
    transformers_layout = {
        key: value
        for key, value in hf_model.state_dict().items()
        if key.startswith(("model.visual.", "model.projector."))
    }
    assert convert_checkpoint(transformers_layout, None).keys() == own.keys()
    release = {
        key.replace("model.visual.", "visual.").replace("model.projector.", "mlp_AR."): value
        for key, value in transformers_layout.items()
    }
    release["visual.vision_model.head.probe"] = torch.zeros(1)
    release["visual.vision_model.embeddings.packing_position_embedding.weight"] = torch.zeros(1)
    assert convert_checkpoint(release, None).keys() == own.keys()


# Loading through GraphEncoder.from_pretrained (the registry's "paddleocr_vl_vision" family).


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(hf_model, loaded: GraphEncoder, seed: int) -> None:
    item = image(4, 6, seed)
    assert relative_error(loaded.encode([item])[0].tokens, image_features(hf_model, item)) <= TOLERANCE


def save_tower_only(hf_model, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    tower_only_config(hf_model.config).save_pretrained(directory)
    if state is None:
        state = encoder_module(hf_model).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))


def full_model_save(hf_model, directory: Path) -> dict[str, torch.Tensor]:
    hf_model.save_pretrained(directory)
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def test_loads_a_tower_only_save(hf_model, tmp_path: Path):
    save_tower_only(hf_model, tmp_path)
    assert_loaded(hf_model, load(tmp_path), 14)


def test_loads_a_full_model_save(hf_model, tmp_path: Path):
    state = full_model_save(hf_model, tmp_path)
    # transformers writes PaddlePaddle's release layout back (conversion_mapping.py, "paddleocr_vl")
    assert any(key.startswith("mlp_AR.") for key in state) and any(key.startswith("visual.") for key in state)
    assert_loaded(hf_model, load(tmp_path), 15)


def test_loads_transformers_in_memory_layout(hf_model, tmp_path: Path):
    """A full checkpoint whose keys are the model's own state_dict (`model.visual.`, `model.projector.`)."""
    hf_model.config.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in hf_model.state_dict().items()}  # lm_head is tied to the embeddings
    assert any(key.startswith("model.projector.") for key in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_loaded(hf_model, load(tmp_path), 16)


def test_loads_the_release_layout_ignoring_what_transformers_ignores(hf_model, tmp_path: Path):
    state = full_model_save(hf_model, tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    state["visual.vision_model.head.x"] = torch.zeros(2)
    state["visual.vision_model.embeddings.packing_position_embedding.weight"] = torch.zeros(4, 32)
    state["packing_position_embedding.weight"] = torch.zeros(4, 32)
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_loaded(hf_model, load(tmp_path), 17)


def test_a_missing_key_is_named(hf_model, tmp_path: Path):
    state = encoder_module(hf_model).state_dict()
    del state["projector.linear_1.bias"]
    save_tower_only(hf_model, tmp_path, state)
    with pytest.raises(CheckpointError, match=r"projector\.linear_1\.bias"):
        load(tmp_path)


def test_an_unexpected_key_is_named(hf_model, tmp_path: Path):
    state = full_model_save(hf_model, tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    state["mlp_AR.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"projector\.extra\.weight"):
        load(tmp_path)


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([image(4, 4, 18), bad])
    assert raised.value.index == 1 and words in str(raised.value)


def test_no_capacity_limits(encoder):
    rules = encoder.adapter.item_rules
    assert rules.capacities == ()
    with pytest.raises(ValueError, match="bounds no 'sequences'"):
        rules.budgets(BUDGETS, None, {"sequences": 4})
