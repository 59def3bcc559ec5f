"""Kimi-K2.5 (`Kimi_K25VisionModel` + `mm_projector`): the static forward against the Hugging Face
model's own `get_image_features` on each item alone (fp32); clips against the tower + projector run
directly (transformers 5.23's `get_video_features` splits its output by t*h*w/4 after pooling the
frames, which fails for t > 1); the clip path (its own budgets and buffers of 4 frames' rows per
token, graphs for clips while image batches keep kh*kw rows per token), checked per budget as the
conformance suite checks a family; loading from a tower-only save and the full checkpoint's
weights; the family's bad inputs."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import random
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from family_cases.kimi_k25 import BAD_ITEMS, ROW_SHAPE, full_config, randomize, reference_tokens
from safetensors.torch import load_file, save_file

from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError, Video
from vitpool.families.kimi_k25.adapter import KimiK25Adapter, KimiK25Encoder, encoder_state, tower_only_config
from vitpool.families.kimi_k25.rules import CLIP, EXTRA_ROWS, KimiK25Rules
from vitpool.items import prepare_item
from vitpool.models.registry import find_family
from vitpool.packing import Budget
from vitpool.specs import BatchPlan

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


def encoder_of(hf_model, clip_frames: int | None = None) -> GraphEncoder:
    module = KimiK25Encoder(
        copy.deepcopy(hf_model.model.vision_tower), copy.deepcopy(hf_model.model.mm_projector)
    )
    return GraphEncoder(
        KimiK25Adapter(module, clip_frames), budgets=BUDGETS, device="cpu", dtype=torch.float32
    )


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


def tower_and_projector(hf_model) -> KimiK25Encoder:
    return KimiK25Encoder(hf_model.model.vision_tower, hf_model.model.mm_projector)


def test_clips_have_a_path_of_their_own_over_the_one_tower(encoder):
    adapter = encoder.adapter
    image_path, clip_path = adapter.paths[""], adapter.paths[CLIP]
    assert image_path.tower is clip_path.tower is adapter.tower  # one module: no copy of the weights
    # an image batch keeps kh*kw = 4 rows per token and pools one frame; a clip batch holds 4 frames
    assert [image_path.max_rows(n) for n in BUDGETS] == [4 * n for n in BUDGETS]
    assert clip_path.max_rows(16) == 16 * 16
    assert image_path.metadata_specs(64, encoder.budgets[0])["pool_index"].shape == (16, 1, 4)
    # clip budgets up to the largest image budget's rows: 64 tokens // 4 frames
    clip_budgets = [budget for budget in encoder.budgets if budget.path == CLIP]
    assert clip_budgets == [Budget(16, ((EXTRA_ROWS, 3 * 4 * 16),), 16, CLIP)]
    assert all(budget.limit(EXTRA_ROWS) == 0 for budget in encoder.budgets if budget.path == "")
    rules = adapter.item_rules
    routes = (
        (image(4, 4, 1), ""),
        (video(1, 4, 4, 2), ""),
        (video(2, 4, 4, 3), CLIP),
        (video(4, 2, 2, 4), CLIP),
    )
    for item, path in routes:
        spec = prepare_item(0, item, rules).spec  # as a caller's process sizes it
        assert spec.path == path
        # an actor derives a spec again from its own layout
        assert rules.item_spec(spec.modality, spec.pixel_shape, spec.pixel_dtype, spec.layout) == spec
    unpickled = pickle.loads(pickle.dumps(rules))
    assert unpickled == rules and sorted(unpickled.budgets(BUDGETS, None, {})) == encoder.budgets


def test_images_and_clips_of_one_to_four_frames_in_one_call_match(hf_model, encoder):
    items = [
        video(2, 4, 4, 7),
        image(4, 6, 8),
        video(3, 2, 4, 9),
        video(4, 4, 2, 10),
        video(1, 4, 4, 11),
        image(8, 8, 12),
        video(4, 4, 4, 13),
        image(2, 2, 14),
    ]
    before = encoder.stats()
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        h, w = item.grid_thw[1:]
        assert embedding.tokens.shape == (h * w // 4, 48)
        assert (
            relative_error(embedding.tokens, reference_tokens(tower_and_projector(hf_model), item))
            <= TOLERANCE
        )
    after = encoder.stats()
    assert after.eager_batches == before.eager_batches  # every clip ran in a clip budget, none alone


def test_four_frame_clips_replay_the_clip_budgets(hf_model, encoder):
    """Images of 48 tokens go to the image budget of 64; three 4-frame clips of 4 tokens (192 rows:
    three times what an image budget of 16 tokens holds) to the clip budget of 16."""
    clips = [video(4, 4, 4, 20 + seed) for seed in range(3)]
    stills = [image(8, 8, 30 + seed) for seed in range(3)]
    before = encoder.stats()
    got = encoder.encode([clips[0], stills[0], clips[1], stills[1], clips[2], stills[2]])
    after = encoder.stats()
    assert after.eager_batches == before.eager_batches
    replays = {n: after.replays_per_budget.get(n, 0) - before.replays_per_budget.get(n, 0) for n in BUDGETS}
    assert replays == {16: 1, 32: 0, 64: 1}
    module = tower_and_projector(hf_model)
    for item, embedding in zip(
        [clips[0], stills[0], clips[1], stills[1], clips[2], stills[2]], got, strict=True
    ):
        assert relative_error(embedding.tokens, reference_tokens(module, item)) <= TOLERANCE


@pytest.mark.parametrize("path", ["", CLIP])
def test_every_budget_of_each_path_matches_on_sampled_items(hf_model, encoder, path):
    """The conformance suite's check, for both paths: random valid items of the path's adapter,
    planned into each of its budgets, against the reference, item by item."""
    adapter = encoder.adapter.paths[path]
    module = tower_and_projector(hf_model)
    for number, budget in enumerate(b for b in encoder.budgets if b.path == path):
        specs = adapter.sample_specs(adapter.max_rows(budget.num_tokens), budget, random.Random(number))
        assert specs and all(spec.path == path for spec in specs)
        assert (max(spec.layout[0] for spec in specs) > 1) == (path == CLIP)
        generator = torch.Generator().manual_seed(number)
        pixels = [torch.randn(spec.pixel_shape, generator=generator) for spec in specs]
        [outcomes] = encoder.run_plans([(BatchPlan(budget, tuple(specs)), pixels)], "cpu")
        for spec, item_pixels, embedding in zip(specs, pixels, outcomes, strict=True):
            item = (Video if spec.layout[0] > 1 else Image)(item_pixels, spec.layout)
            want = reference_tokens(module, item)
            assert relative_error(embedding.tokens, want) <= TOLERANCE


def test_a_spec_that_hides_its_clip_on_the_image_path_fails_its_batch(encoder):
    clip = video(2, 4, 4, 40)
    spec = prepare_item(0, clip, encoder.adapter.item_rules).spec
    hidden = dataclasses.replace(spec, path="")
    image_budget = next(budget for budget in encoder.budgets if budget.path == "")
    with pytest.raises(ValueError):
        encoder.run_plans([(BatchPlan(image_budget, (hidden,)), [clip.pixel_values])], "cpu")


def test_a_clip_larger_than_the_clip_budgets_runs_eager_alone(hf_model, encoder):
    clip = video(4, 8, 10, 41)  # 20 tokens: the clip budgets hold 16
    before = encoder.stats().eager_batches
    [embedding] = encoder.encode([clip])
    assert encoder.stats().eager_batches == before + 1
    assert (
        relative_error(embedding.tokens, reference_tokens(tower_and_projector(hf_model), clip)) <= TOLERANCE
    )


def test_clip_frames_outside_the_time_table_are_refused(hf_model):
    module = tower_and_projector(hf_model)
    for clip_frames in (0, 5):
        with pytest.raises(ValueError, match="clip_frames"):
            KimiK25Adapter(module, clip_frames)
    with pytest.raises(ValueError, match="clip_frames 1"):
        KimiK25Rules(3, 2, (2, 2), 4, 48, clip_frames=1).budgets(BUDGETS, None, {EXTRA_ROWS: 4})


def test_a_single_frame_video_matches_get_video_features(hf_model, encoder):
    item = video(1, 4, 6, 11)
    with torch.no_grad():
        [expected] = hf_model.model.get_video_features(
            item.pixel_values, torch.tensor([item.grid_thw])
        ).pooler_output
    assert relative_error(encoder.encode([item])[0].tokens, expected) <= TOLERANCE


def test_without_a_clip_path_clips_run_eager(hf_model):
    encoder = encoder_of(hf_model, clip_frames=1)
    assert set(encoder.adapter.paths) == {""}
    assert all(budget.limit(EXTRA_ROWS) == 0 and budget.path == "" for budget in encoder.budgets)
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
    save_file(
        {k: v.contiguous() for k, v in module.state_dict().items()}, str(tmp_path / "model.safetensors")
    )
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
    module = KimiK25Encoder(
        copy.deepcopy(hf_model.model.vision_tower), copy.deepcopy(hf_model.model.mm_projector)
    )
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.zero_()
    module.load_state_dict(
        encoder_state(checkpoint, hf_model.config.vision_config.num_attention_heads), strict=True
    )
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
    missing = full_save_in_transformers_layout(
        hf_model, tmp_path / "missing", drop="model.mm_projector.out_proj.bias"
    )
    with pytest.raises(CheckpointError, match=r"missing keys \['mm_projector.out_proj.bias'\]"):
        GraphEncoder.from_pretrained(missing, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    extra = full_save_in_transformers_layout(
        hf_model, tmp_path / "extra", add="model.vision_tower.layers.9.extra"
    )
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
