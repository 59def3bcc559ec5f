"""`vitpool.items_from`: a real processor's output cut into items, for the grid families (the
other families' cutters: test_items_from_families.py). Each item equals what the processor gives
for its image alone, and encodes to the family's Hugging Face tower's output for that image."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from family_cases import glm4v as glm4v_case
from family_cases import paddleocr_vl as paddleocr_vl_case
from family_cases import qwen2_5_vl as qwen2_5_vl_case
from family_cases import qwen2_vl as qwen2_vl_case
from family_cases import qwen3_5 as qwen3_5_case

import vitpool
from vitpool import Image, Video
from vitpool.models.registry import RECORDS

pytest.importorskip("PIL")
from PIL import Image as PILImage


@dataclass(frozen=True)
class GridCase:
    family: str
    case_fields: dict
    processor: Callable[[], object]  # the family's PIL image processor, sized for its tiny tower
    sizes: tuple[tuple[int, int], ...]  # (height, width) of the images


def image_processor(class_name: str, patch: int, **kwargs) -> Callable[[], object]:
    def make() -> object:
        import transformers

        side = 2 * patch  # a merged token's side in pixels
        size = {"shortest_edge": side * side * 4, "longest_edge": side * side * 16}
        return getattr(transformers, class_name)(patch_size=patch, merge_size=2, size=size, **kwargs)

    return make


CASES = {
    case.family: case
    for case in (
        GridCase(
            "qwen2_vl",
            qwen2_vl_case.CASE_FIELDS,
            image_processor("Qwen2VLImageProcessorPil", 14, temporal_patch_size=2),
            ((80, 112), (144, 64), (64, 64)),
        ),
        GridCase(
            "qwen2_5_vl",
            qwen2_5_vl_case.CASE_FIELDS,
            image_processor("Qwen2VLImageProcessorPil", 14, temporal_patch_size=2),
            ((80, 112), (144, 64), (64, 64)),
        ),
        GridCase(
            "qwen3_5",
            qwen3_5_case.CASE_FIELDS,
            image_processor(
                "Qwen2VLImageProcessorPil",
                4,
                temporal_patch_size=2,
                image_mean=[0.5] * 3,
                image_std=[0.5] * 3,
            ),
            ((20, 28), (36, 16), (16, 16)),
        ),
        GridCase(
            "glm4v",
            glm4v_case.CASE_FIELDS,
            image_processor("Glm4vImageProcessorPil", 2, temporal_patch_size=2),
            ((20, 28), (36, 16), (16, 16)),
        ),
        GridCase(
            "paddleocr_vl",
            paddleocr_vl_case.CASE_FIELDS,
            image_processor("PaddleOCRVLImageProcessorPil", 2),
            ((20, 28), (36, 16), (16, 16)),
        ),
    )
}


def random_images(sizes, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.mark.parametrize("family", sorted(CASES))
def test_items_from_a_processor_batch_are_the_images_alone_and_encode_as_hugging_face(family):
    case = CASES[family]
    processor = case.processor()
    images = random_images(case.sizes)
    batch = processor(images=images, return_tensors="pt")
    items = vitpool.items_from(batch)
    assert [type(item) for item in items] == [Image] * len(images)
    for item, image in zip(items, images):  # each as the processor makes it for that image alone
        alone = processor(images=[image], return_tensors="pt")
        assert torch.equal(torch.as_tensor(item.pixel_values), alone["pixel_values"])
        assert tuple(item.grid_thw) == tuple(alone["image_grid_thw"][0].tolist())
    encoder = case.case_fields["make_encoder"](list(case.case_fields["budgets"]))
    reference = case.case_fields["reference"](encoder)
    embeddings = encoder.encode(items)
    for position, (item, embedding) in enumerate(zip(items, embeddings)):
        for got, wanted in zip(embedding.outputs, reference(item)):
            error = ((got - wanted).norm() / wanted.norm()).item()
            assert error < 1e-4, f"{family} image {position}: relative error {error}"


def test_numpy_output_and_a_dict_cut_the_same_as_tensors():
    processor = CASES["glm4v"].processor()
    images = random_images(((20, 28), (16, 16)), seed=1)
    as_tensors = vitpool.items_from(processor(images=images, return_tensors="pt"))
    as_arrays = vitpool.items_from(dict(processor(images=images, return_tensors="np")))
    for tensor_item, array_item in zip(as_tensors, as_arrays, strict=True):
        assert np.array_equal(np.asarray(array_item.pixel_values), tensor_item.pixel_values.numpy())
        assert tuple(array_item.grid_thw) == tuple(tensor_item.grid_thw)


def test_images_then_videos_each_cut_by_their_own_grid():
    image_rows, video_rows = torch.randn(4 + 8, 24), torch.randn(2 * 4 + 4, 24)
    batch = {
        "pixel_values": image_rows,
        "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 4]]),
        "pixel_values_videos": video_rows,
        "video_grid_thw": torch.tensor([[2, 2, 2], [1, 2, 2]]),
        "input_ids": torch.zeros(1, 5, dtype=torch.long),  # a key the family does not use: ignored
    }
    items = vitpool.items_from(batch)
    assert [type(item) for item in items] == [Image, Image, Video, Video]
    assert [tuple(item.grid_thw) for item in items] == [(1, 2, 2), (1, 2, 4), (2, 2, 2), (1, 2, 2)]
    assert torch.equal(torch.cat([items[0].pixel_values, items[1].pixel_values]), image_rows)
    assert torch.equal(torch.cat([items[2].pixel_values, items[3].pixel_values]), video_rows)
    only_videos = vitpool.items_from({k: batch[k] for k in ("pixel_values_videos", "video_grid_thw")})
    assert [type(item) for item in only_videos] == [Video, Video]


def test_what_does_not_add_up_is_named():
    rows = torch.randn(12, 24)
    with pytest.raises(ValueError, match="has pixel_values but no image_grid_thw"):
        vitpool.items_from({"pixel_values": rows}, family="qwen2_vl")
    with pytest.raises(ValueError, match="pixel_values has 12 rows; its 2 image_grid_thw rows account for 8"):
        vitpool.items_from({"pixel_values": rows, "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])})
    with pytest.raises(ValueError, match=r"image_grid_thw row 1 is \[1, 0, 2\]"):
        vitpool.items_from({"pixel_values": rows, "image_grid_thw": torch.tensor([[1, 2, 2], [1, 0, 2]])})
    with pytest.raises(ValueError, match="has video_grid_thw but no pixel_values_videos"):
        vitpool.items_from(
            {
                "pixel_values": rows[:4],
                "image_grid_thw": torch.tensor([[1, 2, 2]]),
                "video_grid_thw": torch.tensor([[1, 2, 2]]),
            }
        )
    with pytest.raises(ValueError, match="paddleocr_vl takes images only"):
        vitpool.items_from(
            {
                "pixel_values_videos": rows[:4],
                "video_grid_thw": torch.tensor([[1, 2, 2]]),
                "pixel_values": rows[:4],
                "image_grid_thw": torch.tensor([[1, 2, 2]]),
            },
            family="paddleocr_vl",
        )
    with pytest.raises(ValueError, match="are no family's processor output; it holds no pixels under any"):
        vitpool.items_from({"input_ids": torch.zeros(1, 3)})
    with pytest.raises(ValueError, match="no family 'qwen9'"):
        vitpool.items_from({"pixel_values": rows}, family="qwen9")
    with pytest.raises(ValueError, match="return_tensors='pt'"):
        vitpool.items_from({"pixel_values": [rows[:4]], "image_grid_thw": torch.tensor([[1, 2, 2]])})
    with pytest.raises(TypeError, match="a BatchFeature or a dict"):
        vitpool.items_from(rows)


def test_family_and_model_name_the_processor(tmp_path):
    rows, grid = torch.randn(4, 24), torch.tensor([[1, 2, 2]])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4v_moe"}))
    by_model = vitpool.items_from({"pixel_values": rows, "image_grid_thw": grid}, model=tmp_path)
    by_family = vitpool.items_from({"pixel_values": rows, "image_grid_thw": grid}, family="glm4v_moe")
    assert torch.equal(by_model[0].pixel_values, by_family[0].pixel_values) and len(by_model) == 1
    with pytest.raises(ValueError, match="cannot read its config.json"):
        vitpool.items_from({"pixel_values": rows}, model=tmp_path / "missing")
    with pytest.raises(ValueError, match="not both"):
        vitpool.items_from({"pixel_values": rows}, family="glm4v", model=tmp_path)


def test_every_family_says_what_its_processor_returns():
    """A family with a cutter names the keys it needs; the records import no torch (a caller's
    side reads them), and each cutter's path resolves."""
    from vitpool.models.family import named_object

    for record in RECORDS:
        output = record.processor_output
        if output is None:
            continue
        assert output.image_keys and "pixel_values" in output.image_keys[0], record.name
        assert callable(named_object(output.split)), record.name


def test_a_batch_that_fits_no_family_names_the_nearest_processors_and_what_they_dropped():
    """InternVLProcessor's output as a user has it (it drops num_patches): the guess names first the
    full processors that return it as it is (named, each tile an item), then the processors that use
    its pixels and what each lacks."""
    batch = {
        "input_ids": torch.zeros(1, 5, dtype=torch.long),
        "attention_mask": torch.ones(1, 5, dtype=torch.long),
        "pixel_values": torch.zeros(3, 3, 448, 448),
    }
    with pytest.raises(ValueError, match="are no family's processor output; it is what the full") as error:
        vitpool.items_from(batch)
    message = str(error.value)
    assert "which also holds" in message and "pass the family" not in message
    full = "it is what the full processors of aya_vision, gemma3, internvl, llama4 return"
    assert full in message and "family='aya_vision'" in message
    assert message.index(full) < message.index("the nearest: ")
    assert "internvl's, which also holds" not in message  # named once, where it takes the batch
    assert message.count("; or ") >= 3  # several processors tie on pixel_values alone
    assert "more" in message  # and the rest are counted, not listed
