"""Gemma 3's own checks (the shared ones: test_adapter_conformance.py): views in and the LLM's tokens
out as Hugging Face's `get_image_features` hands them over, for one image, several images of
different view counts in one call and padded budgets; loading from full checkpoints (whole,
sharded, the releases' `vision_tower.vision_model.*` keys) and tower-only saves; a malformed item;
the real image processor's pan-and-scan output cut by `vitpool.items_from`; the transformers
drop-in. CPU, fp32, tiny random models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import gemma3 as case
from safetensors.torch import save_file

import vitpool
from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError
from vitpool.families.gemma3 import adapter as gemma3_adapter

TOLERANCE = 1e-4
BUDGETS = [case.TOKENS_PER_VIEW * views for views in (1, 2, 4)]


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model):
    return case.encoder_of(model, BUDGETS)


def views(count: int, seed: int) -> Image:
    """One image's views [count, 3, S, S] of random pixels."""
    return Image(torch.randn(count, *case.ROW_SHAPE, generator=torch.Generator().manual_seed(seed)))


def assert_matches(model, items, embeddings) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings, strict=True):
        expected = case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def test_one_image_of_one_view_gives_hugging_faces_tokens(model, encoder):
    item = views(1, 0)
    [embedding] = encoder.encode([item])
    assert embedding.tokens.shape == (case.TOKENS_PER_VIEW, case.TINY_TEXT["hidden_size"])
    assert_matches(model, [item], [embedding])


def test_images_of_several_view_counts_in_one_call(model, encoder):
    counts = (1, 3, 2, 1, 5)  # 5 views: over every budget, run eager at its own size
    items = [views(count, 10 + seed) for seed, count in enumerate(counts)]
    before = encoder.stats().eager_batches
    embeddings = encoder.encode(items)
    assert [e.tokens.shape[0] for e in embeddings] == [case.TOKENS_PER_VIEW * n for n in counts]
    assert_matches(model, items, embeddings)
    assert encoder.stats().eager_batches == before + 1


def test_padding_views_of_a_larger_budget_change_nothing(model):
    """One budget of 4 views: a 1-view image runs with 3 padding views, after and before a 4-view
    image filled the same buffers (stale rows must not leak into the next batch)."""
    encoder = case.encoder_of(model, [4 * case.TOKENS_PER_VIEW])
    small, large = views(1, 20), views(4, 21)
    first = encoder.encode([small])
    assert_matches(model, [large, small], encoder.encode([large]) + encoder.encode([small]))
    assert torch.equal(encoder.encode([small])[0].tokens, first[0].tokens)
    assert encoder.stats().replays_per_budget[4 * case.TOKENS_PER_VIEW] == 4


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(model, tmp_path, max_shard_size):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(set(weight_map.values())) > 2  # the vision weights span several shards
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [views(2, 30), views(1, 31)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_the_releases_layout(model, tmp_path):
    """google/gemma-3-*'s safetensors keep SigLIP one level down (`vision_tower.vision_model.*`)
    and the LLM under `language_model.model.*`."""
    state = {
        f"vision_tower.vision_model.{key}": value.contiguous()
        for key, value in model.model.vision_tower.state_dict().items()
    }
    state.update(
        {
            f"multi_modal_projector.{key}": value.contiguous()
            for key, value in model.model.multi_modal_projector.state_dict().items()
        }
    )
    state["language_model.model.embed_tokens.weight"] = torch.zeros(4, 4)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [views(3, 32)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_a_tower_only_save_and_refuses_missing_weights(model, encoder, tmp_path):
    gemma3_adapter.tower_only_config(model.config).save_pretrained(tmp_path)
    state = {key: value.contiguous() for key, value in encoder.adapter.tower.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [views(2, 33)]
    assert_matches(model, items, loaded.encode(items))
    del state["multi_modal_projector.mm_input_projection_weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys.*mm_input_projection_weight"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


def test_a_siglip_tower_of_another_model_is_refused(tmp_path):
    """CLIP-style SigLIP (a text tower beside the vision one) has SigLIP's vision config too, but no
    projector of Gemma 3's (PaliGemma's, Aya Vision's: their own families)."""
    from transformers import SiglipConfig

    SiglipConfig(vision_config=dict(case.TINY_VISION)).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="'siglip' checkpoint with a SigLIP vision tower"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


def test_a_token_count_the_projector_cannot_pool_to_is_refused():
    config = case.full_config()
    config.mm_tokens_per_image = 8  # no square: the processor's placeholders would not match
    with pytest.raises(ValueError, match="mm_tokens_per_image=8"):
        gemma3_adapter.build_encoder(config)


def test_a_malformed_item_is_named_and_the_others_still_encode(model, encoder):
    good = views(1, 40)
    wrong_size = Image(torch.randn(2, 3, case.VIEW - 8, case.VIEW - 8))
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([good, wrong_size])
    assert raised.value.index == 1 and "must be tiles" in str(raised.value)
    assert_matches(model, [good], encoder.encode([good]))


def test_default_budgets_are_whole_views(encoder):
    defaults = GraphEncoder(encoder.adapter, device="cpu", dtype=torch.float32)
    tokens = [budget.num_tokens for budget in defaults.budgets]
    assert tokens[0] == case.TOKENS_PER_VIEW
    assert tokens[-1] == gemma3_adapter.MAX_GRAPH_VIEWS * case.TOKENS_PER_VIEW
    assert all(value % case.TOKENS_PER_VIEW == 0 for value in tokens)


# The real image processor at the tiny view size, pan-and-scan on, crops of at least 8 pixels.


def image_processor():
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(
        size={"height": case.VIEW, "width": case.VIEW},
        do_pan_and_scan=True,
        pan_and_scan_min_crop_size=8,
        pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2,
    )


def random_images(sizes, seed: int) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def test_items_from_the_processors_pan_and_scan_output_encode_as_hugging_face(model, encoder):
    pytest.importorskip("PIL")
    processor = image_processor()
    # (height, width): 3 crops of a wide image, none of a square one, 2 of a tall one
    images = random_images(((40, 100), (48, 48), (60, 30)), seed=0)
    batch = processor(images=images, return_tensors="pt")
    assert batch["num_crops"].tolist() == [3, 0, 2]
    items = vitpool.items_from(batch)
    assert [type(item) for item in items] == [Image] * len(images)
    for item, image in zip(items, images, strict=True):  # each as the processor makes it alone
        alone = processor(images=[image], return_tensors="pt")
        assert torch.equal(torch.as_tensor(item.pixel_values), alone["pixel_values"])
        assert item.pixel_values.shape[0] == 1 + int(alone["num_crops"][0])
    with torch.no_grad():  # the whole batch at once, as the model runs it
        batch_tokens = model.model.get_image_features(pixel_values=batch["pixel_values"]).pooler_output
    expected = batch_tokens.split([item.pixel_values.shape[0] for item in items])
    for embedding, wanted in zip(encoder.encode(items), expected, strict=True):
        wanted = wanted.reshape(-1, wanted.shape[-1])
        assert embedding.tokens.shape == wanted.shape
        assert relative_error(embedding.tokens, wanted) <= TOLERANCE


def test_a_batch_the_cutter_cannot_account_for_is_named():
    pixels = torch.randn(4, *case.ROW_SHAPE)
    processor_output = {
        "pixel_values": pixels,
        "input_ids": torch.zeros(1, 3),
    }  # Gemma3Processor's: no num_crops, so a view an item (test_full_processor_outputs.py)
    assert [item.pixel_values.shape[0] for item in vitpool.items_from(processor_output, family="gemma3")] == [
        1
    ] * 4
    with pytest.raises(ValueError, match="no family's processor output"):
        vitpool.items_from(processor_output)  # unnamed: its keys alone are several families'
    with pytest.raises(ValueError, match=r"has 4 views; num_crops \[1, 0\] accounts for 3"):
        vitpool.items_from({"pixel_values": pixels, "num_crops": torch.tensor([1, 0])})
    with pytest.raises(ValueError, match="one non-negative whole number per image"):
        vitpool.items_from({"pixel_values": pixels, "num_crops": torch.tensor([3, -1, 1])})
    with pytest.raises(ValueError, match="return_tensors='pt'"):
        vitpool.items_from({"pixel_values": list(pixels), "num_crops": torch.tensor([3])})


def test_the_drop_in_answers_get_image_features(model):
    """`replace_vision_tower`: the model's own `get_image_features` answers through a GraphEncoder
    over its own vision weights, and `restore_vision_tower` puts the modules back."""
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    pixel_values = views(3, 50).pixel_values
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=pixel_values).pooler_output
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    try:
        with torch.no_grad():
            got = model.model.get_image_features(pixel_values=pixel_values).pooler_output
    finally:
        restore_vision_tower(model, original)
    assert model.model.vision_tower is tower and model.model.multi_modal_projector is projector
    assert got.shape == want.shape
    assert relative_error(got, want) <= TOLERANCE
