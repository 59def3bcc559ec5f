"""MiniMax-M3-VL (`MiniMaxM3VLVisionModel` + `MiniMaxM3VLMultiModalProjector`): the static forward
against the Hugging Face model's own `get_image_features` / `get_video_features` (fp32, CPU);
padding; bad items named by index; loading from a full-model save (which transformers writes in
the release layout, `vision_tower.vision_model.` and `patch_merge_mlp.`), whole and sharded, from
transformers' in-memory layout and from a tower-only save; `vitpool.items_from` on the processor's
output."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import family_cases.minimax_m3_vl as minimax_case
import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases.minimax_m3_vl import BAD_ITEMS, PATCH, ROW_WIDTH, TEMPORAL_PATCH, full_config, randomize
from safetensors.torch import load_file, save_file

import vitpool
from vitpool import GraphEncoder, Image, InvalidItemError, Video
from vitpool.errors import CheckpointError
from vitpool.families.minimax_m3_vl.adapter import (
    MiniMaxM3VLAdapter,
    MiniMaxM3VLEncoder,
    build_encoder,
    convert_checkpoint,
    tower_only_config,
)
from vitpool.packing import Budget

pytestmark = pytest.mark.skipif(bool(minimax_case.TOO_OLD), reason=str(minimax_case.TOO_OLD))

TOLERANCE = 1e-4
BUDGETS = [16, 32, 64]
TEXT_WIDTH = 48


def pixels(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, ROW_WIDTH, generator=torch.Generator().manual_seed(seed))


def image(h: int, w: int, seed: int) -> Image:
    return Image(pixels(h * w, seed), (1, h, w))


def video(t: int, h: int, w: int, seed: int) -> Video:
    return Video(pixels(t * h * w, seed), (t, h, w))


@pytest.fixture(scope="module")
def hf_model():
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3SparseForConditionalGeneration,
    )

    model = MiniMaxM3SparseForConditionalGeneration(full_config())
    randomize(model.model.vision_tower, 0)
    randomize(model.model.multi_modal_projector, 1)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def encoder_module(hf_model) -> MiniMaxM3VLEncoder:
    inner = hf_model.model
    return MiniMaxM3VLEncoder(copy.deepcopy(inner.vision_tower), copy.deepcopy(inner.multi_modal_projector))


@pytest.fixture(scope="module")
def encoder(hf_model) -> GraphEncoder:
    return GraphEncoder(
        MiniMaxM3VLAdapter(encoder_module(hf_model)), budgets=BUDGETS, device="cpu", dtype=torch.float32
    )


def hf_features(hf_model, items: list[Image | Video]) -> list[torch.Tensor]:
    """Hugging Face's own tokens, all items in one call (images through get_image_features, videos
    through get_video_features)."""
    grids = torch.tensor([list(item.grid_thw) for item in items])
    batch = torch.cat([torch.as_tensor(item.pixel_values) for item in items])
    with torch.no_grad():
        if all(isinstance(item, Video) for item in items):
            return list(hf_model.model.get_video_features(batch, grids).pooler_output)
        return list(hf_model.model.get_image_features(batch, grids).pooler_output)


def assert_matches(hf_model, encoder: GraphEncoder, items: list) -> float:
    worst = 0.0
    for item, embedding, expected in zip(
        items, encoder.encode(items), hf_features(hf_model, items), strict=True
    ):
        t, h, w = item.grid_thw
        assert embedding.tokens.shape == (t * h * w // 4, TEXT_WIDTH)
        assert torch.isfinite(embedding.tokens).all()
        error = relative_error(embedding.tokens, expected)
        assert error <= TOLERANCE, item.grid_thw
        worst = max(worst, error)
    return worst


def test_one_image_matches_get_image_features(hf_model, encoder):
    assert_matches(hf_model, encoder, [image(6, 8, seed=1)])


def test_images_of_different_sizes_in_one_call(hf_model, encoder):
    items = [image(4, 4, 2), image(2, 8, 3), image(8, 6, 4), image(2, 2, 5), image(10, 4, 6)]
    assert_matches(hf_model, encoder, items)
    # one larger than any budget (64 tokens): eager, alone
    assert_matches(hf_model, encoder, [image(20, 16, 7), image(4, 2, 8)])


def test_videos_match_get_video_features(hf_model, encoder):
    """A chunk's frames attend to each other and keep their tokens (no pooling over time)."""
    items = [video(2, 4, 4, 9), video(4, 2, 6, 10), video(3, 6, 4, 11)]
    assert_matches(hf_model, encoder, items)
    mixed = [image(4, 6, 12), video(2, 4, 2, 13)]
    tokens = encoder.encode(mixed)
    assert relative_error(tokens[0].tokens, hf_features(hf_model, mixed[:1])[0]) <= TOLERANCE
    assert relative_error(tokens[1].tokens, hf_features(hf_model, mixed[1:])[0]) <= TOLERANCE


def test_padding_rows_do_not_change_real_rows(encoder):
    """The same image alone in the smallest and the largest budget, and beside neighbours, with
    garbage in the padding rows' pixels: its tokens are the same."""
    adapter = encoder.adapter
    item = image(4, 6, 14)
    spec = adapter.item_rules.item_spec("image", (24, ROW_WIDTH), "float32", (1, 4, 6))
    alone = {}
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(rows, ROW_WIDTH) * 100  # padding rows hold garbage
        batch[:24] = item.pixel_values
        metadata = adapter.build_metadata([spec], rows, budget)
        with torch.no_grad():
            alone[budget.num_tokens] = adapter.forward(batch, metadata)[0][: spec.num_tokens]
    crowded = encoder.encode([video(2, 4, 4, 15), item, image(2, 2, 16)])[1].tokens
    first = alone[encoder.budgets[0].num_tokens]
    assert relative_error(alone[encoder.budgets[-1].num_tokens], first) <= TOLERANCE
    assert relative_error(crowded, first) <= TOLERANCE


def test_metadata_of_padding_is_valid(encoder):
    adapter = encoder.adapter
    budget = Budget(16, (), 4)
    rules = adapter.item_rules
    specs = [
        rules.item_spec("video", (32, ROW_WIDTH), "float32", (2, 4, 4)),
        rules.item_spec("image", (8, ROW_WIDTH), "float32", (1, 2, 4)),
    ]
    assert specs[0].needs == () and specs[0].num_tokens == 8
    metadata = adapter.build_metadata(specs, 64, budget)
    # one sequence per item (a video's frames together), then the padding's
    assert metadata["cu_seqlens"].tolist() == [0, 32, 40, 64, 64, 64]
    # (t, h, w) per row in 2x2 blocks: row 4 starts the second block, row 16 the second frame
    assert metadata["position_ids"][4].tolist() == [0, 0, 2]
    assert metadata["position_ids"][16].tolist() == [1, 0, 0]
    assert metadata["position_ids"][40:].abs().sum() == 0
    with pytest.raises(ValueError, match="the buffers hold"):
        adapter.build_metadata(specs * 3, 64, budget)


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([image(4, 4, 17), bad])
    assert raised.value.index == 1 and words in str(raised.value)


def test_no_capacity_limits(encoder):
    rules = encoder.adapter.item_rules
    assert rules.capacities == ()
    with pytest.raises(ValueError, match="sequences"):
        rules.budgets(BUDGETS, None, {"sequences": 4})


def test_build_encoder_needs_the_projector_fields():
    with pytest.raises(ValueError, match="projector_hidden_size"):
        build_encoder(full_config().vision_config)
    built = build_encoder(tower_only_config(full_config()), torch.bfloat16)
    assert built.multi_modal_projector.merge_linear_2.weight.dtype == torch.bfloat16
    assert built.multi_modal_projector.merge_linear_2.out_features == TEXT_WIDTH


def test_tower_only_config_round_trips(tmp_path: Path):
    from transformers import AutoConfig

    tower_only_config(full_config()).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "minimax_m3_vl_vision" and raw["text_hidden_size"] == TEXT_WIDTH
    read = AutoConfig.from_pretrained(tmp_path)
    assert (read.projector_hidden_size, read.merged_hidden_size) == (40, 4 * TEXT_WIDTH)


def test_convert_checkpoint_layouts(hf_model, tmp_path: Path):
    own = encoder_module(hf_model).state_dict()
    assert convert_checkpoint(dict(own), None).keys() == own.keys()
    in_memory = {
        key: value
        for key, value in hf_model.state_dict().items()
        if key.startswith(("model.vision_tower.", "model.multi_modal_projector."))
    }
    assert convert_checkpoint(in_memory, None).keys() == own.keys()
    release = full_model_save(hf_model, tmp_path)
    assert any(key.startswith("patch_merge_mlp.") for key in release)
    vision = {k: v for k, v in release.items() if not k.startswith(("language_model", "lm_head"))}
    assert convert_checkpoint(vision, None).keys() == own.keys()


# Loading through GraphEncoder.from_pretrained (the registry's "minimax_m3_vl_vision" family).


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(hf_model, loaded: GraphEncoder, seed: int) -> None:
    assert isinstance(loaded.adapter, MiniMaxM3VLAdapter)
    assert_matches(hf_model, loaded, [image(4, 6, seed)])
    assert_matches(hf_model, loaded, [video(2, 2, 4, seed + 1)])


def full_model_save(hf_model, directory: Path, **kwargs) -> dict[str, torch.Tensor]:
    hf_model.save_pretrained(directory, **kwargs)
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(hf_model, tmp_path: Path, max_shard_size):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    full_model_save(hf_model, tmp_path, **kwargs)
    if max_shard_size:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        text = ("language_model", "lm_head")
        assert len({shard for key, shard in weight_map.items() if not key.startswith(text)}) > 2
    assert_loaded(hf_model, load(tmp_path), 20)


def test_loads_transformers_in_memory_layout(hf_model, tmp_path: Path):
    """A full checkpoint whose keys are the model's own state_dict (`model.vision_tower.`, ...)."""
    hf_model.config.save_pretrained(tmp_path)
    state = {k: v.clone().contiguous() for k, v in hf_model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_loaded(hf_model, load(tmp_path), 22)


def save_tower_only(hf_model, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    tower_only_config(hf_model.config).save_pretrained(directory)
    if state is None:
        state = encoder_module(hf_model).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))


def test_loads_a_tower_only_save(hf_model, tmp_path: Path):
    save_tower_only(hf_model, tmp_path)
    assert_loaded(hf_model, load(tmp_path), 24)


def test_a_missing_key_is_named(hf_model, tmp_path: Path):
    state = encoder_module(hf_model).state_dict()
    del state["multi_modal_projector.merge_linear_1.bias"]
    save_tower_only(hf_model, tmp_path, state)
    with pytest.raises(CheckpointError, match=r"merge_linear_1\.bias"):
        load(tmp_path)


# vitpool.items_from on the processor's output.


def patchified(frames: np.ndarray, merge: int = 2) -> tuple[np.ndarray, list[int]]:
    """Frames [t*T, C, H, W] as MiniMaxM3VLImageProcessor / VideoProcessor lay them out: rows of
    (C, T, P, P) in 2x2 blocks, block after block, frame group after frame group."""
    frames_t, c, height, width = frames.shape
    t, h, w = frames_t // TEMPORAL_PATCH, height // PATCH, width // PATCH
    x = frames.reshape(t, TEMPORAL_PATCH, c, h // merge, merge, PATCH, w // merge, merge, PATCH)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(t * h * w, ROW_WIDTH)), [t, h, w]


def test_items_from_the_processor_layout(hf_model, encoder):
    rng = np.random.default_rng(0)
    images = [rng.standard_normal((1, 3, 8, 12)), rng.standard_normal((1, 3, 4, 4))]
    image_rows = [patchified(np.repeat(frames, TEMPORAL_PATCH, axis=0)) for frames in images]
    clip = rng.standard_normal((6 * TEMPORAL_PATCH, 3, 4, 8))  # 6 temporal patches: chunks of 4 and 2
    clip_rows, (t, h, w) = patchified(clip)
    batch = {
        "pixel_values": np.concatenate([rows for rows, _ in image_rows]).astype(np.float32),
        "image_grid_thw": np.array([grid for _, grid in image_rows]),
        "pixel_values_videos": clip_rows.astype(np.float32),
        "video_grid_thw": np.array([[4, h, w], [t - 4, h, w]]),
        "num_chunks_per_video": [2],
    }
    items = vitpool.items_from(batch, family="minimax_m3_vl")
    assert [type(item) for item in items] == [Image, Image, Video, Video]
    assert [tuple(item.grid_thw) for item in items] == [(1, 4, 6), (1, 2, 2), (4, 2, 4), (2, 2, 4)]
    assert_matches(hf_model, encoder, items[:2])
    assert_matches(hf_model, encoder, items[2:])


def test_items_from_the_image_processor(hf_model, encoder):
    pytest.importorskip("torchvision")  # MiniMaxM3VLImageProcessor is a torchvision backend
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor

    processor = MiniMaxM3VLImageProcessor(
        patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, merge_size=2, min_pixels=16, max_pixels=16 * 16
    )
    rng = np.random.default_rng(1)
    pictures = [
        rng.integers(0, 255, (12, 8, 3), dtype=np.uint8),
        rng.integers(0, 255, (8, 8, 3), dtype=np.uint8),
    ]
    batch = processor(images=pictures, return_tensors="pt")
    items = vitpool.items_from(batch, family="minimax_m3_vl")
    assert [tuple(item.grid_thw) for item in items] == [tuple(g) for g in batch["image_grid_thw"].tolist()]
    assert_matches(hf_model, encoder, items)
