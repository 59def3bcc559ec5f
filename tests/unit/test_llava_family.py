"""LLaVA 1.5's own checks (the shared ones: test_adapter_conformance.py): views in and the LLM's
tokens out as Hugging Face's `get_image_features` hands them over (projector included), for one
image, several images in one call and padded budgets, at the feature layers and strategies the
config allows; the last layer left out exactly; loading from full checkpoints (whole, sharded, the
releases' `vision_tower.vision_model.*` keys) and tower-only saves; malformed items; the real
`CLIPImageProcessor`'s output cut by `vitpool.items_from`; the transformers drop-in. CPU, fp32,
tiny random models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import llava as case
from safetensors.torch import save_file

import vitpool
from vitpool import CheckpointError, ConfigError, GraphEncoder, Image, InvalidItemError
from vitpool.families.llava import adapter as llava_adapter
from vitpool.models.registry import RECORDS

TOLERANCE = 1e-4
BUDGETS = [case.TOKENS_PER_VIEW * views for views in (1, 2, 4)]
# a view of the release's size (336², 14-pixel patches: 24 x 24 patches), tiny widths
RELEASE_VIEW = {"image_size": 336, "patch_size": 14}


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model):
    return case.encoder_of(model, BUDGETS)


def views(count: int, seed: int, side: int = case.VIEW) -> Image:
    """One item's views [count, 3, S, S] of random pixels."""
    return Image(torch.randn(count, 3, side, side, generator=torch.Generator().manual_seed(seed)))


def assert_matches(model, items, embeddings) -> list[float]:
    assert len(embeddings) == len(items)
    errors = []
    for item, embedding in zip(items, embeddings, strict=True):
        expected = case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert torch.isfinite(embedding.tokens).all()
        errors.append(relative_error(embedding.tokens, expected))
        assert errors[-1] <= TOLERANCE
    return errors


def test_one_image_gives_hugging_faces_tokens(model, encoder):
    item = views(1, 0)
    [embedding] = encoder.encode([item])
    assert embedding.tokens.shape == (case.TOKENS_PER_VIEW, case.TINY_TEXT["hidden_size"])
    assert_matches(model, [item], [embedding])


def test_several_images_in_one_call_give_what_one_batch_of_hugging_face_gives(model, encoder):
    """Images of one view each in one call, against the model's own call on all of them stacked
    (one tensor an image), and items of several views (a prompt's images), one over every budget
    (run eager at its own size)."""
    images = [views(1, 10 + seed) for seed in range(5)]
    with torch.no_grad():
        stacked = torch.cat([image.pixel_values for image in images])
        expected = model.model.get_image_features(pixel_values=stacked).pooler_output
    for embedding, wanted in zip(encoder.encode(images), expected, strict=True):
        assert relative_error(embedding.tokens, wanted) <= TOLERANCE
    counts = (1, 3, 2, 5)
    items = [views(count, 20 + seed) for seed, count in enumerate(counts)]
    before = encoder.stats().eager_batches
    embeddings = encoder.encode(items)
    assert [e.tokens.shape[0] for e in embeddings] == [case.TOKENS_PER_VIEW * n for n in counts]
    assert_matches(model, items, embeddings)
    assert encoder.stats().eager_batches == before + 1


def test_padding_views_of_a_larger_budget_change_nothing(model):
    """One budget of 4 views: a 1-view image runs with 3 padding views, after and before a 4-view
    item filled the same buffers (stale rows must not leak into the next batch)."""
    encoder = case.encoder_of(model, [4 * case.TOKENS_PER_VIEW])
    small, large = views(1, 30), views(4, 31)
    first = encoder.encode([small])
    assert_matches(model, [large, small], encoder.encode([large]) + encoder.encode([small]))
    assert torch.equal(encoder.encode([small])[0].tokens, first[0].tokens)
    assert encoder.stats().replays_per_budget[4 * case.TOKENS_PER_VIEW] == 4


def test_the_last_layer_is_not_run_and_changes_nothing(model, encoder):
    """Layer -2's output is the last layer's input: the encoder never calls that layer, and neither
    Hugging Face's tokens nor vitpool's move when its weights change."""
    layers = encoder.adapter.tower.vision_tower.encoder.layers
    assert encoder.adapter.layers_run == len(layers) - 1
    calls = []
    hook = layers[-1].register_forward_hook(lambda *args: calls.append(1))
    item = views(2, 40)
    try:
        before = encoder.encode([item])[0].tokens
    finally:
        hook.remove()
    assert calls == []
    changed = case.hf_model(seed=3)
    with torch.no_grad():
        for parameter in changed.model.vision_tower.encoder.layers[-1].parameters():
            parameter.add_(1.0)
        changed.model.vision_tower.post_layernorm.weight.mul_(3.0)
    assert torch.equal(case.image_features(changed, item), case.image_features(model, item))
    assert torch.equal(case.encoder_of(changed, BUDGETS).encode([item])[0].tokens, before)


@pytest.mark.parametrize(
    "settings",
    [
        {"vision_feature_layer": -1},
        # pre_layrnorm's output (hidden state 0) and layer -2's, side by side: the projector reads twice
        # the width. A lone 0 is not checked: transformers 5.24's get_image_features fails on it (its
        # select_hidden_states passes output_hidden_states=0, which captures nothing)
        {"vision_feature_layer": [0, -2]},
        {"vision_feature_select_strategy": "full"},  # the class token kept: one token more a view
        {"vision_feature_layer": [-3, -1], "vision_feature_select_strategy": "full"},
    ],
    ids=["last", "two-layers", "full", "two-layers-full"],
)
def test_the_configs_feature_layers_and_strategies_match(settings):
    model = case.hf_model(seed=4, **settings)
    encoder = case.encoder_of(model, BUDGETS)
    extra = int(settings.get("vision_feature_select_strategy") == "full")
    assert encoder.adapter.tokens_per_tile == case.TOKENS_PER_VIEW + extra
    items = [views(1, 50), views(3, 51)]
    assert_matches(model, items, encoder.encode(items))


def test_a_feature_layer_or_strategy_outside_the_tower_is_refused(model):
    module = llava_adapter.LlavaEncoder(
        model.model.vision_tower, model.model.multi_modal_projector, model.config
    )
    module.vision_feature_layer = case.TINY_VISION["num_hidden_layers"] + 1
    with pytest.raises(ConfigError, match="vision_feature_layer 4 is outside the tower's 4 hidden states"):
        llava_adapter.LlavaAdapter(module)
    module.vision_feature_layer, module.vision_feature_select_strategy = -2, "cls_only"
    with pytest.raises(ConfigError, match="'cls_only' is not one of"):
        llava_adapter.LlavaAdapter(module)


def test_malformed_items_are_named_by_index_and_the_others_still_encode(model, encoder):
    good = views(1, 60)
    bad_items = {
        "must be tiles": Image(torch.randn(1, 3, case.VIEW + 4, case.VIEW + 4)),  # another size
        "must be tiles ": Image(torch.randn(3, case.VIEW, case.VIEW)),  # one view without its axis
        "no grid": Image(torch.randn(1, *case.ROW_SHAPE), (1, 4, 4)),  # a patch family's item
        "no tiles": Image(torch.randn(0, *case.ROW_SHAPE)),
    }
    for words, bad in bad_items.items():
        with pytest.raises(InvalidItemError) as raised:
            encoder.encode([good, good, bad])
        assert raised.value.index == 2 and words.strip() in str(raised.value)
    assert_matches(model, [good], encoder.encode([good]))


def test_default_budgets_are_whole_views(encoder):
    defaults = GraphEncoder(encoder.adapter, device="cpu", dtype=torch.float32)
    tokens = [budget.num_tokens for budget in defaults.budgets]
    assert tokens[0] == case.TOKENS_PER_VIEW
    assert tokens[-1] == llava_adapter.MAX_GRAPH_VIEWS * case.TOKENS_PER_VIEW
    assert all(value % case.TOKENS_PER_VIEW == 0 for value in tokens)
    assert llava_adapter.graph_views(576) == 8 and llava_adapter.graph_views(4097) == 1


# ---- checkpoints -------------------------------------------------------------------------------


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(model, tmp_path, max_shard_size):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        vision_shards = {file for key, file in weight_map.items() if "vision_tower" in key}
        assert len(vision_shards) > 2  # the vision weights span several shards
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [views(2, 70), views(1, 71)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_the_releases_layout(model, tmp_path):
    """llava-hf/llava-1.5-*-hf's safetensors (written by transformers 4) keep CLIP one level down
    (`vision_tower.vision_model.*`), the LLM under `language_model.*`, and older CLIP saves the
    position ids buffer."""
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
    positions = case.TOKENS_PER_VIEW + 1
    state["vision_tower.vision_model.embeddings.position_ids"] = torch.arange(positions)[None]
    state["language_model.model.embed_tokens.weight"] = torch.zeros(4, 4)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [views(3, 72)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_a_tower_only_save_and_refuses_missing_weights(model, encoder, tmp_path):
    config = llava_adapter.tower_only_config(model.config)
    assert config.model_type == "clip_vision_model" and config.vision_feature_layer == -2
    config.save_pretrained(tmp_path)
    state = {key: value.contiguous() for key, value in encoder.adapter.tower.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert loaded.adapter.feature_layers == encoder.adapter.feature_layers
    items = [views(2, 73)]
    assert_matches(model, items, loaded.encode(items))
    del state["multi_modal_projector.linear_2.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys.*multi_modal_projector\.linear_2\.weight"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


def test_another_clip_model_and_a_bare_clip_tower_are_refused(tmp_path):
    """VipLLaVA's vision config is CLIP's too, but its projector (several layers' features, each
    normalised) is not LLaVA 1.5's; a CLIP tower saved alone has no projector for vitpool to run.
    (LLaVA-NeXT's full checkpoints, also CLIP's, find their own family by their model_type.)"""
    from transformers import CLIPVisionConfig, VipLlavaConfig

    VipLlavaConfig(vision_config=dict(case.TINY_VISION), text_config=dict(case.TINY_TEXT)).save_pretrained(
        tmp_path / "vip"
    )
    with pytest.raises(CheckpointError, match="'vipllava' checkpoint with a CLIP vision tower"):
        GraphEncoder.from_pretrained(tmp_path / "vip", budgets=BUDGETS, device="cpu")
    vision = {key: value for key, value in case.TINY_VISION.items() if key != "model_type"}
    CLIPVisionConfig(**vision).save_pretrained(tmp_path / "clip")
    with pytest.raises(ValueError, match="a LLaVA vision config needs .*text_hidden_size"):
        GraphEncoder.from_pretrained(tmp_path / "clip", budgets=BUDGETS, device="cpu")


# ---- the image processor's output, cut by items_from -------------------------------------------


def image_processor(side: int):
    """CLIPImageProcessor built offline (PIL backend) with every setting given: the shortest edge
    resized to the view's side, a centre-cropped square, bicubic, CLIP's mean and std (the class's
    defaults; at side 336, LLaVA 1.5's view)."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(
        size={"shortest_edge": side},
        crop_size={"height": side, "width": side},
        do_center_crop=True,
        do_normalize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
        resample=3,  # bicubic
    )


def random_images(sizes, seed: int) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def test_items_from_the_image_processors_output_encode_as_hugging_face():
    """At the release's 336² (576 tokens a view, a tiny-width tower): one item a row of
    `pixel_values`, each what the processor gives for that image alone, encoding to the model's own
    tokens for the whole batch; the NumPy output cuts the same."""
    pytest.importorskip("PIL")
    model = case.hf_model(seed=5, vision=RELEASE_VIEW)
    encoder = case.encoder_of(model, [576, 2 * 576])
    processor = image_processor(336)
    images = random_images(((300, 400), (336, 336), (500, 200)), seed=0)
    batch = processor(images=images, return_tensors="pt")
    assert tuple(batch["pixel_values"].shape) == (3, 3, 336, 336)
    items = vitpool.items_from(batch, family="llava")
    assert [tuple(item.pixel_values.shape) for item in items] == [(1, 3, 336, 336)] * 3
    for item, image in zip(items, images, strict=True):
        assert torch.equal(item.pixel_values, processor(images=[image], return_tensors="pt")["pixel_values"])
    as_arrays = vitpool.items_from(dict(processor(images=images, return_tensors="np")), family="llava")
    assert all(np.array_equal(a.pixel_values, t.pixel_values.numpy()) for a, t in zip(as_arrays, items))
    with torch.no_grad():
        expected = model.model.get_image_features(pixel_values=batch["pixel_values"]).pooler_output
    for embedding, wanted in zip(encoder.encode(items), expected, strict=True):
        assert embedding.tokens.shape == (576, case.TINY_TEXT["hidden_size"])
        assert relative_error(embedding.tokens, wanted) <= TOLERANCE


def test_pixels_alone_are_found_by_their_keys_and_cut_one_view_an_image():
    """`pixel_values` alone is LLaVA's image processor's output and PaliGemma's: both families cut it
    the same way (`cut_as`), so it is one answer without family=: one item a row."""
    pixels = torch.randn(2, *case.ROW_SHAPE)
    alone = [
        r.name for r in RECORDS if r.processor_output and not r.processor_output.missing({"pixel_values"})
    ]
    assert "llava" in alone
    assert {RECORDS[[r.name for r in RECORDS].index(name)].processor_output.cut_as for name in alone} == {
        "one view an image"
    }
    found = vitpool.items_from({"pixel_values": pixels})
    assert [item.pixel_values.shape[0] for item in found] == [1, 1]
    assert all(torch.equal(item.pixel_values[0], row) for item, row in zip(found, pixels))


def test_other_processors_batches_stay_theirs_and_what_does_not_add_up_is_named():
    pixels = torch.randn(3, *case.ROW_SHAPE)
    # Gemma 3's image processor output: its num_crops say where an image ends
    [gemma3_item] = vitpool.items_from({"pixel_values": pixels, "num_crops": torch.tensor([2])})
    assert gemma3_item.pixel_values.shape[0] == 3
    with pytest.raises(ValueError, match=r"num_crops \(gemma3\).*pass that family's name"):
        vitpool.items_from({"pixel_values": pixels, "num_crops": torch.tensor([2])}, family="llava")
    # a prompt: LlavaProcessor's, and that of processors which drop their counts (not cut as views)
    prompt = {"pixel_values": pixels, "input_ids": torch.zeros(1, 5, dtype=torch.long)}
    prompt["attention_mask"] = torch.ones(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="are no family's processor output"):
        vitpool.items_from(prompt)
    with pytest.raises(ValueError, match=r"input_ids, attention_mask: a prompt .*image_processor\(images"):
        vitpool.items_from(prompt, family="llava")
    with pytest.raises(ValueError, match="one view an image"):
        vitpool.items_from({"pixel_values": pixels[None]}, family="llava")
    with pytest.raises(ValueError, match="return_tensors='pt'"):
        vitpool.items_from({"pixel_values": list(pixels)}, family="llava")
    with pytest.raises(ValueError, match="takes images only"):
        vitpool.items_from({"pixel_values": pixels, "pixel_values_videos": pixels}, family="llava")


# ---- the transformers drop-in ------------------------------------------------------------------


def test_the_drop_in_answers_get_image_features_and_the_models_forward(model):
    """`replace_vision_tower`: the model's own `get_image_features` and forward answer through a
    GraphEncoder over its own vision weights, and `restore_vision_tower` puts the modules back."""
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    pixel_values = views(2, 80).pixel_values
    tokens = [1, 2] + [case.IMAGE_TOKEN_ID] * case.TOKENS_PER_VIEW * 2 + [3]
    input_ids = torch.tensor([tokens])
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=pixel_values).pooler_output
        want_logits = model(input_ids=input_ids, pixel_values=pixel_values).logits
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    try:
        with torch.no_grad():
            got = model.model.get_image_features(pixel_values=pixel_values).pooler_output
            got_logits = model(input_ids=input_ids, pixel_values=pixel_values).logits
        with pytest.raises(ConfigError, match="vision_feature_layer=-2"):
            model.model.get_image_features(pixel_values=pixel_values, vision_feature_layer=-1)
    finally:
        restore_vision_tower(model, original)
    assert model.model.vision_tower is tower and model.model.multi_modal_projector is projector
    assert len(got) == len(want) == 2
    for mine, theirs in zip(got, want, strict=True):
        assert mine.shape == theirs.shape and relative_error(mine, theirs) <= TOLERANCE
    assert relative_error(got_logits, want_logits) <= TOLERANCE
