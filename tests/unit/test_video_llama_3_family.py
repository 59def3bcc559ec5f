"""VideoLLaMA 3 against Hugging Face's own `get_image_features` / `get_video_features` (projector
included), CPU fp32: images (merge size 1) and clips (merge size 2) alone and mixed in one call,
padding, both paths, the processors' output through `items_from`, checkpoints, and malformed items
named by index."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from family_cases.video_llama_3 import BAD_ITEMS, ROW_WIDTH, full_config, layout_of, randomize
from safetensors.torch import save_file

from vitpool import GraphEncoder, Image, InvalidItemError, Video, items_from
from vitpool.errors import CheckpointError
from vitpool.families.video_llama_3.adapter import (
    VideoLlama3Adapter,
    VideoLlama3Encoder,
    block_taps,
    tower_only_config,
)
from vitpool.families.video_llama_3.rules import MERGED

TOLERANCE = 1e-4
BUDGETS = [16, 32, 64]


def pixels(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, ROW_WIDTH, generator=torch.Generator().manual_seed(seed))


def image(h: int, w: int, seed: int, merge: int = 1) -> Image:
    return Image(pixels(h * w, seed), (1, h, w, merge))


def clip(t: int, h: int, w: int, seed: int) -> Video:
    return Video(pixels(t * h * w, seed), (t, h, w))


@pytest.fixture(scope="module")
def hf_model():
    from transformers import VideoLlama3ForConditionalGeneration

    model = VideoLlama3ForConditionalGeneration(full_config())
    randomize(model.model.vision_model, 0)
    randomize(model.model.projector, 1)
    model.config.vision_config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def encoder_module(hf_model) -> VideoLlama3Encoder:
    return VideoLlama3Encoder(
        copy.deepcopy(hf_model.model.vision_model), copy.deepcopy(hf_model.model.projector)
    )


@pytest.fixture(scope="module")
def encoder(hf_model) -> GraphEncoder:
    return GraphEncoder(
        VideoLlama3Adapter(encoder_module(hf_model)), budgets=BUDGETS, device="cpu", dtype=torch.float32
    )


def features(hf_model, items: list) -> list[torch.Tensor]:
    """What the model hands its LLM for these items, all in one call of `get_image_features`."""
    layouts = [layout_of(item.grid_thw) for item in items]
    with torch.no_grad():
        output = hf_model.model.get_image_features(
            torch.cat([torch.as_tensor(item.pixel_values) for item in items]),
            torch.tensor([layout[:3] for layout in layouts]),
            torch.tensor([layout[3] for layout in layouts]),
        )
    return list(output.pooler_output)


def assert_matches(hf_model, encoder: GraphEncoder, items: list) -> list[float]:
    errors = []
    for item, embedding, expected in zip(
        items, encoder.encode(items), features(hf_model, items), strict=True
    ):
        t, h, w, merge = layout_of(item.grid_thw)
        assert embedding.tokens.shape == (t * h * w // merge**2, 48)
        errors.append(relative_error(embedding.tokens, expected))
    assert max(errors) <= TOLERANCE, errors
    return errors


def test_one_image_matches_get_image_features(hf_model, encoder):
    assert_matches(hf_model, encoder, [image(6, 8, seed=1)])


def test_one_clip_matches_get_video_features(hf_model, encoder):
    item = clip(3, 4, 6, seed=2)
    with torch.no_grad():
        [expected] = hf_model.model.get_video_features(
            item.pixel_values, torch.tensor([[3, 4, 6]]), torch.tensor([2])
        ).pooler_output
    [embedding] = encoder.encode([item])
    assert relative_error(embedding.tokens, expected) <= TOLERANCE


def test_sizes_and_merge_sizes_mixed_in_one_call(hf_model, encoder):
    items = [
        image(4, 4, 3),
        clip(2, 4, 4, 4),
        image(2, 6, 5),
        image(4, 6, 6, merge=2),
        Video(pixels(16, 7), (1, 2, 8, 2)),
    ]
    assert_matches(hf_model, encoder, items)


@pytest.mark.parametrize("merge", [3, 4])
def test_merge_sizes_above_two(hf_model, encoder, merge):
    """The processor may be asked for other merge sizes; the bilinear taps of odd and even ones."""
    assert_matches(hf_model, encoder, [image(2 * merge, merge, 8 + merge, merge=merge)])


def test_block_taps_are_the_bilinear_centre():
    assert block_taps(1) == ((0,), (1.0,))
    assert block_taps(2) == ((0, 1, 2, 3), (0.25, 0.25, 0.25, 0.25))
    assert block_taps(3) == ((4,), (1.0,))


def test_every_budget_of_both_paths_with_padding(hf_model, encoder):
    budgets = encoder.budgets
    assert {budget.path for budget in budgets} == {"", MERGED}
    for budget in budgets:
        adapter = encoder.adapter.paths[budget.path]
        merge = 2 if budget.path == MERGED else 1
        # fills a part of the budget: the rest is padding rows and tokens
        item = image(2 * merge, 2 * merge, budget.num_tokens, merge=merge)
        spec = encoder.adapter.item_rules.item_spec(
            "image", tuple(item.pixel_values.shape), "float32", item.grid_thw
        )
        rows = adapter.max_rows(budget.num_tokens)
        metadata = adapter.build_metadata([spec], rows, budget)
        buffer = torch.randn(rows, ROW_WIDTH)  # padding rows of garbage
        buffer[: spec.pixel_shape[0]] = item.pixel_values
        with torch.no_grad():
            [out] = adapter.forward(buffer, metadata)
        assert torch.isfinite(out).all()
        [expected] = features(hf_model, [item])
        assert relative_error(out[: spec.num_tokens], expected) <= TOLERANCE


def test_merged_path_buffers_hold_four_rows_a_token(encoder):
    merged = encoder.adapter.paths[MERGED]
    assert merged.max_rows(16) == 64 and encoder.adapter.paths[""].max_rows(16) == 16
    spec = encoder.adapter.item_rules.item_spec("video", (2 * 16, ROW_WIDTH), "float32", (2, 4, 4))
    assert (
        spec.path == MERGED
        and spec.num_tokens == 8
        and dict(spec.needs) == {"extra_rows": 24, "sequences": 2}
    )


# The processors' output through items_from.


def image_processor(merge_size: int):
    from transformers import VideoLlama3ImageProcessorPil

    return VideoLlama3ImageProcessorPil(patch_size=2, merge_size=merge_size, min_pixels=16, max_pixels=256)


def test_processor_output_through_items_from(hf_model, encoder):
    generator = torch.Generator().manual_seed(9)
    images = [torch.randint(0, 256, (3, 8, 12), generator=generator, dtype=torch.uint8) for _ in range(2)]
    frames = [torch.randint(0, 256, (3, 8, 8), generator=generator, dtype=torch.uint8) for _ in range(2)]
    batch = dict(image_processor(1)(images=images, return_tensors="pt"))
    # the video processor (torchvision's) patchifies each frame as the image processor does at its
    # merge size 2, frames one after the other; its compression mask is the caller's
    per_frame = image_processor(2)(images=frames, return_tensors="pt")
    _, h, w = per_frame["image_grid_thw"][0].tolist()
    batch.update(
        pixel_values_videos=per_frame["pixel_values"],
        video_grid_thw=torch.tensor([[2, h, w]]),
        video_merge_sizes=torch.tensor([2]),
        video_compression_mask=torch.ones(2 * h * w // 4, dtype=torch.bool),
    )
    items = items_from(batch)
    assert [type(item) for item in items] == [Image, Image, Video]
    assert [item.grid_thw[3] for item in items] == [1, 1, 2]
    assert_matches(hf_model, encoder, items)


def test_video_processor_output_through_items_from(hf_model, encoder):
    pytest.importorskip("torchvision")
    from transformers import VideoLlama3VideoProcessor

    processor = VideoLlama3VideoProcessor(patch_size=2, min_pixels=16, max_pixels=256)
    video = torch.randint(
        0, 256, (2, 3, 8, 8), generator=torch.Generator().manual_seed(10), dtype=torch.uint8
    )
    items = items_from(processor(videos=[video], return_tensors="pt", do_sample_frames=False))
    assert [type(item) for item in items] == [Video]
    assert_matches(hf_model, encoder, items)


def test_items_from_names_what_to_pass():
    batch = {"pixel_values": pixels(16, 0), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match="image_merge_sizes"):
        items_from(batch, family="video_llama_3")
    with pytest.raises(ValueError, match=r"image_merge_sizes has 2 entries; image_grid_thw has 1"):
        items_from({**batch, "image_merge_sizes": torch.tensor([1, 1])}, family="video_llama_3")
    with pytest.raises(ValueError, match=r"image_merge_sizes\[0\] = 3"):
        items_from({**batch, "image_merge_sizes": torch.tensor([3])}, family="video_llama_3")
    with pytest.raises(ValueError, match="account for 32"):
        bad = {**batch, "image_grid_thw": torch.tensor([[1, 4, 8]]), "image_merge_sizes": torch.tensor([1])}
        items_from(bad, family="video_llama_3")


# Checkpoints through GraphEncoder.from_pretrained (the registry's "video_llama_3_vision").


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(hf_model, loaded: GraphEncoder, seed: int) -> None:
    items = [image(4, 6, seed), clip(2, 4, 4, seed + 1)]
    for embedding, expected in zip(loaded.encode(items), features(hf_model, items), strict=True):
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def test_loads_a_tower_only_save(hf_model, tmp_path: Path):
    tower_only_config(hf_model.config).save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in encoder_module(hf_model).state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_loaded(hf_model, load(tmp_path), 14)


def test_loads_a_sharded_full_model_save(hf_model, tmp_path: Path):
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_loaded(hf_model, load(tmp_path), 15)


def test_a_missing_key_is_named(hf_model, tmp_path: Path):
    tower_only_config(hf_model.config).save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in encoder_module(hf_model).state_dict().items()}
    del state["projector.readout.0.bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"projector\.readout\.0\.bias"):
        load(tmp_path)


def test_build_encoder_needs_the_llm_width():
    from vitpool.families.video_llama_3.adapter import build_encoder

    with pytest.raises(ValueError, match="text_hidden_size"):
        build_encoder(full_config().vision_config)


# Malformed items, named by index.


@pytest.mark.parametrize("bad, words", BAD_ITEMS, ids=[words for _, words in BAD_ITEMS])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([image(4, 4, 18), bad])
    assert raised.value.index == 1 and words in str(raised.value)
