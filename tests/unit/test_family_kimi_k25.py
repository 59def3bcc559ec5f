"""Kimi-K2.5 (`Kimi_K25VisionModel` + `mm_projector`): the static forward against the Hugging Face
model's own `get_image_features` on each item alone (fp32); clips against the tower + projector run
directly (transformers 5.23's `get_video_features` splits its output by t*h*w/4 after pooling the
frames, which fails for t > 1); loading from a tower-only save and the full checkpoint's weights;
the family's bad inputs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from family_cases.kimi_k25 import BAD_ITEMS, ROW_SHAPE, full_config, randomize, reference_tokens
from safetensors.torch import load_file, save_file

from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError, Video
from vitpool.models.kimi_k25 import KimiK25Adapter, KimiK25Encoder, encoder_state, tower_only_config
from vitpool.models.kimi_k25_rules import EXTRA_ROWS
from vitpool.models.registry import find_family

TOLERANCE = 1e-5
BUDGETS = [16, 32, 64]



def pixels(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, *ROW_SHAPE, generator=torch.Generator().manual_seed(seed))


def image(h: int, w: int, seed: int) -> Image:
    return Image(pixels(h * w, seed), (1, h, w))


def video(t: int, h: int, w: int, seed: int) -> Video:
    return Video(pixels(t * h * w, seed), (t, h, w))


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Kimi_K25ForConditionalGeneration

    model = Kimi_K25ForConditionalGeneration(full_config())
    randomize(model.model.vision_tower, 0)
    randomize(model.model.mm_projector, 1)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def encoder_of(hf_model, row_factor: int = 2) -> GraphEncoder:
    module = KimiK25Encoder(copy.deepcopy(hf_model.model.vision_tower), copy.deepcopy(hf_model.model.mm_projector))
    return GraphEncoder(KimiK25Adapter(module, row_factor), budgets=BUDGETS, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def encoder(hf_model) -> GraphEncoder:
    return encoder_of(hf_model)


def image_features(hf_model, item: Image) -> torch.Tensor:
    grid = torch.as_tensor(item.grid_thw).reshape(1, 3)
    with torch.no_grad():
        [tokens] = hf_model.model.get_image_features(item.pixel_values, grid).pooler_output
    return tokens


def test_one_image_matches_get_image_features(hf_model, encoder):
    item = image(6, 8, seed=1)
    [embedding] = encoder.encode([item])
    assert embedding.tokens.shape == (12, 48)
    assert relative_error(embedding.tokens, image_features(hf_model, item)) <= TOLERANCE


def test_images_of_different_sizes_in_one_call(hf_model, encoder):
    items = [image(4, 4, 2), image(2, 8, 3), image(8, 6, 4), image(2, 2, 5), image(10, 4, 6)]
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        assert relative_error(embedding.tokens, image_features(hf_model, item)) <= TOLERANCE


def test_videos_match_the_tower_and_projector(hf_model, encoder):
    items = [video(2, 4, 4, 7), image(4, 6, 8), video(3, 2, 4, 9), video(4, 4, 2, 10)]
    module = KimiK25Encoder(hf_model.model.vision_tower, hf_model.model.mm_projector)
    before = encoder.stats().eager_batches
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        h, w = item.grid_thw[1:]
        assert embedding.tokens.shape == (h * w // 4, 48)
        assert relative_error(embedding.tokens, reference_tokens(module, item)) <= TOLERANCE
    assert encoder.stats().eager_batches == before  # clips ran in budgets (row_factor 2), not alone


def test_a_single_frame_video_matches_get_video_features(hf_model, encoder):
    item = video(1, 4, 6, 11)
    with torch.no_grad():
        [expected] = hf_model.model.get_video_features(item.pixel_values, torch.tensor([item.grid_thw])).pooler_output
    assert relative_error(encoder.encode([item])[0].tokens, expected) <= TOLERANCE


def test_images_only_buffers_run_clips_eager(hf_model):
    encoder = encoder_of(hf_model, row_factor=1)
    assert all(budget.limit(EXTRA_ROWS) == 0 for budget in encoder.budgets)
    module = KimiK25Encoder(hf_model.model.vision_tower, hf_model.model.mm_projector)
    clip, still = video(2, 4, 4, 12), image(4, 4, 13)
    got = encoder.encode([clip, still])
    assert relative_error(got[0].tokens, reference_tokens(module, clip)) <= TOLERANCE
    assert relative_error(got[1].tokens, image_features(hf_model, still)) <= TOLERANCE
    assert encoder.stats().eager_batches == 1


def test_loads_a_tower_only_save(hf_model, tmp_path: Path):
    module = KimiK25Encoder(hf_model.model.vision_tower, hf_model.model.mm_projector)
    tower_only_config(hf_model.config).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "kimi_k25_vision"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(tmp_path / "model.safetensors"))
    assert find_family("kimi_k25_vision") is not None
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    item = image(4, 6, 14)
    assert relative_error(loaded.encode([item])[0].tokens, image_features(hf_model, item)) <= TOLERANCE


def test_full_checkpoint_weights_convert_to_the_encoder(hf_model, tmp_path: Path):
    """A full save keeps Moonshot's key layout (fused wqkv, vision_tower.encoder.blocks, ...);
    `encoder_state` converts it as transformers does on load."""
    hf_model.save_pretrained(tmp_path)
    checkpoint = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        checkpoint.update(load_file(str(file)))
    assert any(key.startswith("vision_tower.encoder.blocks.") for key in checkpoint)
    module = KimiK25Encoder(copy.deepcopy(hf_model.model.vision_tower), copy.deepcopy(hf_model.model.mm_projector))
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.zero_()
    module.load_state_dict(encoder_state(checkpoint, hf_model.config.vision_config.num_attention_heads), strict=True)
    encoder = GraphEncoder(KimiK25Adapter(module.eval()), budgets=BUDGETS, device="cpu", dtype=torch.float32)
    item = image(6, 4, 15)
    assert relative_error(encoder.encode([item])[0].tokens, image_features(hf_model, item)) <= TOLERANCE


def test_loads_a_full_model_save(hf_model, tmp_path: Path):
    """`save_pretrained` writes Moonshot's layout (fused wqkv, `vision_tower.encoder.blocks`)."""
    hf_model.save_pretrained(tmp_path)
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    item = image(4, 4, 16)
    assert relative_error(loaded.encode([item])[0].tokens, image_features(hf_model, item)) <= TOLERANCE


def full_save_in_transformers_layout(hf_model, directory: Path, drop: str = "", add: str = "") -> Path:
    """A full checkpoint keyed as the loaded model names its tensors (`model.vision_tower.layers...`),
    the text model's tensors included, less the key `drop` and plus a key `add`."""
    hf_model.config.save_pretrained(directory)
    state = {key: value.contiguous() for key, value in hf_model.state_dict().items() if key != drop}
    state.pop("lm_head.weight", None)  # tied to the embeddings: safetensors keeps one of them
    if add:
        state[add] = torch.zeros(2)
    save_file(state, str(directory / "model.safetensors"))
    return directory


def test_loads_a_full_model_in_transformers_layout(hf_model, tmp_path: Path):
    directory = full_save_in_transformers_layout(hf_model, tmp_path)
    loaded = GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    item = image(6, 6, 17)
    assert relative_error(loaded.encode([item])[0].tokens, image_features(hf_model, item)) <= TOLERANCE


def test_a_full_model_with_a_missing_or_unexpected_key_is_refused(hf_model, tmp_path: Path):
    missing = full_save_in_transformers_layout(hf_model, tmp_path / "missing", drop="model.mm_projector.out_proj.bias")
    with pytest.raises(CheckpointError, match=r"missing keys \['mm_projector.out_proj.bias'\]"):
        GraphEncoder.from_pretrained(missing, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    extra = full_save_in_transformers_layout(hf_model, tmp_path / "extra", add="model.vision_tower.layers.9.extra")
    with pytest.raises(CheckpointError, match=r"unexpected keys \['vision_tower.layers.9.extra'\]"):
        GraphEncoder.from_pretrained(extra, budgets=BUDGETS, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([image(4, 4, 17), bad])
    assert raised.value.index == 1 and words in str(raised.value)


def test_capacity_limit_beyond_the_buffers_is_refused(encoder):
    rules = encoder.adapter.item_rules
    with pytest.raises(ValueError, match="extra rows"):
        rules.budgets(BUDGETS, None, {EXTRA_ROWS: 10_000})
    with pytest.raises(ValueError, match="bounds no 'sequences'"):
        rules.budgets(BUDGETS, None, {"sequences": 4})


def test_a_tower_whose_parts_moved_fails_at_once_naming_the_transformers_version(hf_model):
    """The adapter runs the tower's parts itself (its compatibility seam); a release that renames
    one fails when the adapter is built, with the installed and the tested versions named."""
    import transformers

    from vitpool import ConfigError

    tower = copy.deepcopy(hf_model.model.vision_tower)
    tower.rotary_embedding = tower.rotary_emb  # as a rename would leave it
    del tower.rotary_emb
    module = KimiK25Encoder(tower, copy.deepcopy(hf_model.model.mm_projector))
    expected = rf"Kimi-K2.5: transformers {transformers.__version__} .*'rotary_emb'.*tested with transformers"
    with pytest.raises(ConfigError, match=expected):
        KimiK25Adapter(module)
