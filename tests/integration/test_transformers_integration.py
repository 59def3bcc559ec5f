"""The drop-in vision tower: a tiny random Qwen3-VL model in fp32 generates exactly the same
greedy tokens with its own tower, with an in-process GraphEncoder, and with a pool; and a tiny full
model of every other family (tests/integration/tiny_vlms.py) does with a GraphEncoder, the families
answered at get_image_features (InternVL, Llama 4, Step-3.7, DeepSeek-OCR-2, MiniCPM-V 4.6) too,
and Step-3.7 (views and crops) with a pool."""

from __future__ import annotations

import inspect
import tempfile

import pytest
import torch
from conftest import ROW_WIDTH
from tiny_vlms import TINY_FEATURE_VLMS, TINY_VLMS
from tiny_vlms import minicpmv4_6 as minicpmv4_6_case
from tiny_vlms import request as tiny_request
from transformers import AutoConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from vitpool import Embedding, EncoderPool
from vitpool.errors import ConfigError
from vitpool.integrations.transformers import (
    PooledImageFeatures,
    PooledVisionTower,
    graph_encoder_for,
    replace_vision_tower,
    restore_vision_tower,
)
from vitpool.models.loading import SHIPPED_CHECKPOINT

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model():
    vision_config = AutoConfig.from_pretrained(SHIPPED_CHECKPOINT).to_dict()
    config = Qwen3VLConfig(
        vision_config=vision_config,
        text_config={
            "hidden_size": vision_config["out_hidden_size"],
            "intermediate_size": 256,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
            "vocab_size": 151936,
            "max_position_embeddings": 4096,
        },
    )
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(config).eval()


def request(config, images=(), videos=()):
    """input_ids with the vision placeholders a processor would write, and the pixel rows."""
    generator = torch.Generator().manual_seed(7)
    ids = [1, 2, 3]
    inputs = {}
    if images:
        for t, h, w in images:
            ids += (
                [config.vision_start_token_id]
                + [config.image_token_id] * (t * h * w // 4)
                + [config.vision_end_token_id]
            )
        inputs["pixel_values"] = torch.cat(
            [torch.randn(t * h * w, ROW_WIDTH, generator=generator) for t, h, w in images]
        )
        inputs["image_grid_thw"] = torch.tensor(images)
    if videos:
        for t, h, w in videos:
            for _ in range(t):  # one group of placeholders per temporal patch, as Qwen3-VL's processor writes
                ids += (
                    [config.vision_start_token_id]
                    + [config.video_token_id] * (h * w // 4)
                    + [config.vision_end_token_id]
                )
        inputs["pixel_values_videos"] = torch.cat(
            [torch.randn(t * h * w, ROW_WIDTH, generator=generator) for t, h, w in videos]
        )
        inputs["video_grid_thw"] = torch.tensor(videos)
    ids += [4, 5]
    inputs["input_ids"] = torch.tensor([ids])
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return inputs


def generate(model, inputs) -> list[int]:
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return output[0, inputs["input_ids"].shape[1] :].tolist()


REQUESTS = {
    "images": {"images": [(1, 8, 8), (1, 4, 6)]},
    "video": {"videos": [(2, 4, 4)]},
    "both": {"images": [(1, 6, 4)], "videos": [(3, 4, 6)]},
}


def with_tower(model, encoder, inputs) -> list[int]:
    original = replace_vision_tower(model, encoder)
    try:
        return generate(model, inputs)
    finally:
        restore_vision_tower(model, original)


@pytest.mark.parametrize("name", list(REQUESTS))
def test_a_graph_encoder_tower_generates_the_same_tokens(model, name):
    inputs = request(model.config, **REQUESTS[name])
    expected = generate(model, inputs)
    encoder = graph_encoder_for(model, budgets=[16, 64])
    assert with_tower(model, encoder, inputs) == expected
    assert len(expected) == NEW_TOKENS
    # the tokens do depend on the embeddings: a tower of slightly changed outputs changes them
    assert with_tower(model, Nudged(encoder), inputs) != expected


class Nudged:
    """An encoder whose embeddings are the real ones plus noise."""

    def __init__(self, encoder) -> None:
        self.encoder = encoder

    def encode(self, items):
        generator = torch.Generator().manual_seed(3)
        return [
            Embedding(r.tokens + 0.5 * torch.randn(r.tokens.shape, generator=generator), r.deepstack)
            for r in self.encoder.encode(items)
        ]


def test_the_stand_in_returns_what_the_tower_returns(model):
    inputs = request(model.config, images=[(1, 8, 8), (1, 4, 6)])
    tower = model.model.visual
    with torch.no_grad():
        want = tower(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        got = PooledVisionTower(
            graph_encoder_for(model, budgets=[64]), 2, torch.float32, torch.device("cpu")
        )(inputs["pixel_values"], inputs["image_grid_thw"])
    torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=1e-4, atol=1e-5)
    assert len(got.deepstack_features) == len(want.deepstack_features) == 2
    for g, w in zip(got.deepstack_features, want.deepstack_features):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="rows"):
        PooledVisionTower(graph_encoder_for(model, budgets=[64]), 2, torch.float32, torch.device("cpu"))(
            inputs["pixel_values"][:-4], inputs["image_grid_thw"]
        )


@pytest.mark.ray
def test_a_pool_tower_generates_the_same_tokens(model, ray_cluster):
    directory = tempfile.mkdtemp(prefix="vitpool-tower-")
    model.model.visual.save_pretrained(directory)
    pool = EncoderPool.launch(
        model=directory, budgets=[16, 64], name="vitpool-transformers", device="cpu", dtype="float32"
    )
    try:
        for name, spec in REQUESTS.items():
            inputs = request(model.config, **spec)
            assert with_tower(model, pool, inputs) == generate(model, inputs), name
    finally:
        pool.shutdown()


# ---- every family: a tiny full model of each generates the same tokens through a GraphEncoder ----

FAMILY_REQUESTS = {
    "images": {"images": [(1, 8, 8), (1, 4, 6)]},
    "video": {"videos": [(2, 4, 4)]},
    "both": {"images": [(1, 6, 4)], "videos": [(3, 4, 6)]},
}


@pytest.mark.parametrize("family", list(TINY_VLMS))
def test_every_family_generates_the_same_tokens_through_a_graph_encoder(family):
    vlm = TINY_VLMS[family]
    model = vlm.build()
    encoder = graph_encoder_for(model, budgets=[16, 64])
    for name in vlm.requests:
        spec = FAMILY_REQUESTS[name]
        inputs = tiny_request(vlm, model.config, **spec)
        expected = generate(model, inputs)
        assert len(expected) == NEW_TOKENS, name
        assert with_tower(model, encoder, inputs) == expected, name
        assert not any(isinstance(module, PooledVisionTower) for module in model.modules())  # restored
        # the model's output does depend on the embeddings (a tiny MoE's greedy tokens may not)
        assert not torch.allclose(
            last_logits(model, Nudged(encoder), inputs), last_logits(model, encoder, inputs)
        ), name


def last_logits(model, encoder, inputs) -> torch.Tensor:
    original = replace_vision_tower(model, encoder)
    try:
        with torch.no_grad():
            return model(**inputs).logits[0, -1]
    finally:
        restore_vision_tower(model, original)


# ---- the families answered at get_image_features: images only ----


def llama4_inputs_embeds(model, inputs) -> torch.Tensor:
    """What Llama4ForConditionalGeneration.forward hands its LLM, by the calls it makes
    (get_image_features, the projector, get_placeholder_mask): transformers 5.24's forward itself
    fails on every call, with or without vitpool (it reads `image_outputs` of the text model's output)."""
    ids = inputs["input_ids"]
    embeds = model.get_input_embeddings()(ids)
    # transformers 5.17 requires the strategy ("default", as the forward passes it); 5.24 has none
    takes_strategy = (
        "vision_feature_select_strategy" in inspect.signature(model.get_image_features).parameters
    )
    strategy = {"vision_feature_select_strategy": "default"} if takes_strategy else {}
    features = model.get_image_features(
        pixel_values=inputs["pixel_values"], return_dict=True, **strategy
    ).last_hidden_state
    flat = model.multi_modal_projector(features.view(-1, features.size(-1)))
    return embeds.masked_scatter(
        model.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=flat), flat
    )


def generate_any(model, inputs) -> list[int]:
    if type(model).__name__ != "Llama4ForConditionalGeneration":
        return generate(model, inputs)
    with torch.no_grad():
        output = model.language_model.generate(
            inputs_embeds=llama4_inputs_embeds(model, inputs),
            attention_mask=inputs["attention_mask"],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return output[0].tolist()  # given embeddings alone, generate returns the new tokens alone


def logits_of(model, encoder, inputs) -> torch.Tensor:
    original = replace_vision_tower(model, encoder)
    try:
        with torch.no_grad():
            if type(model).__name__ == "Llama4ForConditionalGeneration":
                return model.language_model(inputs_embeds=llama4_inputs_embeds(model, inputs)).logits[0, -1]
            return model(**inputs).logits[0, -1]
    finally:
        restore_vision_tower(model, original)


def with_features(model, encoder, inputs) -> list[int]:
    original = replace_vision_tower(model, encoder)
    try:
        return generate_any(model, inputs)
    finally:
        restore_vision_tower(model, original)


def assert_restored(model) -> None:
    inner = getattr(model, "model", model)
    assert not any(isinstance(module, (PooledImageFeatures, PooledVisionTower)) for module in model.modules())
    assert "get_image_features" not in inner.__dict__  # the class's method again


@pytest.mark.parametrize("family", list(TINY_FEATURE_VLMS))
def test_a_family_answered_at_get_image_features_generates_the_same_tokens(family):
    if family == "minicpmv4_6" and minicpmv4_6_case.TOO_OLD:
        pytest.skip(minicpmv4_6_case.TOO_OLD)
    vlm = TINY_FEATURE_VLMS[family]
    model = vlm.build()
    inputs = vlm.request(model.config)
    encoder = graph_encoder_for(model, budgets=list(vlm.budgets))
    expected = generate_any(model, inputs)
    assert len(expected) == NEW_TOKENS
    assert with_features(model, encoder, inputs) == expected
    assert_restored(model)
    assert generate_any(model, inputs) == expected  # the original modules back, and working
    # the model's output does depend on the embeddings (a tiny MoE's greedy tokens may not)
    assert not torch.allclose(logits_of(model, Nudged(encoder), inputs), logits_of(model, encoder, inputs))


def test_a_replaced_family_refuses_what_vitpool_does_not_run():
    """Step-3.7: crop counts that do not add up; a second replacement; a restore with none.
    MiniCPM-V 4.6: the "4x" mode, which vitpool's graphs do not run."""
    step = TINY_FEATURE_VLMS["step3p7"]
    model = step.build()
    inputs = step.request(model.config)
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=list(step.budgets)))
    try:
        with pytest.raises(ValueError, match="num_local_patches"):
            model.model.get_image_features(inputs["pixel_values"], inputs["pixel_values_local"], [1, 0])
        with pytest.raises(TypeError, match="already replaced"):
            replace_vision_tower(model, graph_encoder_for(model, budgets=[4]))
    finally:
        restore_vision_tower(model, original)
    with pytest.raises(TypeError, match="not replaced"):
        restore_vision_tower(model, original)

    if minicpmv4_6_case.TOO_OLD:
        return  # the rest needs a release that runs MiniCPM-V 4.6
    minicpm = TINY_FEATURE_VLMS["minicpmv4_6"]
    model = minicpm.build()
    inputs = minicpm.request(model.config)
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=list(minicpm.budgets)))
    try:
        with pytest.raises(ConfigError, match="16x"):
            model.model.get_image_features(
                inputs["pixel_values"], inputs["target_sizes"], downsample_mode="4x"
            )
    finally:
        restore_vision_tower(model, original)


@pytest.mark.ray
def test_a_pool_answers_a_family_of_views_and_crops(ray_cluster, tmp_path):
    """Step-3.7 through a CPU pool loaded from the full model's save: the same tokens."""
    vlm = TINY_FEATURE_VLMS["step3p7"]
    model = vlm.build()
    model.save_pretrained(tmp_path, safe_serialization=True)
    inputs = vlm.request(model.config)
    pool = EncoderPool.launch(
        model=str(tmp_path),
        budgets=list(vlm.budgets),
        num_actors=1,
        name="vitpool-transformers-step3p7",
        device="cpu",
        dtype="float32",
    )
    try:
        assert with_features(model, pool, inputs) == generate_any(model, inputs)
        assert_restored(model)
    finally:
        pool.shutdown()
