"""`vitpool.items_from` for the families that are not cut by a grid alone (InternVL, Llama 4,
MiniCPM-V 4.6, Step-3.7, DeepSeek-OCR-2) and for Kimi-K2.5 (a grid, patches unflattened): each
family's real image processor on images of unlike sizes, cut into one item per image in order;
each item is what the processor gives for that image alone, built by hand as the README says; and
the items encode, on the family's tiny tower, to what the model's own path gives for that image
alone. Where a full processor drops what the cut needs, the error names it and says what to pass.

Llama 4's, Step-3.7's and Kimi-K2.5's processors exist only for the torchvision backend: those
cases skip without it (their cuts are also checked here on batches laid out as those processors
lay them out). CPU, fp32."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from family_cases import deepseek_ocr2 as deepseek_ocr2_case
from family_cases import internvl as internvl_case
from family_cases import kimi_k25 as kimi_k25_case
from family_cases import llama4 as llama4_case
from family_cases import minicpmv4_6 as minicpmv4_6_case
from family_cases import step3p7 as step3p7_case

import vitpool
from vitpool import GraphEncoder, Image, Video
from vitpool.models.family import named_object
from vitpool.models.registry import RECORDS

PILImage = pytest.importorskip("PIL.Image")

TOLERANCE = 1e-4

Reference = Callable[[Any], torch.Tensor]  # an item -> what the model's own path gives for it


@dataclass(frozen=True)
class Case:
    """One family: its real image processor sized for its tiny tower, the images' (height,
    width), the item the README builds from the processor's output for one image, and the tiny
    encoder with the model's own path as the reference."""

    family: str
    processor: Callable[[], Any]
    sizes: tuple[tuple[int, int], ...]
    item_alone: Callable[[Any], Image]
    encoder_and_reference: Callable[[], tuple[GraphEncoder, Reference]]
    needs_torchvision: bool = False
    skip_reason: str | None = None


def transformers_class(name: str, **kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        return getattr(importlib.import_module("transformers"), name)(**kwargs)

    return make


def tiled_encoder(case: Any, budgets: tuple[int, ...]) -> Callable[[], tuple[GraphEncoder, Reference]]:
    def make() -> tuple[GraphEncoder, Reference]:
        encoder = case.CASE_FIELDS["make_encoder"](list(budgets))
        reference = case.CASE_FIELDS["reference"](encoder)
        return encoder, lambda item: reference(item)[0]

    return make


def view_and_crops_encoder(
    case: Any, budgets: tuple[int, ...]
) -> Callable[[], tuple[GraphEncoder, Reference]]:
    def make() -> tuple[GraphEncoder, Reference]:
        model = case.hf_model(seed=5)
        return case.encoder_of(model, list(budgets)), lambda item: case.image_features(model, item)

    return make


def view_and_crops_alone(out: Any) -> Image:
    if "pixel_values_local" not in out:
        return Image(out["pixel_values"])
    return Image(out["pixel_values"], inputs={"pixel_values_local": out["pixel_values_local"]})


def minicpmv4_6_encoder() -> tuple[GraphEncoder, Reference]:
    model = minicpmv4_6_case.shared_model()
    encoder = minicpmv4_6_case.make_encoder([8, 16, 32])
    return encoder, lambda item: minicpmv4_6_case.image_features(model, item)


CASES = {
    case.family: case
    for case in (
        Case(  # 8-pixel tiles; up to 4 crops and a thumbnail an image
            "internvl",
            transformers_class(
                "GotOcr2ImageProcessorPil",
                size={"height": 8, "width": 8},
                crop_to_patches=True,
                max_patches=4,
            ),
            sizes=((8, 24), (8, 8), (20, 14)),
            item_alone=lambda out: Image(out["pixel_values"]),
            encoder_and_reference=tiled_encoder(internvl_case, (4, 8, 16)),
        ),
        Case(  # 16-pixel tiles; up to 4 tiles and a global tile an image
            "llama4",
            transformers_class("Llama4ImageProcessor", size={"height": 16, "width": 16}, max_patches=4),
            sizes=((20, 40), (10, 10), (40, 33)),
            item_alone=lambda out: Image(out["pixel_values"]),
            encoder_and_reference=tiled_encoder(llama4_case, (16, 32, 64)),
            needs_torchvision=True,
        ),
        Case(  # slices of up to 8 x 8 patches of 14 pixels (the tiny tower's position table)
            "minicpmv4_6",
            transformers_class("MiniCPMV4_6ImageProcessorPil", scale_resolution=112, max_slice_nums=4),
            sizes=((112, 224), (40, 40), (150, 90)),
            item_alone=lambda out: Image(out["pixel_values"], out["target_sizes"]),
            encoder_and_reference=minicpmv4_6_encoder,
            skip_reason=minicpmv4_6_case.TOO_OLD,
        ),
        Case(  # 56-pixel global views, 28-pixel crops (7-pixel patches)
            "step3p7",
            transformers_class("Step3p7ImageProcessor", size={"height": 56, "width": 56}, patch_size=28),
            sizes=((60, 150), (40, 40), (90, 70)),
            item_alone=view_and_crops_alone,
            encoder_and_reference=view_and_crops_encoder(step3p7_case, (4, 8, 16)),
            needs_torchvision=True,
        ),
        Case(  # the release's sizes (1024-pixel views, 768-pixel crops), at most 2 crops an image
            "deepseek_ocr2",
            transformers_class("DeepseekOcr2ImageProcessorPil", max_patches=2),
            sizes=((300, 200), (800, 900)),  # one image without crops, one with
            item_alone=view_and_crops_alone,
            encoder_and_reference=view_and_crops_encoder(
                deepseek_ocr2_case, (deepseek_ocr2_case.TOKENS_PER_GLOBAL,)
            ),
        ),
        Case(  # 2-pixel patches, at most 8 x 8 of them
            "kimi_k25",
            transformers_class(
                "Kimi_K25ImageProcessor",
                patch_size=2,
                merge_size=2,
                size={"max_height": 16, "max_width": 16},
                max_patches=64,
            ),
            sizes=((10, 16), (16, 8), (12, 12)),
            item_alone=lambda out: Image(out["pixel_values"], out["image_grid_thw"][0]),
            encoder_and_reference=tiled_encoder(kimi_k25_case, (16, 32, 64)),
            needs_torchvision=True,
        ),
    )
}


def random_images(sizes: tuple[tuple[int, int], ...], seed: int = 0) -> list[Any]:
    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def built(case: Case) -> Any:
    if case.skip_reason:
        pytest.skip(case.skip_reason)
    if case.needs_torchvision:
        pytest.importorskip("torchvision", reason=f"{case.family}'s image processor needs torchvision")
    return case.processor()


def assert_same_item(got: Any, wanted: Any, where: str) -> None:
    assert type(got) is type(wanted), where
    assert torch.equal(torch.as_tensor(got.pixel_values), torch.as_tensor(wanted.pixel_values)), where
    grids = [None if item.grid_thw is None else np.asarray(item.grid_thw).tolist() for item in (got, wanted)]
    assert grids[0] == grids[1], where
    got_inputs, wanted_inputs = got.inputs or {}, wanted.inputs or {}
    assert sorted(got_inputs) == sorted(wanted_inputs), where
    for key, wanted_input in wanted_inputs.items():
        assert torch.equal(torch.as_tensor(got_inputs[key]), torch.as_tensor(wanted_input)), f"{where}: {key}"


def in_fp32(item: Any) -> Any:
    """The item with fp32 pixels, as the fp32 encoder runs them (Llama 4's processor gives bf16,
    which the tiny fp32 model's own path does not take)."""
    inputs = {key: torch.as_tensor(value).float() for key, value in (item.inputs or {}).items()} or None
    return type(item)(torch.as_tensor(item.pixel_values).float(), item.grid_thw, inputs)


def assert_encode_as_alone(case: Case, items: list[Any], alone: list[Any]) -> None:
    encoder, reference = case.encoder_and_reference()
    for position, (embedding, item) in enumerate(zip(encoder.encode(items), alone, strict=True)):
        wanted = reference(in_fp32(item))
        got = embedding.outputs[0]
        assert got.shape == wanted.shape, f"{case.family} item {position}"
        error = ((got - wanted).norm() / wanted.norm()).item()
        assert error < TOLERANCE, f"{case.family} item {position}: relative error {error}"


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_batch_is_cut_into_each_image_alone_and_encodes_as_the_model(family):
    case = CASES[family]
    processor = built(case)
    images = random_images(case.sizes)
    batch = processor(images=images, return_tensors="pt")
    items = vitpool.items_from(batch, family=family)
    alone = [case.item_alone(processor(images=[image], return_tensors="pt")) for image in images]
    assert len(items) == len(images)
    for position, (item, wanted) in enumerate(zip(items, alone)):
        assert_same_item(item, wanted, f"{family} image {position}")
    assert_encode_as_alone(case, items, alone)


def test_the_cases_show_images_with_and_without_crops_and_tiles():
    """The batches above hold what a cut can get wrong: images of several tile counts, and an
    image without crops beside one with."""

    def output(family: str) -> Any:
        return CASES[family].processor()(images=random_images(CASES[family].sizes), return_tensors="pt")

    tiles = output("internvl")["num_patches"].tolist()
    assert len(set(tiles)) == len(tiles) and 1 in tiles
    crops = output("deepseek_ocr2")["num_local_patches"].tolist()
    assert 0 in crops and sum(crops) > 0
    if not minicpmv4_6_case.TOO_OLD:
        out = output("minicpmv4_6")
        assert len(set(out["num_patches_per_image"])) > 1
        assert len({tuple(size) for size in out["target_sizes"].tolist()}) > 1  # slices of unlike sizes


def test_kimi_k25_videos_are_one_item_per_chunk_of_frames():
    pytest.importorskip("torchvision", reason="Kimi-K2.5's video processor exists only for torchvision")
    from transformers import Kimi_K25VideoProcessor

    processor = Kimi_K25VideoProcessor(
        patch_size=2, merge_size=2, size={"max_height": 16, "max_width": 16}, max_patches=64
    )
    generator = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (6, 3, 12, 16), dtype=torch.uint8, generator=generator)
    out = processor([frames], return_tensors="pt", do_sample_frames=False)
    items = vitpool.items_from(out, family="kimi_k25")
    chunk = processor.temporal_patch_size
    assert [type(item) for item in items] == [Video] * out["num_chunks_per_video"][0]
    assert [item.grid_thw[0] for item in items] == [min(chunk, 6 - start) for start in range(0, 6, chunk)]
    assert torch.equal(torch.cat([item.pixel_values for item in items]), out["pixel_values_videos"])
    encoder, reference = CASES["kimi_k25"].encoder_and_reference()
    for embedding, item in zip(encoder.encode(items), items, strict=True):
        wanted = reference(item)
        assert ((embedding.outputs[0] - wanted).norm() / wanted.norm()).item() < TOLERANCE


@pytest.mark.parametrize("family", ["internvl", "deepseek_ocr2", "minicpmv4_6"])
def test_numpy_output_and_a_dict_cut_as_tensors(family):
    case = CASES[family]
    processor = built(case)
    images = random_images(case.sizes, seed=1)
    as_tensors = vitpool.items_from(processor(images=images, return_tensors="pt"), family=family)
    as_arrays = vitpool.items_from(dict(processor(images=images, return_tensors="np")), family=family)
    for position, (array_item, tensor_item) in enumerate(zip(as_arrays, as_tensors, strict=True)):
        assert isinstance(array_item.pixel_values, np.ndarray)
        assert_same_item(array_item, tensor_item, f"{family} image {position}")


# What each full processor drops of its image processor's output, and the cut needs: the key and
# the full processor that drops it (InternVLProcessor pops num_patches in __call__; the others list
# theirs in unused_input_names).
DROPPED = {
    "internvl": ("num_patches", None),
    "llama4": ("aspect_ratios", "Llama4Processor"),
    "minicpmv4_6": ("num_patches_per_image", "MiniCPMV4_6Processor"),
}


@pytest.mark.parametrize("family", sorted(DROPPED))
def test_a_full_processors_output_without_the_counts_is_cut_per_tile_or_refused_saying_what_to_pass(family):
    """Where the model encodes every tile alone (the record's `count_keys`: InternVL, Llama 4), the
    output is cut a tile an item (their tokens against the model: test_full_processor_outputs.py);
    elsewhere (MiniCPM-V 4.6's slices share their image's resampler query) it is refused, naming
    the image processor's call that keeps the key."""
    key, full_processor = DROPPED[family]
    if full_processor is not None:  # the processor does drop it
        processor_class = getattr(importlib.import_module("transformers"), full_processor)
        assert key in processor_class.unused_input_names.fget(None)
    batch = laid_out_batch(family)
    without = {name: value for name, value in batch.items() if name != key}
    without["input_ids"] = torch.zeros(1, 4, dtype=torch.long)
    cut = named_object(record(family).processor_output.split)
    if key in record(family).processor_output.count_keys:
        tiles = vitpool.items_from(without, family=family)
        assert [item.pixel_values.shape[0] for item in tiles] == [1] * len(batch["pixel_values"])
    else:
        for cutting in (
            cut,
            lambda batch: vitpool.items_from(batch, family=family),
        ):  # items_from says the same
            with pytest.raises(
                ValueError, match=rf"the batch has no {key}\b.*processor.image_processor\(images"
            ):
                cutting(without)
    assert len(cut(batch)) == len(batch_counts(family, batch))  # with the key, the same batch cuts per image


def record(family: str) -> Any:
    return next(r for r in RECORDS if r.name == family)


def laid_out_batch(family: str) -> dict[str, Any]:
    """A batch laid out as the family's image processor lays it out, random pixels: three images
    of unlike tile / slice counts."""
    generator = torch.Generator().manual_seed(0)
    if family == "internvl":
        return {
            "pixel_values": torch.randn(3 + 1 + 5, 3, 8, 8, generator=generator),
            "num_patches": torch.tensor([3, 1, 5]),
        }
    if family == "llama4":
        # canvases of 1 x 2, 1 x 1 and 2 x 2 tiles: a global tile beside the tiles of each but the 1 x 1
        canvases = torch.tensor([[1, 2], [1, 1], [2, 2]])
        return {
            "pixel_values": torch.randn(3 + 1 + 5, 3, 16, 16, generator=generator),
            "aspect_ratios": canvases,
        }
    if family == "minicpmv4_6":
        sizes = [[4, 8], [4, 4], [4, 4], [8, 4], [4, 4], [8, 8]]
        patches = sum(h * w for h, w in sizes)
        return {
            "pixel_values": torch.randn(1, 3, 14, patches * 14, generator=generator),
            "target_sizes": torch.tensor(sizes, dtype=torch.int32),
            "num_patches_per_image": [1, 3, 2],
        }
    # Step-3.7's and DeepSeek-OCR-2's: a view per image, crops of the images that have some
    return {
        "pixel_values": torch.randn(3, 3, 56, 56, generator=generator),
        "num_local_patches": torch.tensor([2, 0, 3]),
        "pixel_values_local": torch.randn(5, 3, 28, 28, generator=generator),
    }


def batch_counts(family: str, batch: dict[str, Any]) -> list[int]:
    """Each image's rows of the batch's first cut input, by the processor's own counts."""
    if family == "llama4":
        return [h * w + (h * w > 1) for h, w in batch["aspect_ratios"].tolist()]
    if family == "minicpmv4_6":
        return list(batch["num_patches_per_image"])
    key = {"internvl": "num_patches"}.get(family, "num_local_patches")
    return torch.as_tensor(batch[key]).tolist()


@pytest.mark.parametrize("family", ["internvl", "llama4"])
def test_tiles_are_cut_by_each_images_count(family):
    """The tiled cuts on batches laid out as their processors lay them out (Llama 4's needs
    torchvision to run for real): consecutive runs of each image's tile count."""
    batch = laid_out_batch(family)
    items = vitpool.items_from(batch, family=family)
    counts = batch_counts(family, batch)
    assert [len(item.pixel_values) for item in items] == counts
    assert torch.equal(torch.cat([item.pixel_values for item in items]), batch["pixel_values"])
    assert all(item.grid_thw is None and not item.inputs for item in items)


def test_views_and_crops_are_cut_by_each_images_crop_count():
    batch = laid_out_batch("step3p7")
    items = vitpool.items_from(batch)  # Step-3.7's cut, as DeepSeek-OCR-2's: no family needed
    counts = batch["num_local_patches"].tolist()
    assert [len((item.inputs or {}).get("pixel_values_local", ())) for item in items] == counts
    assert items[1].inputs is None  # no crops: no input, as the processor gives that image alone
    assert torch.equal(torch.cat([item.pixel_values for item in items]), batch["pixel_values"])
    crops = [item.inputs["pixel_values_local"] for item in items if item.inputs]
    assert torch.equal(torch.cat(crops), batch["pixel_values_local"])
    no_crops = {"pixel_values": batch["pixel_values"][1:2], "num_local_patches": torch.tensor([0])}
    [item] = vitpool.items_from(no_crops, family="step3p7")
    assert item.inputs is None and torch.equal(item.pixel_values, batch["pixel_values"][1:2])


def test_minicpm_slices_are_cut_by_each_images_slice_count():
    batch = laid_out_batch("minicpmv4_6")
    items = vitpool.items_from(batch, family="minicpmv4_6")
    sizes, slices = batch["target_sizes"].tolist(), batch["num_patches_per_image"]
    own_sizes = [sizes[start : start + count] for start, count in zip(np.cumsum([0, *slices]), slices)]
    assert [item.grid_thw.tolist() for item in items] == own_sizes
    patches = [sum(h * w for h, w in own) for own in own_sizes]
    assert [item.pixel_values.shape[-1] // 14 for item in items] == patches
    assert torch.equal(torch.cat([item.pixel_values for item in items], dim=-1), batch["pixel_values"])


# the family, what replaces (None: drops) a key of its laid-out batch, the error it gives
WHAT_DOES_NOT_ADD_UP = [
    (
        "internvl",
        {"num_patches": torch.tensor([3, 1, 4])},
        r"pixel_values has 9 rows; num_patches \[3, 1, 4\] accounts for 8",
    ),
    (
        "internvl",
        {"num_patches": torch.tensor([3.5, 1, 4.5])},
        "must be one non-negative whole number per image",
    ),
    ("internvl", {"pixel_values_videos": torch.zeros(1, 2, 3, 8, 8)}, "internvl takes images only"),
    (
        "llama4",
        {"aspect_ratios": torch.tensor([[1, 2], [1, 1], [2, 1]])},
        "pixel_values has 9 rows; .* accounts for 7",
    ),
    ("llama4", {"aspect_ratios": torch.tensor([[1, 2], [0, 1], [2, 2]])}, r"aspect_ratios row 1 is \[0, 1\]"),
    (
        "minicpmv4_6",
        {"num_patches_per_image": [1, 3, 3]},
        r"num_patches_per_image \[1, 3, 3\] accounts for 7 slices; target_sizes has 6 rows",
    ),
    (
        "minicpmv4_6",
        {"pixel_values": torch.zeros(1, 3, 14, 30 * 14)},
        "pixel_values holds 30 patches of 14 x 14; the 6 target_sizes rows account for 176",
    ),
    (
        "minicpmv4_6",
        {"pixel_values": torch.zeros(176, 3, 14, 14)},
        r"the processor's strip is \[1, C, P, N\*P\]",
    ),
    ("minicpmv4_6", {"pixel_values_videos": torch.zeros(1, 3, 14, 14)}, "minicpmv4_6 takes images only"),
    (
        "step3p7",
        {"num_local_patches": torch.tensor([2, 3])},
        "pixel_values holds 3 global views but num_local_patches",
    ),
    (
        "step3p7",
        {"num_local_patches": torch.tensor([2, 0, 2])},
        r"pixel_values_local has 5 rows; num_local_patches \[2, 0, 2\]",
    ),
    ("deepseek_ocr2", {"pixel_values_local": None}, "counts 5 crops but the batch has no pixel_values_local"),
    ("deepseek_ocr2", {"pixel_values": [torch.zeros(3, 56, 56)] * 3}, "return_tensors='pt'"),
]


@pytest.mark.parametrize(("family", "change", "message"), WHAT_DOES_NOT_ADD_UP)
def test_what_does_not_add_up_is_named(family, change, message):
    batch = {key: value for key, value in {**laid_out_batch(family), **change}.items() if value is not None}
    with pytest.raises(ValueError, match=message):
        vitpool.items_from(batch, family=family)


def test_the_records_name_their_cuts_and_import_neither_torch_nor_transformers():
    families = sorted(CASES)
    code = (
        "import sys, importlib\n"
        f"for name in {families!r}:\n"
        "    record = importlib.import_module('vitpool.families.' + name).RECORD\n"
        "    assert record.processor_output is not None, name\n"
        "    module_name, function = record.processor_output.split.split(':')\n"
        "    assert callable(getattr(importlib.import_module(module_name), function)), name\n"
        "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
