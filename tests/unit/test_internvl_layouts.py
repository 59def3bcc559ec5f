"""InternVL's checkpoint layouts and tower styles: OpenGVLab's release layout (config.json of
"internvl_chat" read without its remote code, `vision_model.*` with fused qkv, `mlp1.*`) loads
strictly and gives what transformers' model gives; the InternViT-6B style (RMSNorm, q/k RMSNorm,
no qkv bias) runs in vitpool as in transformers, from every layout. CPU, fp32, tiny random models;
the reference is Hugging Face's `get_image_features` on each image alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from family_cases import internvl as case
from safetensors.torch import save_file

from vitpool import CheckpointError, GraphEncoder, Image
from vitpool.families.internvl.checkpoint import (
    RELEASE_VISION_DEFAULTS,
    convert_checkpoint,
    release_config,
)
from vitpool.models.registry import FAMILIES

TOLERANCE = 1e-5
BUDGETS = [case.TOKENS_PER_TILE * tiles for tiles in (1, 2, 4)]
STYLES = {
    "300m": case.TINY_VISION,  # InternViT-300M: LayerNorm, qkv bias, no q/k norm
    "6b": case.TINY_VISION_6B,  # InternViT-6B: RMSNorm, q/k RMSNorm, no qkv bias
}
QKV_WEIGHT = "vision_model.encoder.layers.1.attn.qkv.weight"


@pytest.fixture(scope="module", params=sorted(STYLES))
def model(request):
    return case.hf_model(seed=5, vision=STYLES[request.param])


def tiles(count: int, seed: int) -> Image:
    return Image(torch.randn(count, *case.ROW_SHAPE, generator=torch.Generator().manual_seed(seed)))


def assert_matches(model, encoder: GraphEncoder, counts: tuple[int, ...] = (2, 1, 5)) -> None:
    items = [tiles(count, 20 + seed) for seed, count in enumerate(counts)]
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        expected = case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def write_release(model, directory: Path, state: dict | None = None, **config_changes) -> Path:
    """The model saved as OpenGVLab's release: config.json and model.safetensors."""
    config = {**case.release_config_json(model), **config_changes}
    (directory / "config.json").write_text(json.dumps(config))
    save_file(case.release_state(model) if state is None else state, str(directory / "model.safetensors"))
    return directory


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def test_the_6b_style_tower_is_what_transformers_builds_for_it():
    tower = case.hf_model(vision=case.TINY_VISION_6B).model.vision_tower
    layer = tower.encoder.layer[0]
    assert type(layer.layernorm_before).__name__ == "InternVLVisionRMSNorm"
    assert type(layer.attention.q_norm).__name__ == "InternVLVisionRMSNorm"
    assert layer.attention.q_proj.bias is None


def test_the_encoder_equals_get_image_features(model):
    assert_matches(model, case.encoder_of(model, BUDGETS))


def test_the_release_keys_become_the_modules_state(model):
    state = case.release_state(model)
    expected = case.encoder_of(model, BUDGETS).adapter.tower.state_dict()
    embeddings = {"vision_model.embeddings.class_embedding", "vision_model.embeddings.position_embedding"}
    assert embeddings | {QKV_WEIGHT, "mlp1.0.weight", "mlp1.1.weight", "mlp1.3.bias"} <= state.keys()
    assert not any(".q_proj." in key or "multi_modal_projector" in key for key in state)
    release = {key: tensor for key, tensor in state.items() if key.startswith(("vision_model.", "mlp1."))}
    converted = convert_checkpoint(release, None)
    assert converted.keys() == expected.keys()
    assert all(torch.equal(converted[key], expected[key]) for key in expected)


def test_loads_a_release_checkpoint_strictly(model, tmp_path):
    assert_matches(model, load(write_release(model, tmp_path)))


def test_loads_a_sharded_release_reading_only_the_vision_shard(model, tmp_path):
    state = case.release_state(model)
    vision = {key: tensor for key, tensor in state.items() if not key.startswith("language_model.")}
    save_file(vision, str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"not opened: language model only")
    weight_map = {key: "model-00001-of-00002.safetensors" for key in vision}
    weight_map["language_model.model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(case.release_config_json(model)))
    assert_matches(model, load(tmp_path), counts=(3,))


def test_loads_a_full_model_save_in_transformers_layout(model, tmp_path):
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert_matches(model, load(tmp_path), counts=(1, 4))


def test_a_release_resaved_tower_only_loads(model, tmp_path):
    """The release's config as vitpool reads it is a tower-only save's config."""
    release_config(case.release_config_json(model)).save_pretrained(tmp_path)
    module = case.encoder_of(model, BUDGETS).adapter.tower
    state = {key: tensor.contiguous() for key, tensor in module.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "internvl_vision"
    assert_matches(model, load(tmp_path), counts=(2,))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        # a fused qkv missing: its three parts are what the tower lacks
        (lambda state: state.pop(QKV_WEIGHT), r"missing keys.*layer\.1\.attention\.k_proj\.weight"),
        # a vision tensor the tower does not have (LoRA left in, say)
        (
            lambda state: state.update({"vision_model.encoder.layers.0.attn.lora_A": torch.zeros(1)}),
            r"unexpected keys.*lora_A",
        ),
        # the projector's last Linear missing
        (lambda state: state.pop("mlp1.3.weight"), r"missing keys.*multi_modal_projector\.linear_2\.weight"),
    ],
)
def test_release_weights_that_do_not_match_are_refused(model, tmp_path, change, match):
    state = case.release_state(model)
    change(state)
    with pytest.raises(CheckpointError, match=match):
        load(write_release(model, tmp_path, state))


def test_the_release_config_reads_as_transformers_converter_reads_it(model):
    raw = case.release_config_json(model)
    config = release_config(raw)
    vision = model.config.vision_config
    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "norm_type",
        "use_qk_norm",
        "attention_bias",
        "image_size",
        "patch_size",
    ):
        assert getattr(config, name) == getattr(vision, name), name
    assert config.model_type == "internvl_vision"
    assert config.text_hidden_size == case.TINY_TEXT["hidden_size"]
    assert (config.downsample_ratio, config.vision_feature_layer) == (0.5, -1)
    assert (config.projector_hidden_act, config.vision_feature_select_strategy) == ("gelu", "default")


def test_fields_a_release_config_leaves_out_take_the_remote_codes_defaults():
    raw = {"vision_config": {"model_type": "intern_vit_6b"}, "llm_config": {"hidden_size": 7168}}
    config = release_config({**raw, "ps_version": "v2"})
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (3200, 48, 25)
    assert (config.norm_type, config.use_qk_norm, config.attention_bias) == ("rms_norm", True, False)
    assert config.image_size == (RELEASE_VISION_DEFAULTS["image_size"],) * 2
    assert (config.downsample_ratio, config.vision_feature_layer) == (0.5, -1)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"ps_version": "v1"}, "ps_version 'v1'"),  # InternVL 1.5's pixel shuffle
        ({"ps_version": None}, "ps_version"),  # named nowhere: the remote code's default, v1
        ({"force_image_size": 2 * case.TILE}, "force_image_size"),
        ({"llm_config": {"model_type": "qwen2"}}, r"llm_config\.hidden_size"),
    ],
)
def test_release_configs_vitpool_does_not_run_are_refused(tmp_path, changes, match):
    model = case.hf_model(vision=case.TINY_VISION_6B)
    raw = {**case.release_config_json(model), **changes}
    raw = {key: value for key, value in raw.items() if value is not None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=f"{re.escape(str(tmp_path))}.*{match}"):
        load(tmp_path)


def test_q_k_norms_of_another_epsilon_than_transformers_are_refused():
    raw = case.release_config_json(case.hf_model(vision=case.TINY_VISION_6B))
    raw["vision_config"]["layer_norm_eps"] = 1e-5
    with pytest.raises(ValueError, match="q/k norms use 1e-06"):
        release_config(raw)


def test_a_release_that_selects_another_layer_is_refused(tmp_path):
    model = case.hf_model()
    with pytest.raises(ValueError, match="vision_feature_layer=-1"):
        load(write_release(model, tmp_path, select_layer=-4))


def test_an_internvit_release_alone_is_refused(tmp_path):
    """InternViT-300M-448px and the like: the tower's own config at the top, no projector."""
    vision = case.release_config_json(case.hf_model())["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(vision))
    with pytest.raises(CheckpointError, match="InternViT tower alone.*internvl_chat"):
        load(tmp_path)


def test_the_release_vision_type_is_an_internvl_family_and_passes_preflight(tmp_path):
    from vitpool.pool.preflight import check_family

    release, internvl = FAMILIES["intern_vit_6b"].checkpoint, FAMILIES["internvl_vision"].checkpoint
    assert release.prefixes == ("vision_model.", "mlp1.")
    assert release.read_full_config is not None and internvl.read_full_config is None
    (tmp_path / "config.json").write_text(json.dumps(case.release_config_json(case.hf_model())))
    check_family(str(tmp_path), None)  # a pool would start on it
