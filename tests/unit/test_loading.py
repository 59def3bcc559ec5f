"""Loading local checkpoints: a tower-only save, a full Qwen3-VL model, and the errors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import image
from safetensors.torch import load_file, save_file

from vitpool import CheckpointError, GraphEncoder
from vitpool.models import SHIPPED_CHECKPOINT

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_tiny_checkpoint import TINY_CONFIG


def encode_tokens(path, item) -> torch.Tensor:
    encoder = GraphEncoder.from_pretrained(path, budgets=[16, 64], device="cpu")
    return encoder.encode([item])[0].tokens


@pytest.fixture(scope="module")
def item():
    return image(4, 8, torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def shipped_tokens(item):
    return encode_tokens(None, item)


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory) -> Path:
    """A tiny full Qwen3-VL model (language model included) whose tower is the shipped one, sharded."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        vision_config=TINY_CONFIG,
        text_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "vocab_size": 128,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        },
    )
    model = Qwen3VLForConditionalGeneration(config)
    model.model.visual.load_state_dict(load_file(SHIPPED_CHECKPOINT / "model.safetensors"))
    path = tmp_path_factory.mktemp("full")
    model.save_pretrained(path, max_shard_size="500KB")
    return path


def test_shipped_checkpoint_is_the_default(item, shipped_tokens):
    assert shipped_tokens.shape == (8, 128)
    assert torch.equal(encode_tokens(SHIPPED_CHECKPOINT, item), shipped_tokens)


def test_full_model_checkpoint_loads_the_vision_weights(full_checkpoint, item, shipped_tokens):
    index = json.loads((full_checkpoint / "model.safetensors.index.json").read_text())
    assert any(k.startswith("model.language_model.") for k in index["weight_map"])
    assert torch.allclose(encode_tokens(full_checkpoint, item), shipped_tokens, rtol=1e-5, atol=1e-6)


def test_visual_prefix_checkpoint(tmp_path, full_checkpoint, item, shipped_tokens):
    """Older exports keep the tower under `visual.` in one unsharded file."""
    state = {f"visual.{k}": v for k, v in load_file(SHIPPED_CHECKPOINT / "model.safetensors").items()}
    state["lm_head.weight"] = torch.zeros(4, 4)  # language-model weights are skipped
    save_file(state, tmp_path / "model.safetensors")
    shutil.copy(full_checkpoint / "config.json", tmp_path / "config.json")
    assert torch.allclose(encode_tokens(tmp_path, item), shipped_tokens, rtol=1e-5, atol=1e-6)


def test_the_vision_weights_digest_names_the_tower_and_nothing_else(tmp_path, full_checkpoint):
    """One digest for the shipped tower and a full model holding it (the language model's weights
    are not read), another as soon as one vision weight changes; a config-only directory (random
    weights in every process) never matches."""
    from vitpool.models.loading import vision_weights_digest

    shipped = vision_weights_digest(None)
    assert vision_weights_digest(full_checkpoint) == shipped == vision_weights_digest(SHIPPED_CHECKPOINT)
    state = load_file(SHIPPED_CHECKPOINT / "model.safetensors")
    name = max(state)
    state[name] = state[name].clone()
    state[name].view(-1)[0] += 1e-3
    save_file(state, tmp_path / "model.safetensors")
    shutil.copy(SHIPPED_CHECKPOINT / "config.json", tmp_path / "config.json")
    assert vision_weights_digest(tmp_path) != shipped
    (tmp_path / "model.safetensors").unlink()
    assert vision_weights_digest(tmp_path) != vision_weights_digest(tmp_path)


def tower_copy(tmp_path: Path) -> Path:
    shutil.copy(SHIPPED_CHECKPOINT / "config.json", tmp_path / "config.json")
    return tmp_path


def test_missing_key_is_named(tmp_path):
    state = load_file(SHIPPED_CHECKPOINT / "model.safetensors")
    del state["blocks.2.mlp.linear_fc1.weight"]
    save_file(state, tower_copy(tmp_path) / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing keys \['blocks.2.mlp.linear_fc1.weight'\]"):
        GraphEncoder.from_pretrained(tmp_path, budgets=[16], device="cpu")


def test_unexpected_key_is_named(tmp_path):
    state = load_file(SHIPPED_CHECKPOINT / "model.safetensors")
    state["blocks.9.attn.qkv.weight"] = torch.zeros(2, 2)
    save_file(state, tower_copy(tmp_path) / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected keys \['blocks.9.attn.qkv.weight'\]"):
        GraphEncoder.from_pretrained(tmp_path, budgets=[16], device="cpu")


def test_pickled_weights_are_refused(tmp_path):
    (tower_copy(tmp_path) / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="safetensors"):
        GraphEncoder.from_pretrained(tmp_path, budgets=[16], device="cpu")


def test_no_config_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        GraphEncoder.from_pretrained(tmp_path, budgets=[16], device="cpu")


def test_config_only_gives_random_weights(tmp_path, item, shipped_tokens):
    tokens = encode_tokens(tower_copy(tmp_path), item)
    assert tokens.shape == shipped_tokens.shape and torch.isfinite(tokens).all()
    assert not torch.allclose(tokens, shipped_tokens)


# (config.json, words the CheckpointError must contain)
UNSUPPORTED = {
    "unknown to transformers": (
        {"model_type": "not_a_vision_model"},
        "'not_a_vision_model' is not supported",
    ),
    "a family vitpool lacks": ("blip-2", "vision model type 'blip_2_vision_model' is not supported"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_an_unsupported_model_lists_the_supported_ones(tmp_path, name):
    config, words = UNSUPPORTED[name]
    if isinstance(config, dict):
        (tmp_path / "config.json").write_text(json.dumps(config))
    else:
        from transformers import AutoConfig

        AutoConfig.for_model(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError) as raised:
        GraphEncoder.from_pretrained(tmp_path, budgets=[16], device="cpu")
    assert words in str(raised.value) and "qwen3_vl_vision" in str(raised.value)


def test_a_family_whose_transformers_code_moved_fails_alone_naming_the_versions(monkeypatch):
    """A helper an adapter module imports that a release removed: that family's load raises a
    ConfigError naming the installed and the declared transformers versions; others still load."""
    import importlib

    import transformers

    from vitpool.errors import ConfigError
    from vitpool.models.registry import FAMILIES

    monkeypatch.delattr(importlib.import_module("transformers.vision_utils"), "get_vision_window_index")
    monkeypatch.delitem(sys.modules, "vitpool.families.qwen2_5_vl.adapter", raising=False)
    expected = rf"transformers {transformers.__version__} .*get_vision_window_index.*tested with transformers"
    with pytest.raises(ConfigError, match=expected):
        FAMILIES["qwen2_5_vl_vision"].adapter(None)
    GraphEncoder.from_pretrained(None, budgets=[16], device="cpu")  # Qwen3-VL still loads


def test_a_transformers_release_older_than_a_familys_minimum_is_refused(monkeypatch):
    """Before 5.19 Hugging Face's MiniCPM-V 4.6 merged slices of unlike sizes wrongly: its adapter
    refuses such a release by name rather than serve a family its tests could not check."""
    from family_cases.minicpmv4_6 import encoder_module, tiny_model

    from vitpool.errors import ConfigError
    from vitpool.families.minicpmv4_6.adapter import MiniCPMV4_6Adapter
    from vitpool.models import compat

    module = encoder_module(tiny_model())
    monkeypatch.setattr(compat, "installed_transformers", lambda: "5.18.0")
    with pytest.raises(ConfigError, match=r"transformers>=5\.19\.0.*5\.18\.0 is installed"):
        MiniCPMV4_6Adapter(module)


def test_prepare_to_load_reads_what_loading_needs_and_names_a_bad_checkpoint(tmp_path, full_checkpoint):
    """What a warm standby does ahead of a take-over: no error for a good checkpoint (tower-only or
    a full model's), the loading error for a bad one, before any GPU is involved."""
    from vitpool.models.loading import prepare_to_load

    prepare_to_load(None)
    prepare_to_load(full_checkpoint)
    with pytest.raises(CheckpointError):
        prepare_to_load(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-family"}))
    with pytest.raises(CheckpointError):
        prepare_to_load(tmp_path)
