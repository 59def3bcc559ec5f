"""MiniCPM-V 4.7 (`MiniCPMV4_7VisionModel` + `MiniCPMV4_7Merger`, run by 4.6's adapter): the
static forward against the Hugging Face model's own `get_image_features` on each image alone (CPU,
fp32), for one image, images of different slice counts and sizes in one call, and padding; loading
from a full save, a sharded full save and a tower-only save; a malformed item named by its index;
the real processor's output cut by `vitpool.items_from` (from `num_patches_per_image`, else from the
prompt's `mm_token_type_ids`) and what it refuses; the transformers drop-in; the settings refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases.minicpmv4_7 import (
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

import vitpool
from vitpool import GraphEncoder, Image, InvalidItemError
from vitpool.errors import CheckpointError, ConfigError
from vitpool.models import registry

pytestmark = pytest.mark.skipif(TOO_OLD is not None, reason=str(TOO_OLD))

TOLERANCE = 1e-5
BUDGETS = [8, 16, 32]
VISION_TYPE = "minicpmv4_7_vision"
PLACEHOLDER = "<|image_pad|>"
PROMPTS = [f"a{PLACEHOLDER}b{PLACEHOLDER}", f"c{PLACEHOLDER}"]  # two prompts, three images


def image(sizes: list[list[int]], seed: int) -> Image:
    rows = sum(h * w for h, w in sizes)
    return Image(torch.randn(rows, *ROW_SHAPE, generator=torch.Generator().manual_seed(seed)), sizes)


def tokens_of(sizes) -> int:
    return sum(int(h) * int(w) for h, w in torch.as_tensor(sizes).reshape(-1, 2).tolist()) // 16


@pytest.fixture(scope="module")
def hf_model():
    return tiny_model()


@pytest.fixture(scope="module")
def encoder(hf_model) -> GraphEncoder:
    from vitpool.families.minicpmv4_7.adapter import MiniCPMV4_7Adapter

    adapter = MiniCPMV4_7Adapter(encoder_module(hf_model))
    return GraphEncoder(adapter, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_matches(hf_model, encoder: GraphEncoder, items: list[Image]) -> None:
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        assert embedding.tokens.shape == (tokens_of(item.grid_thw), TEXT_HIDDEN)
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, image_features(hf_model, item)) <= TOLERANCE


# The vision path is 4.6's


def test_the_vision_modules_are_4_6s_under_new_names():
    """The reuse of 4.6's adapter holds while 4.7's tower and Merger have 4.6's parameters."""
    from transformers import MiniCPMV4_6Config
    from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6Model

    from vitpool.families.minicpmv4_7.adapter import build_encoder

    config_4_6 = MiniCPMV4_6Config(
        vision_config=dict(TINY_VISION), text_config=dict(TINY_TEXT), insert_layer_id=INSERT_LAYER_ID
    )
    model_4_6 = MiniCPMV4_6Model(config_4_6)
    expected = {
        **{f"vision_tower.{k}": v.shape for k, v in model_4_6.vision_tower.state_dict().items()},
        **{f"merger.{k}": v.shape for k, v in model_4_6.merger.state_dict().items()},
    }
    built = build_encoder(full_config())
    assert type(built.vision_tower).__name__ == "MiniCPMV4_7VisionModel"
    assert {k: v.shape for k, v in built.state_dict().items()} == expected


def test_one_image_matches_hugging_face(hf_model, encoder):
    assert_matches(hf_model, encoder, [image([[8, 8], [4, 8], [4, 8]], 1)])


def test_images_of_different_slices_in_one_call(hf_model, encoder):
    items = [
        image([[8, 8], [4, 8], [4, 8]], 2),  # an overview and two refined slices of another size
        image([[4, 4]], 3),
        image([[12, 4], [8, 8], [8, 8], [8, 8], [8, 8]], 4),
        image([[4, 12], [4, 4]], 5),
        image([[16, 8]], 6),  # larger than the 6 x 6 position table (nearest buckets)
    ]
    assert_matches(hf_model, encoder, items)
    # larger than every budget: eager, alone, at its own rows
    assert_matches(hf_model, encoder, [image([[24, 16], [16, 12]], 7), image([[4, 8]], 8)])
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
    item = image([[4, 8], [4, 4]], 9)
    spec = adapter.item_rules.item_spec("image", (48, *ROW_SHAPE), "float32", item.grid_thw)
    alone = []
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(rows, *ROW_SHAPE) * 100
        batch[:48] = item.pixel_values
        with torch.no_grad():
            metadata = adapter.build_metadata([spec], rows, budget)
            alone.append(adapter.forward(batch, metadata)[0][: spec.num_tokens])
    assert encoder.budgets[-1].num_tokens * 16 > 48  # the largest budget has padding rows
    crowded = encoder.encode([image([[8, 4]], 10), item, image([[4, 4]], 11)])[1].tokens
    assert relative_error(alone[1], alone[0]) <= TOLERANCE
    assert relative_error(crowded, alone[0]) <= TOLERANCE


def test_a_malformed_item_is_named_by_its_index(encoder):
    good = image([[4, 4]], 12)
    with pytest.raises(InvalidItemError, match=r"item 1: .*need sum of h\*w = 32") as raised:
        encoder.encode([good, Image(torch.randn(16, *ROW_SHAPE), [[4, 4], [4, 4]]), good])
    assert raised.value.index == 1
    with pytest.raises(InvalidItemError, match="item 0: MiniCPM-V 4.7 takes images only"):
        encoder.encode([vitpool.Video(torch.randn(16, *ROW_SHAPE), [[4, 4]])])
    assert encoder.encode([good])[0].tokens.shape == (1, TEXT_HIDDEN)  # the encoder keeps working


def test_unsupported_settings_are_refused():
    from vitpool.families.minicpmv4_7.adapter import build_encoder, tower_only_config

    with pytest.raises(ConfigError, match="MiniCPM-V 4.7: .*downsample_mode '4x'"):
        build_encoder(full_config(downsample_mode="4x"))
    with pytest.raises(ConfigError, match="MiniCPM-V 4.7: .*merger_times 2"):
        build_encoder(full_config(merger_times=2))
    with pytest.raises(ValueError, match="text_hidden_size"):
        build_encoder(full_config().vision_config)
    encoder = build_encoder(tower_only_config(full_config()), torch.bfloat16)
    assert encoder.merger.mlp[0].linear_2.weight.dtype == torch.bfloat16
    assert encoder.merger.mlp[0].linear_2.out_features == TEXT_HIDDEN


# Loading through GraphEncoder.from_pretrained (the registry's "minicpmv4_7_vision" family)


def test_the_registry_names_the_modules_checkpoint_prefixes():
    """The registry imports no modeling code, so the record spells the prefixes out; they must agree."""
    from vitpool.families.minicpmv4_7.adapter import CHECKPOINT_PREFIXES

    assert registry.FAMILIES[VISION_TYPE].checkpoint.prefixes == CHECKPOINT_PREFIXES
    assert registry.record_of("minicpmv4_7").name == "minicpmv4_7"


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def assert_loaded(hf_model, loaded: GraphEncoder, seed: int) -> None:
    item = image([[8, 4], [4, 4]], seed)
    assert relative_error(loaded.encode([item])[0].tokens, image_features(hf_model, item)) <= TOLERANCE


def save_full(hf_model, directory: Path, **save_options) -> set[str]:
    """The full model (`MiniCPMV4_7ForConditionalGeneration`) with the test's vision weights, saved;
    its keys."""
    from transformers import MiniCPMV4_7ForConditionalGeneration

    full = MiniCPMV4_7ForConditionalGeneration(full_config())
    full.model.load_state_dict(hf_model.state_dict())
    full.save_pretrained(directory, **save_options)
    keys = set()
    for file in directory.glob("*.safetensors"):
        keys.update(load_file(str(file)))
    assert any(k.startswith("model.vision_tower.") for k in keys)
    assert any(k.startswith("model.merger.") for k in keys)
    return keys


def test_loads_a_full_model_save(hf_model, tmp_path: Path):
    save_full(hf_model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "minicpmv4_7"
    assert_loaded(hf_model, load(tmp_path), 13)


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


def save_tower_only(hf_model, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    from vitpool.families.minicpmv4_7.adapter import tower_only_config

    tower_only_config(hf_model.config).save_pretrained(directory)
    if state is None:
        state = encoder_module(hf_model).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))


def test_loads_a_tower_only_save(hf_model, tmp_path: Path):
    save_tower_only(hf_model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == VISION_TYPE
    assert_loaded(hf_model, load(tmp_path), 15)


def test_a_missing_weight_is_named(hf_model, tmp_path: Path):
    state = encoder_module(hf_model).state_dict()
    del state["merger.mlp.0.linear_1.bias"]
    save_tower_only(hf_model, tmp_path, state)
    with pytest.raises(CheckpointError, match=r"merger\.mlp\.0\.linear_1\.bias"):
        load(tmp_path)


# The processor's output as items (vitpool.items_from)


def pictures() -> list:
    """Three pictures: a wide one (an overview and 2 slices), a small one (the overview alone), a
    tall one (an overview and 2 slices), at the processor settings below."""
    from PIL import Image as PILImage

    shapes = [(90, 200), (60, 60), (150, 120)]
    state = np.random.RandomState(0)
    return [PILImage.fromarray(state.randint(0, 255, (*shape, 3), dtype=np.uint8)) for shape in shapes]


def tiny_tokenizer():
    """A character-level tokenizer with MiniCPM-V's special tokens as attributes (what the
    processor reads from the real one); no download."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {
        "image_token": PLACEHOLDER,
        "video_token": "<|video_pad|>",
        "image_start_token": "<image>",
        "image_end_token": "</image>",
        "slice_start_token": "<slice>",
        "slice_end_token": "</slice>",
        "image_id_start_token": "<image_id>",
        "image_id_end_token": "</image_id>",
    }
    vocab = {"<unk>": 0, "<pad>": 1, **{chr(c): c - 30 for c in range(32, 127)}, "\n": 97}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", extra_special_tokens=special
    )


def real_processor(processor_class, monkeypatch):
    """The real `processor_class` (MiniCPMV4_7Processor, or 4.6's) over MiniCPM-V 4.6's PIL image
    processor (slices of about 8 x 8 patches). Its video processor exists only for torchvision, and
    the processor's class check looks its base class up there: the check is skipped for it and a
    stand-in that is never called (images only) takes its place."""
    pytest.importorskip("PIL")
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil
    from transformers.video_processing_utils import BaseVideoProcessor

    class UnusedVideoProcessor(BaseVideoProcessor):
        slice_mode = True
        downsample_mode = "16x"

    check = processor_class.check_argument_for_proper_class

    def check_all_but_videos(self, name, argument):
        return None if name == "video_processor" else check(self, name, argument)

    monkeypatch.setattr(processor_class, "check_argument_for_proper_class", check_all_but_videos)
    image_processor = MiniCPMV4_6ImageProcessorPil(scale_resolution=112, max_slice_nums=4, patch_size=PATCH)
    return processor_class(image_processor, UnusedVideoProcessor(), tiny_tokenizer())


@pytest.fixture
def processor(monkeypatch):
    from transformers import MiniCPMV4_7Processor

    return real_processor(MiniCPMV4_7Processor, monkeypatch)


def test_the_full_processors_batch_is_cut_by_its_prompt(hf_model, encoder, processor):
    """MiniCPMV4_7Processor drops num_patches_per_image; `items_from` reads each image's slices
    from the runs of image tokens instead. Each item is what the processor gives for that image
    alone, and encodes as Hugging Face does on the whole batch."""
    images = pictures()
    out = processor(images=images, text=PROMPTS, return_tensors="pt")
    assert "num_patches_per_image" not in out and "mm_token_type_ids" in out
    counts = processor.image_processor(images)["num_patches_per_image"]
    assert counts == [3, 1, 3]  # the batch needs cutting: slice counts differ
    items = vitpool.items_from(out)  # found by its keys: minicpmv4_7's alone holds none beyond them
    assert [len(item.grid_thw) for item in items] == counts
    for item, picture in zip(items, images, strict=True):
        alone = processor.image_processor(picture, return_tensors="pt")
        assert torch.equal(torch.as_tensor(item.pixel_values), alone["pixel_values"])
        assert torch.equal(torch.as_tensor(item.grid_thw), alone["target_sizes"])
    with torch.no_grad():
        expected = hf_model.get_image_features(out["pixel_values"], out["target_sizes"]).pooler_output
    expected = torch.cat(expected)
    ours = torch.cat([embedding.tokens for embedding in encoder.encode(items)])
    assert ours.shape == (tokens_of(out["target_sizes"]), TEXT_HIDDEN)
    assert relative_error(ours, expected) <= TOLERANCE
    # as NumPy arrays, the same items
    as_arrays = vitpool.items_from(
        dict(processor(images=images, text=PROMPTS, return_tensors="np")), family="minicpmv4_7"
    )
    for item, array_item in zip(items, as_arrays, strict=True):
        assert np.array_equal(np.asarray(array_item.pixel_values), torch.as_tensor(item.pixel_values).numpy())


def test_the_image_processors_batch_is_cut_by_its_counts(processor, tmp_path: Path):
    images = pictures()
    out = processor.image_processor(images, return_tensors="pt")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "minicpmv4_7"}))
    for items in (vitpool.items_from(out, family="minicpmv4_7"), vitpool.items_from(out, model=tmp_path)):
        assert [len(item.grid_thw) for item in items] == out["num_patches_per_image"]
        for item, picture in zip(items, images, strict=True):
            alone = processor.image_processor(picture, return_tensors="pt")
            assert torch.equal(torch.as_tensor(item.pixel_values), alone["pixel_values"])


def test_a_batch_that_cannot_be_cut_says_what_is_missing(processor):
    images = pictures()
    out = dict(processor(images=images, text=PROMPTS, return_tensors="pt"))
    how = r"processor\.image_processor\(images.*one image at a time"
    # without the token types (return_mm_token_type_ids=False), nothing says where an image ends
    without_types = {k: v for k, v in out.items() if k != "mm_token_type_ids"}
    with pytest.raises(ValueError, match=f"no num_patches_per_image .*no mm_token_type_ids.*{how}"):
        vitpool.items_from(without_types, family="minicpmv4_7")
    neither = f"no num_patches_per_image .*no input_ids or mm_token_type_ids.*{how}"
    with pytest.raises(ValueError, match=neither):
        vitpool.items_from({"pixel_values": out["pixel_values"], "target_sizes": out["target_sizes"]})
    with pytest.raises(ValueError, match="target_sizes"):
        vitpool.items_from({"pixel_values": out["pixel_values"]}, family="minicpmv4_7")
    # a prompt cut short: a slice's run too short, or runs missing
    short = {**out, "mm_token_type_ids": out["mm_token_type_ids"].clone()}
    first_image_token = int(short["mm_token_type_ids"][0].tolist().index(1))
    short["mm_token_type_ids"][0, first_image_token] = 0
    with pytest.raises(ValueError, match=f"slice 0's run of image tokens is 2 long.*\\(4, 12\\).*{how}"):
        vitpool.items_from(short)
    with pytest.raises(ValueError, match=f"holds 4 runs of image tokens.*target_sizes 7 rows.*{how}"):
        vitpool.items_from(
            {**out, "input_ids": out["input_ids"][:1], "mm_token_type_ids": out["mm_token_type_ids"][:1]}
        )
    # counts and rows that do not add up; videos
    image_output = dict(processor.image_processor(images, return_tensors="pt"))
    miscounted = r"num_patches_per_image \[3, 1, 2\] accounts for 6 slices; target_sizes has 7"
    with pytest.raises(ValueError, match=miscounted):
        vitpool.items_from({**image_output, "num_patches_per_image": [3, 1, 2]}, family="minicpmv4_7")
    with pytest.raises(ValueError, match="the 6 target_sizes rows account for"):
        vitpool.items_from(
            {
                **image_output,
                "target_sizes": image_output["target_sizes"][:6],
                "num_patches_per_image": [3, 1, 2],
            },
            family="minicpmv4_7",
        )  # the strip is longer
    with pytest.raises(ValueError, match="the 7 target_sizes rows account for"):
        vitpool.items_from(
            {**image_output, "pixel_values": image_output["pixel_values"][..., :-PATCH]}, family="minicpmv4_7"
        )
    with pytest.raises(ValueError, match="images only"):  # refused by items_from, or else by the cutter
        vitpool.items_from(
            {**image_output, "pixel_values_videos": image_output["pixel_values"]}, family="minicpmv4_7"
        )


def test_minicpm_v_4_6s_processor_output_is_cut_the_same_way(monkeypatch):
    """4.7's processor is 4.6's that returns mm_token_type_ids by default: 4.6's output holds them
    when asked (and is then cut as 4.7's), and otherwise gets the same account of what is missing."""
    from transformers import MiniCPMV4_6Processor

    processor = real_processor(MiniCPMV4_6Processor, monkeypatch)
    images = pictures()
    asked = processor(images=images, text=PROMPTS, return_tensors="pt", return_mm_token_type_ids=True)
    items = vitpool.items_from(asked, family="minicpmv4_7")
    assert [len(item.grid_thw) for item in items] == processor.image_processor(images)[
        "num_patches_per_image"
    ]
    with pytest.raises(ValueError, match="no num_patches_per_image .*no mm_token_type_ids"):
        vitpool.items_from(processor(images=images, text=PROMPTS, return_tensors="pt"), family="minicpmv4_7")


# The transformers drop-in


def test_the_transformers_drop_in_answers_get_image_features(hf_model):
    from transformers import MiniCPMV4_7ForConditionalGeneration

    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = MiniCPMV4_7ForConditionalGeneration(full_config()).eval()
    model.model.load_state_dict(hf_model.state_dict())
    model.model.config.vision_config._attn_implementation = "sdpa"
    item = image([[8, 8], [4, 8], [4, 8]], 16)
    strip, sizes = strip_of(item.pixel_values), torch.tensor(item.grid_thw, dtype=torch.int32)
    with torch.no_grad():
        expected = model.model.get_image_features(strip, sizes).pooler_output
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    assert type(model.model.vision_tower).__name__ == "MiniCPMV4_7Features"  # vitpool answers now
    with torch.no_grad():
        answered = model.model.get_image_features(strip, sizes).pooler_output
    assert [t.shape for t in answered] == [t.shape for t in expected]
    assert relative_error(torch.cat(answered), torch.cat(expected)) <= TOLERANCE
    restore_vision_tower(model, original)
    assert type(model.model.vision_tower).__name__ == "MiniCPMV4_7VisionModel"
    with pytest.raises(ConfigError, match="MiniCPM-V 4.7: .*'4x'"):
        model.model.config.downsample_mode = "4x"
        graph_encoder_for(model, budgets=BUDGETS)
