"""Molmo 2's own checks (the shared ones: test_adapter_conformance.py): crops and layouts in, what the
LLM receives out, as Hugging Face's `get_image_features` / `get_video_features` hand it over, for one
image, images of several tilings and videos in one call, padded budgets; a processor's batch cut by
`vitpool.items_from` and what does not add up in it; loading from full checkpoints (whole, sharded,
the releases' keys) and tower-only saves; the `get_image_features` stand-in. CPU, fp32, tiny random
models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import molmo2 as case

import vitpool
from vitpool import GraphEncoder, InvalidItemError

pytestmark = pytest.mark.skipif(bool(case.TOO_OLD), reason=str(case.TOO_OLD))

TOLERANCE = 1e-4
BUDGETS = list(case.BUDGETS)


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model):
    return case.encoder_of(model, BUDGETS)


def assert_matches(model, encoder, items) -> None:
    for item, result in zip(items, encoder.encode(items), strict=True):
        expected = case.features(model, item)
        assert result.tokens.shape == expected.shape
        assert relative_error(result.tokens, expected) <= TOLERANCE


def test_one_image_gives_hugging_faces_tokens(model, encoder):
    assert_matches(model, encoder, [case.image(2, 2, seed=1)])


def test_images_of_several_tilings_and_videos_in_one_call(model, encoder):
    items = [case.image(1, 1, 2), case.image(1, 3, 3, (2, 1)), case.video(3, 4), case.image(2, 1, 5, (0, 0))]
    assert_matches(model, encoder, items)


def test_padding_crops_and_tokens_of_a_larger_budget_change_nothing(model, encoder):
    item = case.image(1, 2, seed=6)
    small = case.encoder_of(model, [case.TOKENS_PER_CROP * 3])
    alone = small.encode([item])[0].tokens
    padded = encoder.encode([case.image(3, 3, 7), item])[1].tokens  # the 90-token budget, padded
    assert torch.isfinite(padded).all() and relative_error(padded, alone) <= TOLERANCE


def test_budgets_bound_their_crops(encoder):
    budgets = encoder.adapter.item_rules.budgets([case.TOKENS_PER_CROP * 4], None, {})
    assert budgets[0].limit("sequences") == 4


def test_padding_tokens_pool_one_patch(encoder):
    adapter = encoder.adapter
    spec = adapter.item_rules.item_spec("image", (2, *case.ROW_SHAPE), "float32", case.image_layout(1, 1))
    [budget] = adapter.item_rules.budgets([case.TOKENS_PER_CROP * 4], None, {})
    metadata = adapter.build_metadata([spec], adapter.max_rows(budget.num_tokens), budget)
    valid = metadata["pool_valid"]
    assert valid[spec.num_tokens :].sum(1).eq(1).all()
    assert valid[: spec.num_tokens, 4:].sum() == 0 and valid[: spec.num_tokens].any(1).all()


def test_a_malformed_item_is_named_and_the_others_still_encode(model, encoder):
    bad = vitpool.Image(torch.randn(5, *case.ROW_SHAPE).to(torch.int32), case.image_layout(2, 2))
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([case.image(1, 1, 8), bad])
    assert raised.value.index == 1
    with pytest.raises(InvalidItemError, match="has 5 crops") as raised:
        encoder.encode(
            [case.image(1, 1, 8), vitpool.Image(torch.randn(3, *case.ROW_SHAPE), case.image_layout(2, 2))]
        )
    assert raised.value.index == 1
    assert_matches(model, encoder, [case.image(1, 1, 8)])


def test_an_empty_call_gives_nothing_and_a_bad_layout_is_named(encoder):
    assert encoder.encode([]) == []
    with pytest.raises(InvalidItemError, match="margins") as raised:
        encoder.encode([vitpool.Image(torch.randn(5, *case.ROW_SHAPE), (2, 2, 2, 2, 3, 3))])
    assert raised.value.index == 0


# A processor's batch: the items' crops and windows, offset into the batch as Molmo2ImageProcessor
# offsets them (its real output is checked where torchvision is installed, below).


def batch_of(items, modality: str) -> dict:
    from vitpool.families.molmo2.rules import item_windows

    pixels, pooling, grids, offset = [], [], [], 0
    for item in items:
        crops = torch.as_tensor(item.pixel_values)
        windows = item_windows(case.SIDE, modality, len(crops), tuple(item.grid_thw))
        pooling.append(np.where(windows >= 0, windows + offset, -1))
        offset += len(crops) * case.SIDE**2
        pixels.append(crops)
        if modality == "video":
            grids.append([len(crops), -(-case.SIDE // 3), -(-case.SIDE // 3)])
        else:
            tiling_h, tiling_w, _, _, left, right = item.grid_thw
            height, width = (
                tiles * (case.SIDE - left - right) + left + right for tiles in (tiling_h, tiling_w)
            )
            grids.append([3, 3, -(-height // 2), -(-width // 2)])  # the global view's and the canvas's
    prefix = "image" if modality == "image" else "video"
    return {
        "pixel_values" if modality == "image" else "pixel_values_videos": torch.cat(pixels),
        f"{prefix}_token_pooling": torch.from_numpy(np.concatenate(pooling)),
        f"{prefix}_grids": torch.tensor(grids),
    }


def test_items_from_a_batch_are_each_images_crops_and_encode_as_hugging_face(model, encoder):
    images = [case.image(1, 2, 9), case.image(2, 2, 10, (2, 0)), case.image(1, 1, 11)]
    batch = batch_of(images, "image")
    cut = vitpool.items_from(batch, family="molmo2")
    assert [tuple(item.grid_thw) for item in cut] == [tuple(image.grid_thw) for image in images[:2]] + [
        (1, 1, 2, 2, 0, 0)  # one crop: no margins
    ]
    with torch.no_grad():
        expected = model.model.get_image_features(
            batch["pixel_values"], batch["image_token_pooling"], batch["image_grids"]
        ).pooler_output
    for result, tokens in zip(encoder.encode(cut), expected, strict=True):
        assert relative_error(result.tokens, tokens) <= TOLERANCE


def test_items_from_a_video_batch_encode_as_get_video_features(model, encoder):
    batch = batch_of([case.video(2, 12), case.video(3, 13)], "video")
    cut = vitpool.items_from(batch, family="molmo2")
    with torch.no_grad():
        expected = model.model.get_video_features(
            batch["pixel_values_videos"], batch["video_token_pooling"], batch["video_grids"]
        ).pooler_output
    for result, tokens in zip(encoder.encode(cut), expected, strict=True):
        assert relative_error(result.tokens, tokens) <= TOLERANCE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b.update(image_grids=b["image_grids"] + 1), "accounts for"),
        (lambda b: b.update(image_token_pooling=b["image_token_pooling"].float()), "integer rows"),
        (lambda b: b.update(pixel_values=b["pixel_values"][:-1]), "crops"),
        (lambda b: b.update(image_token_pooling=b["image_token_pooling"].flip(0)), "image 0"),
        (lambda b: b.pop("image_grids"), "image_grids"),
    ],
)
def test_what_does_not_add_up_in_a_batch_is_named(change, message):
    from vitpool.families.molmo2.processor import items

    batch = batch_of([case.image(1, 2, 14), case.image(1, 1, 15)], "image")
    change(batch)
    with pytest.raises(ValueError, match=message):
        items(batch)


def test_the_real_image_processors_windows_are_the_layouts(model, encoder):
    pytest.importorskip("torchvision")
    from transformers.models.molmo2.image_processing_molmo2 import Molmo2ImageProcessor

    processor = Molmo2ImageProcessor(
        size={"height": case.CROP, "width": case.CROP},
        patch_size=case.PATCH,
        max_crops=4,
        overlap_margins=[1, 1],
    )
    pictures = [
        np.random.default_rng(n).integers(0, 255, (h, w, 3), dtype=np.uint8)
        for n, (h, w) in enumerate([(30, 20), (12, 12), (40, 41)])
    ]
    out = processor(pictures, return_tensors="pt")
    with torch.no_grad():
        expected = model.model.get_image_features(
            out["pixel_values"], out["image_token_pooling"], out["image_grids"]
        ).pooler_output
    for result, tokens in zip(
        encoder.encode(vitpool.items_from(out, family="molmo2")), expected, strict=True
    ):
        assert relative_error(result.tokens, tokens) <= TOLERANCE


# Loading through GraphEncoder.from_pretrained (the registry's "molmo2_vision" tower).


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(model, loaded: GraphEncoder) -> None:
    assert_matches(model, loaded, [case.image(1, 2, 20), case.video(2, 21)])


@pytest.mark.parametrize("max_shard_size", [None, "50KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(model, tmp_path, max_shard_size):
    model.save_pretrained(tmp_path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    assert_loaded(model, load(tmp_path))


def test_loads_the_releases_keys(model, tmp_path):
    from safetensors.torch import save_file

    model.config.save_pretrained(tmp_path)
    renamed = {}
    for key, value in model.state_dict().items():
        key = key.replace(
            "model.vision_tower.layers.", "model.vision_backbone.image_vit.transformer.resblocks."
        )
        key = key.replace("model.vision_tower.", "model.vision_backbone.image_vit.")
        key = key.replace("model.multi_modal_projector.", "model.vision_backbone.")
        key = key.replace("self_attn.q_proj", "attention.wq").replace(
            "image_pooling_2d.q_proj", "image_pooling_2d.wq"
        )
        key = key.replace("image_projector.gate_proj", "image_projector.w1")
        key = key.replace(".mlp.fc1.", ".feed_forward.w1.").replace(".layer_norm1.", ".attention_norm.")
        renamed[key] = value.clone().contiguous()
    save_file(renamed, str(tmp_path / "model.safetensors"))
    assert_loaded(model, load(tmp_path))


def test_loads_a_tower_only_save(model, tmp_path):
    from family_cases.common import save_tower_and_projector

    from vitpool.families.molmo2.adapter import Molmo2Encoder

    module = Molmo2Encoder(model.model.vision_tower, model.model.multi_modal_projector)
    save_tower_and_projector("molmo2", model.config, module, tmp_path)
    assert_loaded(model, load(tmp_path))


def test_the_stand_in_answers_get_image_and_video_features(model, encoder):
    from vitpool.integrations.transformers import replace_vision_tower, restore_vision_tower

    images = batch_of([case.image(1, 2, 30), case.image(1, 1, 31)], "image")
    videos = batch_of([case.video(2, 32)], "video")
    inner = model.model
    with torch.no_grad():
        expected = inner.get_image_features(
            images["pixel_values"], images["image_token_pooling"], images["image_grids"]
        )
        expected_video = inner.get_video_features(*videos.values())
        original = replace_vision_tower(model, encoder)
        try:
            got = inner.get_image_features(
                images["pixel_values"], images["image_token_pooling"], images["image_grids"]
            )
            got_video = inner.get_video_features(*videos.values())
        finally:
            restore_vision_tower(model, original)
    pairs = [
        *zip(got.pooler_output, expected.pooler_output),
        *zip(got_video.pooler_output, expected_video.pooler_output),
    ]
    assert len(pairs) == 3
    for tokens, reference in pairs:
        assert relative_error(tokens, reference) <= TOLERANCE
