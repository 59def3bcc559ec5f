"""The grid families' checks that need a whole Hugging Face model (Qwen2-VL, Qwen2.5-VL, Qwen3.5,
GLM-4.1V / 4.5V / 4.6V; what the suite checks on a tower alone is in test_adapter_conformance.py):
each release's full save and tower-only save load as its family, the tower loads under either
prefix, a missing or unexpected key is named, and the tokens equal what the model's own
`get_image_features` / `get_video_features` hand its LLM for each item alone, images and videos.
CPU, fp32, tiny random models; one row of RELEASES per release."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from family_cases import glm4v as glm4v_case
from family_cases import qwen2_5_vl as qwen2_5_vl_case
from family_cases import qwen2_vl as qwen2_vl_case
from family_cases import qwen3_5 as qwen3_5_case
from safetensors.torch import load_file, save_file

from vitpool import CheckpointError, GraphEncoder, Image, Video
from vitpool.families.glm4v.adapter import Glm4vAdapter
from vitpool.families.qwen2_5_vl.adapter import Qwen2_5_VLAdapter
from vitpool.families.qwen2_vl.adapter import Qwen2VLAdapter
from vitpool.families.qwen3_5.adapter import Qwen3_5Adapter
from vitpool.models.registry import find_family

TOLERANCE = 1e-5
UNEXPECTED_KEY = "blocks.99.attn.qkv.weight"


@dataclass(frozen=True)
class Release:
    """One release of a grid family, as transformers builds and saves it.

    Attributes:
        build: a tiny full model (tower and LLM) with random weights, on Hugging Face's SDPA path.
        adapter: the vitpool adapter its saves load as.
        row_width: features of a patch row (C*T*P*P).
        budgets: token budgets of its encoders.
        saved_prefix: where `save_pretrained` puts the tower in a full save.
        tower_model_type: the `model_type` of a tower-only save's config.
        tower_key: one of the tower's weights (dropped to check that a missing key is named).
    """

    build: Callable[[], torch.nn.Module]
    adapter: type
    row_width: int
    budgets: tuple[int, ...]
    saved_prefix: str
    tower_model_type: str
    tower_key: str


# per family: (row width, budgets), as its conformance case has them
QWEN2_VL = (qwen2_vl_case.ROW_WIDTH, qwen2_vl_case.BUDGETS)
QWEN2_5_VL = (qwen2_5_vl_case.ROW_WIDTH, qwen2_5_vl_case.BUDGETS)
QWEN3_5 = (qwen3_5_case.ROW_WIDTH, qwen3_5_case.BUDGETS)
GLM4V = (glm4v_case.ROW_WIDTH, glm4v_case.BUDGETS)
GLM_KEY = "embeddings.position_embedding.weight"

# keyed by the full save's `model_type`
RELEASES = {
    # Qwen2-VL: the published layout, the tower under `visual.` beside `model.layers.`
    "qwen2_vl": Release(
        qwen2_vl_case.full_model,
        Qwen2VLAdapter,
        *QWEN2_VL,
        "visual.",
        "qwen2_vl_vision",
        "merger.ln_q.weight",
    ),
    # Qwen2.5-VL: the same layout, window attention in the tower
    "qwen2_5_vl": Release(
        qwen2_5_vl_case.full_model,
        Qwen2_5_VLAdapter,
        *QWEN2_5_VL,
        "visual.",
        "qwen2_5_vl_vision",
        "merger.ln_q.weight",
    ),
    # Qwen3.5, a dense LLM: transformers 5's layout, `model.visual.` beside `model.language_model.`
    "qwen3_5": Release(
        qwen3_5_case.full_model,
        Qwen3_5Adapter,
        *QWEN3_5,
        "model.visual.",
        "qwen3_5_vision",
        "merger.linear_fc2.bias",
    ),
    # Qwen3.5, an MoE LLM: a tower class of its own
    "qwen3_5_moe": Release(
        lambda: qwen3_5_case.full_model(moe=True),
        Qwen3_5Adapter,
        *QWEN3_5,
        "model.visual.",
        "qwen3_5_moe_vision",
        "merger.linear_fc2.bias",
    ),
    # GLM-4.1V: a learned position table, interpolated to each grid
    "glm4v": Release(glm4v_case.full_model, Glm4vAdapter, *GLM4V, "model.visual.", "glm4v_vision", GLM_KEY),
    # GLM-4.5V: a `glm4v_moe_vision` tower
    "glm4v_moe": Release(
        lambda: glm4v_case.full_model("glm4v_moe"),
        Glm4vAdapter,
        *GLM4V,
        "model.visual.",
        "glm4v_moe_vision",
        GLM_KEY,
    ),
    # GLM-4.6V: its own model type, nesting a `glm4v_vision` tower
    "glm46v": Release(
        lambda: glm4v_case.full_model("glm46v"),
        Glm4vAdapter,
        *GLM4V,
        "model.visual.",
        "glm4v_vision",
        GLM_KEY,
    ),
}


@pytest.fixture(scope="module", params=sorted(RELEASES))
def model_type(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def release(model_type) -> Release:
    return RELEASES[model_type]


@pytest.fixture(scope="module")
def hf_model(release) -> torch.nn.Module:
    return release.build()


@pytest.fixture(scope="module")
def full_save(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("full")
    hf_model.save_pretrained(path, max_shard_size="200KB")  # several shards: only the tower's are read
    return path


@pytest.fixture(scope="module")
def tower_save(hf_model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tower")
    hf_model.model.visual.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def encoder(release, full_save) -> GraphEncoder:
    return load(full_save, release)


def load(path: Path, release: Release) -> GraphEncoder:
    budgets = list(release.budgets)
    return GraphEncoder.from_pretrained(path, budgets=budgets, device="cpu", dtype=torch.float32)


def pixels(release: Release, num_rows: int, seed: int) -> torch.Tensor:
    # pixels: [rows, C*T*P*P]
    return torch.randn(num_rows, release.row_width, generator=torch.Generator().manual_seed(seed))


def image(release: Release, h: int, w: int, seed: int) -> Image:
    return Image(pixels(release, h * w, seed), (1, h, w))


def video(release: Release, t: int, h: int, w: int, seed: int) -> Video:
    return Video(pixels(release, t * h * w, seed), (t, h, w))


def hf_tokens(model: torch.nn.Module, item) -> torch.Tensor:
    """What the Hugging Face model hands its LLM for this item, run alone."""
    features = model.model.get_video_features if isinstance(item, Video) else model.model.get_image_features
    with torch.no_grad():
        output = features(torch.as_tensor(item.pixel_values), torch.tensor([item.grid_thw]))
    [tokens] = output.pooler_output
    return tokens


def assert_like_hf(model: torch.nn.Module, items: list, embeddings: list) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings):
        want = hf_tokens(model, item)
        assert embedding.tokens.shape == want.shape == (want.shape[0], model.config.text_config.hidden_size)
        assert len(embedding.outputs) == 1 and embedding.deepstack == []  # tokens alone, no deepstack
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def save_one_file(state: dict[str, torch.Tensor], config_from: Path, directory: Path) -> Path:
    save_file({key: value.contiguous() for key, value in state.items()}, directory / "model.safetensors")
    shutil.copy(config_from / "config.json", directory / "config.json")
    return directory


def test_a_full_save_keeps_the_release_layout_and_loads_as_its_family(
    model_type, release, hf_model, full_save, encoder
):
    """transformers saves the tower under the release's prefix beside the LLM; only the tower loads."""
    weight_map = json.loads((full_save / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(key.startswith(release.saved_prefix) for key in weight_map)
    assert any(key.startswith(("model.layers.", "model.language_model.")) for key in weight_map)
    assert json.loads((full_save / "config.json").read_text())["model_type"] == model_type
    assert isinstance(encoder.adapter, release.adapter)
    assert type(encoder.adapter.tower) is type(hf_model.model.visual)


def test_one_image_matches_get_image_features(release, hf_model, encoder):
    items = [image(release, 6, 10, seed=1)]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_images_of_several_sizes_share_one_replay(release, hf_model, encoder):
    before = encoder.stats()
    # 4 + 15 + 1 + 8 = 28 tokens: one replay of a budget holds them all, in every release
    sizes = [(4, 4), (6, 10), (2, 2), (8, 4)]
    items = [image(release, h, w, seed) for seed, (h, w) in enumerate(sizes, start=2)]
    assert_like_hf(hf_model, items, encoder.encode(items))
    after = encoder.stats()
    assert sum(after.replays_per_budget.values()) == sum(before.replays_per_budget.values()) + 1
    assert after.eager_batches == before.eager_batches


def test_an_image_larger_than_every_budget_runs_eager(release, hf_model, encoder):
    before = encoder.stats().eager_batches
    items = [image(release, 18, 16, seed=6)]  # 72 tokens
    assert_like_hf(hf_model, items, encoder.encode(items))
    assert encoder.stats().eager_batches == before + 1


def test_videos_and_images_together_match_get_video_features(release, hf_model, encoder):
    # GLM's get_video_features runs a clip as one (1, h, w) grid per temporal patch: the adapter must too
    items = [
        video(release, 3, 4, 6, 7),
        image(release, 4, 6, 8),
        video(release, 2, 2, 2, 9),
        video(release, 2, 2, 6, 10),
    ]
    assert_like_hf(hf_model, items, encoder.encode(items))


def test_a_tower_only_save_loads_and_gives_the_full_saves_tokens(release, hf_model, tower_save, encoder):
    assert json.loads((tower_save / "config.json").read_text())["model_type"] == release.tower_model_type
    assert find_family(release.tower_model_type) is not None
    tower_only = load(tower_save, release)
    assert isinstance(tower_only.adapter, release.adapter)
    assert type(tower_only.adapter.tower) is type(hf_model.model.visual)
    items = [image(release, 4, 4, 11), video(release, 2, 2, 4, 12)]
    got = tower_only.encode(items)
    assert_like_hf(hf_model, items, got)
    for embedding, want in zip(got, encoder.encode(items)):
        assert torch.equal(embedding.tokens, want.tokens)


@pytest.mark.parametrize("prefix", ["visual.", "model.visual."])
def test_the_tower_loads_under_either_prefix(
    release, hf_model, full_save, tower_save, encoder, tmp_path, prefix
):
    """`visual.` (published Qwen2-VL / 2.5-VL exports) and `model.visual.` (transformers 5's
    in-memory layout), one file; the LLM's weights beside the tower are skipped."""
    state = {prefix + key: value for key, value in load_file(tower_save / "model.safetensors").items()}
    state["model.language_model.embed_tokens.weight"] = torch.zeros(4, 4)
    state["lm_head.weight"] = torch.zeros(4, 4)
    loaded = load(save_one_file(state, full_save, tmp_path), release)
    items = [image(release, 2, 4, 13), video(release, 2, 4, 4, 14)]
    got = loaded.encode(items)
    assert_like_hf(hf_model, items, got)
    for embedding, want in zip(got, encoder.encode(items)):
        assert torch.equal(embedding.tokens, want.tokens)


# "": a tower-only save (its own config); else a full save's config, the tower under that prefix
@pytest.mark.parametrize("prefix", ["", "visual.", "model.visual."])
def test_a_missing_and_an_unexpected_key_are_named(release, full_save, tower_save, tmp_path, prefix):
    state = load_file(tower_save / "model.safetensors")
    del state[release.tower_key]
    state[UNEXPECTED_KEY] = torch.zeros(2, 2)
    state = {prefix + key: value for key, value in state.items()}
    save_one_file(state, full_save if prefix else tower_save, tmp_path)
    with pytest.raises(CheckpointError, match="missing keys") as raised:
        load(tmp_path, release)
    assert release.tower_key in str(raised.value)
    assert "unexpected keys" in str(raised.value) and UNEXPECTED_KEY in str(raised.value)
