"""Step-3.7's and DeepSeek-OCR-2's local crops at the sizes their towers take, not only their
processors' defaults (issue 43).

The crop size is the image processor's setting: an encoder takes it from the vision config's
`local_image_size`, else from the processor config saved beside the checkpoint (as transformers
reads it: processor_config.json's nested "image_processor", else preprocessor_config.json), else the
processor's default. Whole items at other sizes (whole patches or not, DeepSeek-OCR-2's other
query table) against Hugging Face's `get_image_features` on the same weights; crops of a size the
encoder was not built for run eagerly, with a warning that names where the encoder's size was set
(test_undeclared_crops.py has the rest of their behaviour). CPU, fp32, the tiny random models of
family_cases (Step-3.7: 7-pixel patches, 28² crops; DeepSeek-OCR-2: 16-pixel patches, the
release's 768² crops). One GPU test: graphs at such sizes.
"""

from __future__ import annotations

import copy
import json
import logging
import pickle

import pytest
import torch
from conftest import relative_error
from family_cases import deepseek_ocr2 as deepseek_case
from family_cases import step3p7 as step_case

from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError
from vitpool.families.deepseek_ocr2 import adapter as deepseek_ocr2
from vitpool.families.deepseek_ocr2.tower import DeepseekOcr2Encoder
from vitpool.families.step3p7 import adapter as step3p7
from vitpool.items import prepare_item

TOLERANCE = 1e-5
LOCAL = "pixel_values_local"
PROCESSOR_FILE, IMAGE_PROCESSOR_FILE = "processor_config.json", "preprocessor_config.json"
STEP_BUDGETS = [step_case.TOKENS_PER_GLOBAL, 2 * step_case.TOKENS_PER_GLOBAL]
DEEPSEEK_BUDGETS = [deepseek_case.TOKENS_PER_GLOBAL, 2 * deepseek_case.TOKENS_PER_GLOBAL]


@pytest.fixture(scope="module")
def step_model():
    return step_case.hf_model(seed=11)


@pytest.fixture(scope="module")
def deepseek_model():
    return deepseek_case.hf_model(seed=12)


def image(case, num_crops: int, crop_side: int, seed: int) -> Image:
    """One image as the processor gives it: a global view of the case's size, crops of `crop_side`."""
    generator = torch.Generator().manual_seed(seed)
    view = torch.randn(1, *case.GLOBAL_ROW_SHAPE, generator=generator)
    if not num_crops:
        return Image(view)
    return Image(view, inputs={LOCAL: torch.randn(num_crops, 3, crop_side, crop_side, generator=generator)})


def load(directory, budgets) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=budgets, device="cpu", dtype=torch.float32)


def save(model, directory, vision_config_changes=None, files=None):
    """`model` saved as a full checkpoint (a copy's config changed as given), and JSON files beside it."""
    model = copy.copy(model)
    model.config = copy.deepcopy(model.config)
    for name, value in (vision_config_changes or {}).items():
        setattr(model.config.vision_config, name, value)
    model.save_pretrained(directory, safe_serialization=True)
    for name, content in (files or {}).items():
        (directory / name).write_text(json.dumps(content))
    return directory


def assert_matches_hf(model, case, items, embeddings, tokens_per_crop: int) -> None:
    for item, embedding in zip(items, embeddings, strict=True):
        crops = item.inputs[LOCAL].shape[0] if item.inputs else 0
        assert embedding.tokens.shape[0] == crops * tokens_per_crop + case.TOKENS_PER_GLOBAL
        expected = case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


@pytest.mark.parametrize(
    ("crop_side", "tokens_per_crop"),
    [
        (42, 4),  # 6 x 6 patches, 2 x 2 after the stride-2 convolutions (rounding up): not whole 28² blocks
        (45, 4),  # 6 patches and 3 pixels a side the patch convolution does not read
        (84, 9),  # larger than the 56² global view: 12 x 12 patches, positions interpolated up
    ],
)
def test_step3p7_crops_of_the_processor_configs_size_match_hf(
    step_model, tmp_path, crop_side, tokens_per_crop
):
    processor = {"image_processor_type": "Step3p7ImageProcessor", "patch_size": crop_side}
    encoder = load(save(step_model, tmp_path, files={IMAGE_PROCESSOR_FILE: processor}), STEP_BUDGETS)
    assert encoder.adapter.paths[LOCAL].row_shape == (3, crop_side, crop_side)
    items = [image(step_case, count, crop_side, seed) for seed, count in enumerate((2, 0, 3))]
    assert_matches_hf(step_model, step_case, items, encoder.encode(items), tokens_per_crop)


@pytest.mark.parametrize(
    ("crop_side", "tokens_per_crop"),
    [
        (650, 144),  # 40 patches and 10 pixels a side: 10 x 10 SAM tokens, the 144 queries
        (1024, 256),  # 16 x 16 SAM tokens: the tower takes its 256-query table
    ],
)
def test_deepseek_ocr2_crops_of_the_processor_configs_size_match_hf(
    deepseek_model, tmp_path, crop_side, tokens_per_crop
):
    from transformers import DeepseekOcr2ImageProcessorPil

    save(deepseek_model, tmp_path)
    DeepseekOcr2ImageProcessorPil(tile_size=crop_side).save_pretrained(tmp_path)  # preprocessor_config.json
    encoder = load(tmp_path, DEEPSEEK_BUDGETS)
    items = [image(deepseek_case, 2, crop_side, 20), image(deepseek_case, 0, crop_side, 21)]
    assert_matches_hf(deepseek_model, deepseek_case, items, encoder.encode(items), tokens_per_crop)


def test_deepseek_ocr2_the_processors_output_at_its_tile_size_is_encoded_as_hf_does(deepseek_model, tmp_path):
    """The processor saved with tile_size 640 beside the checkpoint: its output for one image is one
    item of the loaded encoder, whose embedding is the model's."""
    from PIL import Image as PILImage
    from transformers import DeepseekOcr2ImageProcessorPil

    processor = DeepseekOcr2ImageProcessorPil(tile_size=640)
    save(deepseek_model, tmp_path)
    processor.save_pretrained(tmp_path)
    generator = torch.Generator().manual_seed(5)
    pixels = torch.randint(0, 256, (900, 1400, 3), dtype=torch.uint8, generator=generator).numpy()
    out = processor(images=PILImage.fromarray(pixels), return_tensors="pt")
    assert tuple(out["pixel_values_local"].shape[1:]) == (3, 640, 640)
    item = Image(out["pixel_values"], inputs={LOCAL: out["pixel_values_local"]})
    encoder = load(tmp_path, DEEPSEEK_BUDGETS)
    assert_matches_hf(deepseek_model, deepseek_case, [item], encoder.encode([item]), 144)


def test_the_processor_config_nested_in_processor_config_json_comes_first(step_model, tmp_path):
    """As transformers reads an image processor: processor_config.json's "image_processor" (what a
    processor saves since transformers 5) before preprocessor_config.json."""
    processor = {"processor_class": "Step3p7Processor", "image_processor": {"patch_size": 42}}
    files = {PROCESSOR_FILE: processor, IMAGE_PROCESSOR_FILE: {"patch_size": 35}}
    directory = save(step_model, tmp_path, files=files)
    assert load(directory, STEP_BUDGETS).adapter.paths[LOCAL].row_shape == (3, 42, 42)
    (directory / PROCESSOR_FILE).write_text(json.dumps({"processor_class": "Step3p7Processor"}))
    # no image processor nested there: the other file
    assert load(directory, STEP_BUDGETS).adapter.paths[LOCAL].row_shape == (3, 35, 35)


def test_local_image_size_in_the_vision_config_comes_before_the_processor_config(step_model, tmp_path):
    files = {IMAGE_PROCESSOR_FILE: {"patch_size": 42}}
    encoder = load(save(step_model, tmp_path, {"local_image_size": 35}, files), STEP_BUDGETS)
    items = [image(step_case, 2, 35, 30)]
    assert_matches_hf(step_model, step_case, items, encoder.encode(items), 4)


def eager_warning(encoder, case, crop_side: int, caplog) -> str:
    """The warning an encode of an image with crops of `crop_side` logs (crops the encoder's graphs
    do not serve), the item checked first in a caller's process by the rules it was handed (pickled,
    as an actor hands them to a pool's callers)."""
    item = image(case, 1, crop_side, 40)
    [crops, _] = prepare_item(0, item, pickle.loads(pickle.dumps(encoder.adapter.item_rules))).parts
    assert crops.spec.pixel_shape == (1, 3, crop_side, crop_side) and not crops.spec.served_by_graph
    with caplog.at_level(logging.WARNING, logger="vitpool.models.tiled"):
        encoder.encode([item])
    [message] = [record.getMessage() for record in caplog.records if "no graph serves" in record.getMessage()]
    return message


def test_crops_of_another_size_name_the_processors_default(deepseek_model, caplog):
    """No processor config saved: the encoder takes DeepseekOcr2ImageProcessor's default, 768, and
    says so, and where to set another size."""
    adapter = deepseek_ocr2.DeepseekOcr2Adapter(
        deepseek_ocr2.build_encoder(deepseek_ocr2.tower_only_config(deepseek_model.config))
    )
    encoder = GraphEncoder(adapter, budgets=DEEPSEEK_BUDGETS, device="cpu", dtype=torch.float32)
    message = eager_warning(encoder, deepseek_case, 640, caplog)
    assert "crops of 640 pixels: no graph serves them (the encoder's crops are 768, from" in message
    assert "DeepseekOcr2ImageProcessor's default tile_size" in message
    assert "set local_image_size in the vision config" in message


def test_crops_of_another_size_name_the_processor_config(step_model, tmp_path, caplog):
    directory = save(step_model, tmp_path, files={IMAGE_PROCESSOR_FILE: {"patch_size": 42}})
    encoder = load(directory, STEP_BUDGETS)
    message = eager_warning(encoder, step_case, 28, caplog)
    assert "crops of 28 pixels: no graph serves them (the encoder's crops are 42, from" in message
    assert f"patch_size in {directory / IMAGE_PROCESSOR_FILE}" in message
    assert "set local_image_size in the vision config" in message


@pytest.mark.parametrize("source", ["vision config", "module"])
def test_crops_of_another_size_name_the_setting(step_model, tmp_path, caplog, source):
    if source == "vision config":
        encoder = load(save(step_model, tmp_path, {"local_image_size": 35}), STEP_BUDGETS)
        words = "local_image_size in the checkpoint's vision config); they run eagerly"
    else:  # an encoder module built with a size (the tests' cases, the transformers integration)
        encoder = step_case.encoder_of(step_model, STEP_BUDGETS)
        words = "the local_image_size the encoder module was built with); they run eagerly"
    assert words in eager_warning(encoder, step_case, 56, caplog)


def test_views_and_non_square_crops_keep_their_plain_errors(step_model):
    rules = step_case.encoder_of(step_model, STEP_BUDGETS).adapter.item_rules
    non_square = Image(torch.randn(1, 3, 56, 56), inputs={LOCAL: torch.randn(2, 3, 28, 35)})
    with pytest.raises(InvalidItemError, match="pixel_values_local: pixel_values must be tiles"):
        prepare_item(0, non_square, rules)
    with pytest.raises(InvalidItemError, match=r"pixel_values must be tiles \[tiles, 3, 56, 56\]"):
        prepare_item(0, Image(torch.randn(1, 3, 64, 64)), rules)  # a global view of another size


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        # not a number
        (IMAGE_PROCESSOR_FILE, {"patch_size": "big"}, f"patch_size in .*/{IMAGE_PROCESSOR_FILE} is 'big'"),
        # no pixels
        (IMAGE_PROCESSOR_FILE, {"patch_size": 0}, "is 0; a crop's side is a positive whole number"),
        # no settings object
        (IMAGE_PROCESSOR_FILE, [42], f"{IMAGE_PROCESSOR_FILE} holds no settings"),
        # transformers 5's nesting, a boolean (JSON's true is no size)
        (PROCESSOR_FILE, {"image_processor": {"patch_size": True}}, f"in .*/{PROCESSOR_FILE} is True"),
    ],
)
def test_a_bad_processor_config_is_a_checkpoint_error_naming_it(step_model, tmp_path, name, content, words):
    directory = save(step_model, tmp_path, files={name: content})
    with pytest.raises(CheckpointError, match=words):
        GraphEncoder.from_pretrained(directory, budgets=STEP_BUDGETS, device="cpu")


def test_an_unreadable_processor_config_is_a_checkpoint_error(step_model, tmp_path):
    directory = save(step_model, tmp_path)
    (directory / IMAGE_PROCESSOR_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{IMAGE_PROCESSOR_FILE} cannot be read"):
        GraphEncoder.from_pretrained(directory, budgets=STEP_BUDGETS, device="cpu")


def test_crops_smaller_than_one_patch_are_refused_when_the_module_is_built(step_model, deepseek_model):
    """Hugging Face's patch convolutions fail on them too."""
    with pytest.raises(ValueError, match="tiles of 6 pixels are smaller than one 7-pixel patch"):
        step3p7.Step3p7Encoder(step_model.model.vision_model, step_model.model.multi_modal_projector, 6)
    inner = deepseek_model.model
    parts = (inner.vision_tower, inner.multi_modal_projector, inner.view_separator)
    with pytest.raises(ValueError, match="tiles of 15 pixels are smaller than one 16-pixel patch"):
        DeepseekOcr2Encoder(*parts, 15)


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "crop_side"), [("step3p7", 45), ("deepseek_ocr2", 650)])
def test_gpu_graphs_of_crops_at_another_size_match_hf(family, crop_side):
    """Every budget of both paths captured in bf16 (checked against eager at capture), whole items
    against `get_image_features` in fp32 on the same GPU."""
    case = step_case if family == "step3p7" else deepseek_case
    model = case.hf_model(seed=13)
    if family == "step3p7":
        parts = (copy.deepcopy(model.model.vision_model), copy.deepcopy(model.model.multi_modal_projector))
        adapter = step3p7.Step3p7Adapter(step3p7.Step3p7Encoder(*parts, crop_side))
    else:
        inner = model.model
        parts = (copy.deepcopy(inner.vision_tower), copy.deepcopy(inner.multi_modal_projector))
        parts += (inner.view_separator,)
        adapter = deepseek_ocr2.DeepseekOcr2Adapter(DeepseekOcr2Encoder(*parts, crop_side))
    budgets = list(case.CASE_FIELDS["budgets"])
    encoder = GraphEncoder(adapter, budgets=budgets, device="cuda", dtype=torch.bfloat16)
    assert encoder.stats().disabled_budgets == []
    model = model.to("cuda", torch.float32)
    items = [image(case, count, crop_side, seed) for seed, count in enumerate((0, 2, 3))]
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        inputs = None if item.inputs is None else {LOCAL: item.inputs[LOCAL].cuda()}
        expected = case.image_features(model, Image(item.pixel_values.cuda(), inputs=inputs))
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, expected) <= 1.5e-2
    assert encoder.stats().graph_items >= 3
