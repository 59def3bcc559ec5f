"""MiniCPM-V 4.6 (`MiniCPMV4_6VisionModel` + `MiniCPMV4_6Merger`): the static forward against the
Hugging Face model's own `get_image_features` on each image alone (fp32), for images of different
slice counts and sizes in one call; the processor's output as an item; loading from a full-model
save and from a tower-only save; the settings the adapter refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases.minicpmv4_6 import (
    ROW_SHAPE,
    TEXT_HIDDEN,
    TOO_OLD,
    encoder_module,
    full_config,
    image_features,
    tiny_model,
)
from safetensors.torch import load_file, save_file

from vitpool import GraphEncoder, Image
from vitpool.errors import CheckpointError, ConfigError
from vitpool.families.minicpmv4_6.adapter import (
    CHECKPOINT_PREFIXES,
    MiniCPMV4_6Adapter,
    build_encoder,
    convert_checkpoint,
    tower_only_config,
)
from vitpool.families.minicpmv4_6.rules import patch_rows
from vitpool.models import registry
from vitpool.packing import Budget

pytestmark = pytest.mark.skipif(TOO_OLD is not None, reason=str(TOO_OLD))

TOLERANCE = 1e-5
BUDGETS = [8, 16, 32]
MODEL_TYPE = "minicpmv4_6_vision"


def image(sizes: list[list[int]], seed: int) -> Image:
    rows = sum(h * w for h, w in sizes)
    return Image(torch.randn(rows, *ROW_SHAPE, generator=torch.Generator().manual_seed(seed)), sizes)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_model()


@pytest.fixture(scope="module")
def encoder(hf_model) -> GraphEncoder:
    adapter = MiniCPMV4_6Adapter(encoder_module(hf_model))
    return GraphEncoder(adapter, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_matches(hf_model, encoder: GraphEncoder, items: list[Image]) -> None:
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        tokens = sum(h * w for h, w in item.grid_thw) // 16
        assert embedding.tokens.shape == (tokens, TEXT_HIDDEN)
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, image_features(hf_model, item)) <= TOLERANCE


def test_images_of_different_slices_in_one_call(hf_model, encoder):
    items = [
        image([[8, 8], [4, 8], [4, 8]], 1),  # overview and two refined slices of another size
        image([[4, 4]], 2),
        image([[12, 4], [8, 8], [8, 8], [8, 8], [8, 8]], 3),
        image([[4, 12], [4, 4]], 4),
        image([[16, 8]], 5),  # larger than the position table (nearest buckets)
    ]
    assert_matches(hf_model, encoder, items)
    # larger than every budget: eager, alone, at its own rows
    assert_matches(hf_model, encoder, [image([[24, 16], [16, 12]], 6), image([[4, 8]], 7)])


def test_padding_rows_do_not_change_real_rows(encoder):
    """One image alone in the smallest and the largest budget with garbage in the padding rows'
    pixels, and beside neighbours: the same tokens."""
    adapter = encoder.adapter
    item = image([[4, 8], [4, 4]], 8)
    spec = adapter.item_rules.item_spec("image", (48, *ROW_SHAPE), "float32", item.grid_thw)
    alone = []
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(rows, *ROW_SHAPE) * 100
        batch[:48] = item.pixel_values
        with torch.no_grad():
            metadata = adapter.build_metadata([spec], rows, budget)
            alone.append(adapter.forward(batch, metadata)[0][: spec.num_tokens])
    crowded = encoder.encode([image([[8, 4]], 9), item, image([[4, 4]], 10)])[1].tokens
    assert relative_error(alone[1], alone[0]) <= TOLERANCE
    assert relative_error(crowded, alone[0]) <= TOLERANCE


def test_metadata_of_padding_is_valid(encoder):
    adapter = encoder.adapter
    budget = Budget(8, (("sequences", 4),), 4)
    spec = adapter.item_rules.item_spec("image", (48, *ROW_SHAPE), "float32", [[4, 8], [4, 4]])
    metadata = adapter.build_metadata([spec], 128, budget)
    assert metadata["cu_seqlens"].tolist() == [0, 32, 48, 128, 128, 128]
    assert metadata["cu_seqlens_merged"].tolist() == [0, 8, 12, 32, 32, 32]
    # the first 2 x 2 window of the 4 x 8 slice; padding rows stay in place
    assert metadata["window_index"][:4].tolist() == [0, 1, 8, 9]
    assert metadata["window_index"][48:].tolist() == list(range(48, 128))
    # token 0 of the 4 x 8 slice merges rows (0, 1, 4, 5) of its 2 x 4 merged grid; slice 2 starts at row 8
    assert metadata["merge_index"][:3].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 10, 11]]
    assert metadata["merge_index"][3:].tolist() == torch.arange(12, 32).view(-1, 4).tolist()
    assert metadata["position_ids"][48:].abs().sum() == 0
    with pytest.raises(ValueError, match="the buffers hold"):
        adapter.build_metadata([spec] * 3, 128, budget)  # 6 sequences


def test_the_processors_output_is_one_item(hf_model, encoder):
    from PIL import Image as PILImage
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    # slices of about 8 x 8 patches
    processor = MiniCPMV4_6ImageProcessorPil(scale_resolution=112, max_slice_nums=4)
    pixels = np.random.RandomState(0).randint(0, 255, (90, 200, 3), dtype=np.uint8)
    out = processor(PILImage.fromarray(pixels), return_tensors="pt")
    target_sizes = out["target_sizes"]
    assert len({tuple(size) for size in target_sizes.tolist()}) > 1  # slices of unequal sizes
    item = Image(out["pixel_values"], target_sizes)  # as the processor emits it
    [embedding] = encoder.encode([item])
    tokens = int((target_sizes[:, 0] * target_sizes[:, 1]).sum()) // 16
    assert embedding.tokens.shape == (tokens, TEXT_HIDDEN)
    with torch.no_grad():
        expected = torch.cat(hf_model.get_image_features(out["pixel_values"], target_sizes).pooler_output)
    assert relative_error(embedding.tokens, expected) <= TOLERANCE
    # its patches given as rows are the same item, and so is the NumPy strip
    [as_rows] = encoder.encode([Image(patch_rows(out["pixel_values"]), target_sizes)])
    [from_numpy] = encoder.encode([Image(out["pixel_values"].numpy(), target_sizes)])
    assert torch.equal(as_rows.tokens, embedding.tokens) and torch.equal(from_numpy.tokens, embedding.tokens)


def test_unsupported_settings_are_refused():
    with pytest.raises(ConfigError, match="downsample_mode '4x'"):
        build_encoder(full_config(downsample_mode="4x"))
    with pytest.raises(ConfigError, match="merger_times 2"):
        build_encoder(full_config(merger_times=2))
    with pytest.raises(ValueError, match="text_hidden_size"):
        build_encoder(full_config().vision_config)
    encoder = build_encoder(tower_only_config(full_config()), torch.bfloat16)
    assert encoder.merger.mlp[0].linear_2.weight.dtype == torch.bfloat16
    assert encoder.merger.mlp[0].linear_2.out_features == TEXT_HIDDEN


# Loading through GraphEncoder.from_pretrained (the registry's "minicpmv4_6_vision" family).


def test_the_registry_names_the_modules_checkpoint_prefixes():
    """The registry imports no modeling code, so it spells the prefixes out; they must agree."""
    assert registry.FAMILIES[MODEL_TYPE].checkpoint.prefixes == CHECKPOINT_PREFIXES


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(hf_model, loaded: GraphEncoder, seed: int) -> None:
    item = image([[8, 4], [4, 4]], seed)
    assert relative_error(loaded.encode([item])[0].tokens, image_features(hf_model, item)) <= TOLERANCE


def save_tower_only(hf_model, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    tower_only_config(hf_model.config).save_pretrained(directory)
    if state is None:
        state = encoder_module(hf_model).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))


def test_loads_a_full_model_save(hf_model, tmp_path: Path):
    from transformers import MiniCPMV4_6ForConditionalGeneration

    full = MiniCPMV4_6ForConditionalGeneration(full_config())
    full.model.load_state_dict(hf_model.state_dict())
    full.save_pretrained(tmp_path)
    keys = set()
    for file in tmp_path.glob("*.safetensors"):
        keys.update(load_file(str(file)))
    assert any(k.startswith("model.vision_tower.") for k in keys)
    assert any(k.startswith("model.merger.") for k in keys)
    assert_loaded(hf_model, load(tmp_path), 11)


def test_loads_a_tower_only_save(hf_model, tmp_path: Path):
    save_tower_only(hf_model, tmp_path)
    assert_loaded(hf_model, load(tmp_path), 12)


def test_a_missing_weight_is_named(hf_model, tmp_path: Path):
    state = encoder_module(hf_model).state_dict()
    del state["merger.mlp.0.linear_1.bias"]
    save_tower_only(hf_model, tmp_path, state)
    with pytest.raises(CheckpointError, match=r"merger\.mlp\.0\.linear_1\.bias"):
        load(tmp_path)


def test_convert_checkpoint_maps_both_layouts(hf_model):
    own = encoder_module(hf_model).state_dict()
    assert convert_checkpoint(dict(own)).keys() == own.keys()
    full = {f"model.{key}": value for key, value in own.items()}
    assert convert_checkpoint(full).keys() == own.keys()
    assert "model.language_model.x" in convert_checkpoint({"model.language_model.x": torch.zeros(1)})
