"""DeepSeek-OCR-2's own checks (the shared ones are in test_adapter_conformance.py): whole images,
crops and global view joined with the separator, against `get_image_features`; loading from a
full save (the release's key names) and from a tower-only save; the image processor's output as
one item. CPU, fp32, the tiny random model of family_cases/deepseek_ocr2.py."""

from __future__ import annotations

import pytest
import torch
from conftest import relative_error
from family_cases import deepseek_ocr2 as case
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from vitpool import CheckpointError, GraphEncoder, Image
from vitpool.families.deepseek_ocr2 import adapter as deepseek_ocr2
from vitpool.families.deepseek_ocr2.checkpoint import CHECKPOINT_PREFIXES
from vitpool.models import registry

TOLERANCE = 1e-5
# local budgets of 1 and 3 crops, global budgets of 1 and 2 views
BUDGETS = [case.TOKENS_PER_GLOBAL, 2 * case.TOKENS_PER_GLOBAL]
MODEL_TYPE = "deepseek_ocr2_vision"
# Operators that build a tensor from host values or read one back (the tower's own forward makes
# `get_rel_pos`'s indices and its mask's block ids with the first two): a captured graph cannot.
HOST_OPERATORS = {"arange", "full", "lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "nonzero"}


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=3)


def image(num_crops: int, seed: int) -> Image:
    """One image as the processor gives it: a global view and `num_crops` crops (none: no input)."""
    generator = torch.Generator().manual_seed(seed)
    global_view = torch.randn(1, *case.GLOBAL_ROW_SHAPE, generator=generator)
    if not num_crops:
        return Image(global_view)
    crops = torch.randn(num_crops, *case.LOCAL_ROW_SHAPE, generator=generator)
    return Image(global_view, inputs={"pixel_values_local": crops})


def assert_matches(model, items, embeddings) -> None:
    for item, embedding in zip(items, embeddings, strict=True):
        expected = case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def test_images_of_several_crop_counts_in_one_call(model):
    encoder = case.encoder_of(model, BUDGETS)
    counts = (2, 0, 3, 6)  # 6 crops (the processor's most): over every budget
    items = [image(count, seed) for seed, count in enumerate(counts)]
    embeddings = encoder.encode(items)
    assert [e.tokens.shape[0] for e in embeddings] == [
        case.TOKENS_PER_CROP * n + case.TOKENS_PER_GLOBAL for n in counts
    ]
    assert_matches(model, items, embeddings)
    assert encoder.stats().eager_batches == 1  # the 6 crops alone, at their own size


def test_the_global_view_ends_with_the_separator(model):
    encoder = case.encoder_of(model, BUDGETS)
    [embedding] = encoder.encode([image(2, 7)])
    assert torch.equal(embedding.tokens[-1], model.model.view_separator)


class OperatorLog(TorchDispatchMode):
    """The names of the operators run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_forward_builds_no_tensor_from_host_values(model):
    """What the CPU can show of "capturable": every path's forward runs on tensors it is given or
    holds (buffers), and reads nothing back; Hugging Face's own tower does not."""
    adapter = case.encoder_of(model, BUDGETS).adapter
    for path, path_adapter in adapter.paths.items():
        pixels = torch.randn(2, *path_adapter.row_shape)
        with OperatorLog() as log, torch.no_grad():
            path_adapter.forward(pixels, {})
        assert not log.names & HOST_OPERATORS, path
    with OperatorLog() as log, torch.no_grad():
        model.model.vision_tower(pixels)
    assert log.names & HOST_OPERATORS  # the check sees what it is for


def test_default_budgets_are_whole_tiles_of_each_path(model):
    adapter = case.encoder_of(model, BUDGETS).adapter
    encoder = GraphEncoder(adapter, device="cpu", dtype=torch.float32)
    for path, path_adapter in adapter.paths.items():
        tokens = [budget.num_tokens for budget in encoder.budgets if budget.path == path]
        step = path_adapter.tokens_per_tile
        assert tokens[0] == step and tokens[-1] == deepseek_ocr2.MAX_GRAPH_TILES[path] * step
        assert all(value % step == 0 for value in tokens)


def test_loads_a_full_model_save(model, tmp_path):
    """`save_pretrained` writes the release's names (`sam_model.blocks.*`, `view_seperator`);
    transformers' own layout is read too."""
    items = [image(3, 10), image(0, 11)]
    for directory, original_format in ((tmp_path / "release", True), (tmp_path / "transformers", False)):
        model.save_pretrained(directory, safe_serialization=True, save_original_format=original_format)
        encoder = GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)
        assert_matches(model, items, encoder.encode(items))


def test_loads_a_tower_only_save_and_refuses_missing_weights(model, tmp_path):
    module = case.encoder_of(model, BUDGETS).adapter.tower
    deepseek_ocr2.tower_only_config(model.config).save_pretrained(tmp_path)
    state = {key: value.contiguous() for key, value in module.state_dict().items()}
    assert deepseek_ocr2.convert_checkpoint(state, None).keys() == state.keys()
    save_file(state, str(tmp_path / "model.safetensors"))
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [image(2, 12)]
    assert_matches(model, items, encoder.encode(items))
    del state["multi_modal_projector.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys.*multi_modal_projector.weight"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


def test_a_vision_config_without_the_llm_width_is_refused(model):
    config = model.config.vision_config  # no text_hidden_size: the projector's width is unknown
    with pytest.raises(ValueError, match="text_hidden_size"):
        deepseek_ocr2.build_encoder(config)


@pytest.mark.parametrize(
    ("width", "height", "num_crops"),
    [
        (1600, 1200, 6),  # 4 x 3 crops of 768²
        (3000, 1000, 3),  # 3 x 1
        (640, 480, 0),  # long side under 768: the global view alone, no pixel_values_local
    ],
)
def test_the_processors_output_for_one_image_is_one_item(model, width, height, num_crops):
    """The PIL image processor (the release's settings: 1024² global view, 2 to 6 crops of 768²)
    emits one image as `pixel_values` and `pixel_values_local`: together, one item of the real
    tower's rules (the tiny model has the release's tile sizes)."""
    transformers = pytest.importorskip("transformers")
    processor_class = getattr(transformers, "DeepseekOcr2ImageProcessorPil", None)
    if processor_class is None:
        pytest.skip("this transformers has no DeepseekOcr2ImageProcessorPil")
    from PIL import Image as PILImage

    from vitpool.items import prepare_item

    out = processor_class()(images=PILImage.new("RGB", (width, height), (200, 120, 40)), return_tensors="pt")
    assert int(out["num_local_patches"][0]) == num_crops
    inputs = {"pixel_values_local": out["pixel_values_local"]} if num_crops else None
    rules = deepseek_ocr2.DeepseekOcr2Adapter(
        deepseek_ocr2.build_encoder(deepseek_ocr2.tower_only_config(model.config))
    ).item_rules
    prepared = prepare_item(0, Image(out["pixel_values"], inputs=inputs), rules)
    assert prepared.num_tokens == case.TOKENS_PER_CROP * num_crops + case.TOKENS_PER_GLOBAL
    paths = [part.spec.path for part in prepared.parts]
    assert paths == ["pixel_values_local"] * bool(num_crops) + ["pixel_values"]


def test_the_registry_names_the_modules_checkpoint_prefixes():
    """The registry imports no modeling code, so it spells the prefixes out; they must agree."""
    assert registry.FAMILIES[MODEL_TYPE].checkpoint.prefixes == CHECKPOINT_PREFIXES
