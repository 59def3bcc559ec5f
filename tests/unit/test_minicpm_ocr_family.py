"""MiniCPM-OCR (`MiniCPMOcrVisionModel` + `MiniCPMOcrMerger`: MiniCPM-V 4.6's modules renamed, read
in "4x" by default): the static forward against the Hugging Face model's own `get_image_features`
on each image alone (CPU, fp32), for one image, images of different slice counts and sizes in one
call, and padding, in "4x" and in "16x"; loading from a full save, a sharded full save and a
tower-only save; a malformed item named by its index; the processor's output cut by
`vitpool.items_from` (from `num_patches_per_image`, else from the prompt in either mode) and what it
refuses; the transformers drop-in; the settings refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from family_cases.minicpm_ocr import (
    INSERT_LAYER_ID,
    PATCH,
    ROW_SHAPE,
    TEXT_HIDDEN,
    TINY_TEXT,
    TINY_VISION,
    TOO_OLD,
    encoder_module,
    full_config,
    image_features,
    strip_of,
    tiny_model,
)
from safetensors.torch import load_file, save_file
from test_minicpmv4_7_family import PROMPTS, pictures, tiny_tokenizer  # MiniCPM-V's pictures and tokens

import vitpool
from vitpool import GraphEncoder, Image, InvalidItemError
from vitpool.errors import CheckpointError, ConfigError
from vitpool.models import registry

pytestmark = pytest.mark.skipif(TOO_OLD is not None, reason=str(TOO_OLD))

TOLERANCE = 1e-5
BUDGETS = [8, 16, 32]
VISION_TYPE = "minicpm_ocr_vision"


def image(sizes: list[list[int]], seed: int) -> Image:
    rows = sum(h * w for h, w in sizes)
    return Image(torch.randn(rows, *ROW_SHAPE, generator=torch.Generator().manual_seed(seed)), sizes)


def tokens_of(sizes, patches_per_token: int = 4) -> int:
    return (
        sum(int(h) * int(w) for h, w in torch.as_tensor(sizes).reshape(-1, 2).tolist()) // patches_per_token
    )


@pytest.fixture(scope="module")
def hf_model():
    return tiny_model()


@pytest.fixture(scope="module")
def hf_model_16x():
    return tiny_model(seed=5, downsample_mode="16x")


def encoder_of(model) -> GraphEncoder:
    from vitpool.families.minicpm_ocr.adapter import MiniCPMOcrAdapter

    return GraphEncoder(
        MiniCPMOcrAdapter(encoder_module(model)), budgets=BUDGETS, device="cpu", dtype=torch.float32
    )


@pytest.fixture(scope="module")
def encoder(hf_model) -> GraphEncoder:
    return encoder_of(hf_model)


def assert_matches(hf_model, encoder: GraphEncoder, items: list[Image], patches_per_token: int = 4) -> None:
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        assert embedding.tokens.shape == (tokens_of(item.grid_thw, patches_per_token), TEXT_HIDDEN)
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, image_features(hf_model, item)) <= TOLERANCE


# The vision path is 4.6's; "4x" skips its window merger


def test_the_vision_modules_are_4_6s_under_new_names():
    """The reuse of 4.6's adapter and checkpoint layout holds while MiniCPM-OCR's tower and Merger
    have 4.6's parameters."""
    from transformers import MiniCPMV4_6Config
    from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6Model

    from vitpool.families.minicpm_ocr.adapter import build_encoder

    config_4_6 = MiniCPMV4_6Config(
        vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT), insert_layer_id=INSERT_LAYER_ID
    )
    model_4_6 = MiniCPMV4_6Model(config_4_6)
    expected = {
        **{f"vision_tower.{k}": v.shape for k, v in model_4_6.vision_tower.state_dict().items()},
        **{f"merger.{k}": v.shape for k, v in model_4_6.merger.state_dict().items()},
    }
    built = build_encoder(full_config())
    assert type(built.vision_tower).__name__ == "MiniCPMOcrVisionModel"
    assert {k: v.shape for k, v in built.state_dict().items()} == expected
    assert built.downsample_mode == "4x"  # MiniCPMOcrConfig's default


def test_one_image_matches_hugging_face(hf_model, encoder):
    assert_matches(hf_model, encoder, [image([[6, 6], [4, 6], [4, 6]], 1)])


def test_images_of_different_slices_in_one_call(hf_model, encoder):
    items = [
        image([[6, 6], [4, 6], [4, 6]], 2),  # an overview and two refined slices of another size
        image([[2, 2]], 3),  # one token
        image([[6, 2], [4, 4], [4, 4], [4, 4]], 4),
        image([[2, 6], [2, 2]], 5),
        image([[10, 4]], 6),  # larger than the 7 x 7 position table (nearest buckets)
    ]
    assert_matches(hf_model, encoder, items)
    # larger than every budget (32 tokens, 128 rows): eager, alone, at its own rows
    assert_matches(hf_model, encoder, [image([[12, 10], [8, 6]], 7), image([[2, 4]], 8)])
    # Hugging Face on the whole batch at once gives the same tokens: each slice is its own sequence
    rows = torch.cat([torch.as_tensor(item.pixel_values) for item in items])
    sizes = torch.tensor([size for item in items for size in item.grid_thw], dtype=torch.int32)
    with torch.no_grad():
        together = torch.cat(hf_model.get_image_features(strip_of(rows), sizes).pooler_output)
    ours = torch.cat([embedding.tokens for embedding in encoder.encode(items)])
    assert relative_error(ours, together) <= TOLERANCE


def test_padding_rows_do_not_change_real_rows(encoder):
    """One image alone in the smallest and the largest budget with garbage in the padding rows'
    pixels, and beside neighbours: the same tokens."""
    adapter = encoder.adapter
    item = image([[4, 6], [2, 4]], 9)
    spec = adapter.item_rules.item_spec("image", (32, *ROW_SHAPE), "float32", item.grid_thw)
    alone = []
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(rows, *ROW_SHAPE) * 100
        batch[:32] = item.pixel_values
        with torch.no_grad():
            metadata = adapter.build_metadata([spec], rows, budget)
            alone.append(adapter.forward(batch, metadata)[0][: spec.num_tokens])
    assert adapter.max_rows(encoder.budgets[0].num_tokens) == 32  # the smallest budget: no padding
    assert adapter.max_rows(encoder.budgets[-1].num_tokens) > 32
    crowded = encoder.encode([image([[4, 2]], 10), item, image([[2, 2]], 11)])[1].tokens
    assert relative_error(alone[1], alone[0]) <= TOLERANCE
    assert relative_error(crowded, alone[0]) <= TOLERANCE


def test_a_malformed_item_is_named_by_its_index(encoder):
    good = image([[2, 2]], 12)
    with pytest.raises(InvalidItemError, match=r"item 1: .*need sum of h\*w = 8") as raised:
        encoder.encode([good, Image(torch.randn(4, *ROW_SHAPE), [[2, 2], [2, 2]]), good])
    assert raised.value.index == 1
    with pytest.raises(InvalidItemError, match=r"item 2: .*'4x' h and w must be multiples of 2"):
        encoder.encode([good, good, Image(torch.randn(6, *ROW_SHAPE), [[3, 2]])])
    with pytest.raises(InvalidItemError, match="item 1: .*dtype"):
        encoder.encode([good, Image(torch.zeros(4, *ROW_SHAPE, dtype=torch.int64), [[2, 2]])])
    with pytest.raises(InvalidItemError, match="item 0: MiniCPM-OCR takes images only"):
        encoder.encode([vitpool.Video(torch.randn(16, *ROW_SHAPE), [[4, 4]])])
    with pytest.raises(InvalidItemError, match="item 1: .*zero or negative"):  # an empty image
        encoder.encode([good, Image(torch.randn(0, *ROW_SHAPE), [[0, 2]])])
    assert encoder.encode([]) == []  # an empty call is no error (GraphEncoder's contract)
    assert encoder.encode([good])[0].tokens.shape == (1, TEXT_HIDDEN)  # the encoder keeps working


def test_the_16x_mode_is_4_6s_forward(hf_model_16x):
    """downsample_mode "16x" in the config: both merges, h*w / 16 tokens, slices of multiples of 4."""
    encoder = encoder_of(hf_model_16x)
    assert encoder.adapter.is_16x
    items = [image([[8, 8], [4, 8], [4, 8]], 20), image([[4, 4]], 21), image([[12, 4], [8, 8]], 22)]
    assert_matches(hf_model_16x, encoder, items, patches_per_token=16)
    with pytest.raises(InvalidItemError, match=r"item 0: .*'16x' h and w must be multiples of 4"):
        encoder.encode([image([[2, 6]], 23)])


def test_unsupported_settings_are_refused():
    from vitpool.families.minicpm_ocr.adapter import build_encoder, check_supported, tower_only_config

    with pytest.raises(ConfigError, match="MiniCPM-OCR: .*merger_times 2"):
        build_encoder(full_config(merger_times=2))
    with pytest.raises(ConfigError, match="MiniCPM-OCR: .*merger_times 2"):
        build_encoder(full_config(merger_times=2, downsample_mode="16x"))
    vision = full_config().vision_config
    with pytest.raises(ConfigError, match="MiniCPM-OCR: .*downsample_mode '8x'"):
        check_supported(vision, {"downsample_mode": "8x", "merge_kernel_size": (2, 2), "merger_times": 1})
    with pytest.raises(ConfigError, match=r"MiniCPM-OCR: .*merge_kernel_size \(3, 3\)"):
        check_supported(vision, {"downsample_mode": "4x", "merge_kernel_size": (3, 3), "merger_times": 1})
    with pytest.raises(ValueError, match="text_hidden_size"):
        build_encoder(full_config().vision_config)
    encoder = build_encoder(tower_only_config(full_config()), torch.bfloat16)
    assert encoder.merger.mlp[0].linear_2.weight.dtype == torch.bfloat16
    assert encoder.merger.mlp[0].linear_2.out_features == TEXT_HIDDEN


# Loading through GraphEncoder.from_pretrained (the registry's "minicpm_ocr_vision" family)


def test_the_registry_names_the_modules_checkpoint_prefixes():
    """The registry imports no modeling code, so the record spells the prefixes out; they must agree."""
    from vitpool.families.minicpm_ocr.adapter import CHECKPOINT_PREFIXES

    assert registry.FAMILIES[VISION_TYPE].checkpoint.prefixes == CHECKPOINT_PREFIXES
    assert registry.record_of("minicpm_ocr").name == "minicpm_ocr"


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(model, loaded: GraphEncoder, seed: int, patches_per_token: int = 4) -> None:
    item = image([[8, 4], [4, 4]], seed)
    tokens = loaded.encode([item])[0].tokens
    assert tokens.shape == (tokens_of(item.grid_thw, patches_per_token), TEXT_HIDDEN)
    assert relative_error(tokens, image_features(model, item)) <= TOLERANCE


def save_full(model, directory: Path, **save_options) -> set[str]:
    """The full model (`MiniCPMOcrForConditionalGeneration`) with the test's vision weights, saved;
    its keys."""
    from transformers import MiniCPMOcrForConditionalGeneration

    full = MiniCPMOcrForConditionalGeneration(model.config)
    full.model.load_state_dict(model.state_dict())
    full.save_pretrained(directory, **save_options)
    keys = set()
    for file in directory.glob("*.safetensors"):
        keys.update(load_file(str(file)))
    assert any(k.startswith("model.vision_tower.") for k in keys)
    assert any(k.startswith("model.merger.") for k in keys)
    return keys


def test_loads_a_full_model_save(hf_model, hf_model_16x, tmp_path: Path):
    save_full(hf_model, tmp_path / "4x")
    assert json.loads((tmp_path / "4x" / "config.json").read_text())["model_type"] == "minicpm_ocr"
    assert_loaded(hf_model, load(tmp_path / "4x"), 13)
    save_full(hf_model_16x, tmp_path / "16x")  # the mode comes from the saved config
    assert_loaded(hf_model_16x, load(tmp_path / "16x"), 13, patches_per_token=16)


def test_loads_a_sharded_full_model_save(hf_model, tmp_path: Path):
    save_full(hf_model, tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    holding_vision = [
        shard
        for shard in shards
        if any(key.startswith(("model.vision_tower.", "model.merger.")) for key in load_file(str(shard)))
    ]
    assert len(holding_vision) > 1  # the vision weights themselves are split across shards
    assert_loaded(hf_model, load(tmp_path), 14)


def save_tower_only(
    model, directory: Path, state: dict[str, torch.Tensor] | None = None, drop_mode=False
) -> None:
    from vitpool.families.minicpm_ocr.adapter import tower_only_config

    config = tower_only_config(model.config)
    if drop_mode:
        del config.downsample_mode
    config.save_pretrained(directory)
    if state is None:
        state = encoder_module(model).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))


def test_loads_a_tower_only_save(hf_model, tmp_path: Path):
    save_tower_only(hf_model, tmp_path / "named")
    config = json.loads((tmp_path / "named" / "config.json").read_text())
    assert config["model_type"] == VISION_TYPE and config["downsample_mode"] == "4x"
    assert_loaded(hf_model, load(tmp_path / "named"), 15)
    # a save that names no mode is read in MiniCPM-OCR's default, "4x" (4.6's would be "16x")
    save_tower_only(hf_model, tmp_path / "unnamed", drop_mode=True)
    assert "downsample_mode" not in json.loads((tmp_path / "unnamed" / "config.json").read_text())
    assert_loaded(hf_model, load(tmp_path / "unnamed"), 16)


def test_a_missing_weight_is_named(hf_model, tmp_path: Path):
    state = encoder_module(hf_model).state_dict()
    del state["merger.mlp.0.linear_1.bias"]
    save_tower_only(hf_model, tmp_path, state)
    with pytest.raises(CheckpointError, match=r"merger\.mlp\.0\.linear_1\.bias"):
        load(tmp_path)


# The processor's output as items (vitpool.items_from)


def real_processor(monkeypatch, mode: str = "4x"):
    """The real MiniCPMOcrProcessor over MiniCPM-V 4.6's PIL image processor in `mode` (slices of
    about 8 x 8 patches): MiniCPMOcrImageProcessor is that processor on torchvision (absent here)
    with "4x" as its default, and the same output. The class check is skipped for the image and
    video processors; the video processor is a stand-in that is never called (images only)."""
    pytest.importorskip("PIL")
    from transformers import MiniCPMOcrProcessor
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil
    from transformers.video_processing_utils import BaseVideoProcessor

    class UnusedVideoProcessor(BaseVideoProcessor):
        slice_mode = True
        downsample_mode = mode

    check = MiniCPMOcrProcessor.check_argument_for_proper_class

    def check_the_tokenizer(self, name, argument):
        return None if name in ("image_processor", "video_processor") else check(self, name, argument)

    monkeypatch.setattr(MiniCPMOcrProcessor, "check_argument_for_proper_class", check_the_tokenizer)
    image_processor = MiniCPMV4_6ImageProcessorPil(
        scale_resolution=112, max_slice_nums=4, patch_size=PATCH, downsample_mode=mode
    )
    return MiniCPMOcrProcessor(image_processor, UnusedVideoProcessor(), tiny_tokenizer())


@pytest.mark.parametrize("mode", ["4x", "16x"])
def test_the_full_processors_batch_is_cut_by_its_prompt(hf_model, hf_model_16x, monkeypatch, mode):
    """MiniCPMOcrProcessor drops num_patches_per_image; `items_from` reads each image's slices from
    the runs of image tokens (h*w / 4 long in "4x", h*w / 16 in "16x"). Each item is what the
    processor gives for that image alone, and encodes as Hugging Face does on the whole batch."""
    model, ratio = (hf_model, 4) if mode == "4x" else (hf_model_16x, 16)
    processor = real_processor(monkeypatch, mode)
    images = pictures()
    out = processor(images=images, text=PROMPTS, return_tensors="pt", return_mm_token_type_ids=True)
    assert "num_patches_per_image" not in out
    counts = processor.image_processor(images)["num_patches_per_image"]
    assert counts == [3, 1, 3]  # the batch needs cutting: slice counts differ
    assert int(out["mm_token_type_ids"].sum()) == tokens_of(out["target_sizes"], ratio)
    items = vitpool.items_from(out)  # found by its keys: the MiniCPM families' one cut
    assert [len(item.grid_thw) for item in items] == counts
    for item, picture in zip(items, images, strict=True):
        alone = processor.image_processor(picture, return_tensors="pt")
        assert torch.equal(torch.as_tensor(item.pixel_values), alone["pixel_values"])
        assert torch.equal(torch.as_tensor(item.grid_thw), alone["target_sizes"])
    with torch.no_grad():
        expected = torch.cat(model.get_image_features(out["pixel_values"], out["target_sizes"]).pooler_output)
    ours = torch.cat([embedding.tokens for embedding in encoder_of(model).encode(items)])
    assert ours.shape == (tokens_of(out["target_sizes"], ratio), TEXT_HIDDEN)
    assert relative_error(ours, expected) <= TOLERANCE


def test_the_image_processors_batch_is_cut_by_its_counts(monkeypatch, tmp_path: Path):
    processor = real_processor(monkeypatch)
    images = pictures()
    out = processor.image_processor(images, return_tensors="pt")
    assert any(h % 4 for h, _ in out["target_sizes"].tolist())  # "4x" slices: multiples of 2 only
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "minicpm_ocr"}))
    for items in (vitpool.items_from(out, family="minicpm_ocr"), vitpool.items_from(out, model=tmp_path)):
        assert [len(item.grid_thw) for item in items] == out["num_patches_per_image"]
        for item, picture in zip(items, images, strict=True):
            alone = processor.image_processor(picture, return_tensors="pt")
            assert torch.equal(torch.as_tensor(item.pixel_values), alone["pixel_values"])


def test_a_batch_that_cannot_be_cut_says_what_is_missing(monkeypatch):
    processor = real_processor(monkeypatch)
    images = pictures()
    out = dict(processor(images=images, text=PROMPTS, return_tensors="pt", return_mm_token_type_ids=True))
    how = r"MiniCPMOcrProcessor .*processor\.image_processor\(images.*one image at a time"
    without_types = {k: v for k, v in out.items() if k != "mm_token_type_ids"}
    with pytest.raises(ValueError, match=f"no num_patches_per_image .*no mm_token_type_ids.*{how}"):
        vitpool.items_from(without_types, family="minicpm_ocr")
    with pytest.raises(ValueError, match="no num_patches_per_image .*no input_ids or mm_token_type_ids"):
        vitpool.items_from({"pixel_values": out["pixel_values"], "target_sizes": out["target_sizes"]})
    with pytest.raises(ValueError, match="no target_sizes"):
        vitpool.items_from({"pixel_values": out["pixel_values"]}, family="minicpm_ocr")
    # a prompt cut short: a slice's run too short (fits neither mode), or runs missing
    short = {**out, "mm_token_type_ids": out["mm_token_type_ids"].clone()}
    first_image_token = int(short["mm_token_type_ids"][0].tolist().index(1))
    short["mm_token_type_ids"][0, first_image_token] = 0
    with pytest.raises(ValueError, match=rf"slice 0's run of image tokens is 17 long.*\(6, 12\).*{how}"):
        vitpool.items_from(short, family="minicpm_ocr")
    with pytest.raises(ValueError, match=f"holds 4 runs of image tokens.*target_sizes 7 rows.*{how}"):
        vitpool.items_from(
            {**out, "input_ids": out["input_ids"][:1], "mm_token_type_ids": out["mm_token_type_ids"][:1]},
            family="minicpm_ocr",
        )
    # counts and rows that do not add up; videos
    image_output = dict(processor.image_processor(images, return_tensors="pt"))
    miscounted = r"num_patches_per_image \[3, 1, 2\] accounts for 6 slices; target_sizes has 7"
    with pytest.raises(ValueError, match=miscounted):
        vitpool.items_from({**image_output, "num_patches_per_image": [3, 1, 2]}, family="minicpm_ocr")
    with pytest.raises(ValueError, match="the 7 target_sizes rows account for"):
        vitpool.items_from(
            {**image_output, "pixel_values": image_output["pixel_values"][..., :-PATCH]}, family="minicpm_ocr"
        )
    with pytest.raises(ValueError, match="images only"):
        vitpool.items_from(
            {**image_output, "pixel_values_videos": image_output["pixel_values"]}, family="minicpm_ocr"
        )


# The transformers drop-in


def test_the_transformers_drop_in_answers_get_image_features(hf_model):
    from transformers import MiniCPMOcrForConditionalGeneration

    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = MiniCPMOcrForConditionalGeneration(hf_model.config).eval()
    model.model.load_state_dict(hf_model.state_dict())
    model.model.config.vision_config._attn_implementation = "sdpa"
    item = image([[6, 6], [4, 6], [4, 6]], 17)
    strip, sizes = strip_of(item.pixel_values), torch.tensor(item.grid_thw, dtype=torch.int32)
    with torch.no_grad():
        expected = model.model.get_image_features(strip, sizes).pooler_output
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    assert type(model.model.vision_tower).__name__ == "MiniCPMOcrFeatures"  # vitpool answers now
    with torch.no_grad():
        answered = model.model.get_image_features(strip, sizes).pooler_output
    assert [t.shape for t in answered] == [t.shape for t in expected]
    assert relative_error(torch.cat(answered), torch.cat(expected)) <= TOLERANCE
    with pytest.raises(ConfigError, match="MiniCPM-OCR: .*runs the model's downsample_mode '4x'; got '16x'"):
        model.model.get_image_features(strip, sizes, downsample_mode="16x")
    restore_vision_tower(model, original)
    assert type(model.model.vision_tower).__name__ == "MiniCPMOcrVisionModel"
