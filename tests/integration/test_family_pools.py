"""Every family through a CPU pool: the same results as its in-process GraphEncoder, every output
tensor (tokens, and Qwen3-VL's deepstack features) compared. The families whose case offers a
tower-only checkpoint (`family_tiny.TOWER_FAMILIES`) through one test; the tiled families, those of
several inputs and MiniCPM-V 4.6 (full checkpoints, items of their own) through their own."""

from __future__ import annotations

import pytest
import torch
from conftest import mixed_items as qwen3_vl_items
from family_tiny import TOWER_FAMILIES, case_module, families_offering, mixed_items, save_tiny_tower

from vitpool import EncoderPool, GraphEncoder, InvalidItemError, Video

pytestmark = pytest.mark.ray

BUDGETS = [16, 64, 256]
SHIPPED_QWEN3_VL = "qwen3_vl"  # the tiny tower shipped with vitpool (model=None): the family with deepstack


def assert_same_outputs(results, expected) -> None:
    """Every output tensor of every item equal, in `Embedding.outputs` order."""
    assert len(results) == len(expected)
    for got, want in zip(results, expected, strict=True):
        assert len(got.outputs) == len(want.outputs)
        for got_tensor, want_tensor in zip(got.outputs, want.outputs, strict=True):
            assert got_tensor.shape == want_tensor.shape
            torch.testing.assert_close(got_tensor, want_tensor, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", TOWER_FAMILIES)
def test_a_pool_of_the_family_equals_its_encoder(ray_cluster, tmp_path, family):
    if family == SHIPPED_QWEN3_VL:
        model, items = None, qwen3_vl_items(0)  # images, a video, and one image larger than every budget
    else:
        model, items = str(save_tiny_tower(family, tmp_path)), mixed_items(family)
    reference = GraphEncoder.from_pretrained(model, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    pool = EncoderPool.launch(
        model=model, budgets=BUDGETS, name=f"family-{family}", num_actors=1, device="cpu"
    )
    try:
        expected = reference.encode(items)
        if family == SHIPPED_QWEN3_VL:
            assert all(len(embedding.deepstack) == 2 for embedding in expected)  # deepstack is compared
        assert_same_outputs(pool.encode(items), expected)
        with pytest.raises(InvalidItemError, match="item 1"):  # checked in this process, by the rules
            pool.encode([items[0], Video(items[1].pixel_values, (2, 8, 6))])
    finally:
        pool.shutdown()


@pytest.mark.parametrize("family", families_offering("TILE_SHAPE"))  # items Image(tiles): the tiled families
def test_a_pool_of_a_tiled_family_equals_its_encoder(ray_cluster, tmp_path, family):
    """A tiled family through the pool: a full save in transformers' layout, images of several
    tile counts (one over every budget), checked in the caller by the tile rules."""
    case = case_module(family)

    from vitpool import Image

    case.hf_model(seed=4).save_pretrained(tmp_path, safe_serialization=True)
    budgets = [case.TOKENS_PER_TILE * tiles for tiles in (1, 2, 4)]
    generator = torch.Generator().manual_seed(0)
    items = [Image(torch.randn(count, *case.TILE_SHAPE, generator=generator)) for count in (1, 3, 2, 5)]
    reference = GraphEncoder.from_pretrained(tmp_path, budgets=budgets, device="cpu", dtype=torch.float32)
    pool = EncoderPool.launch(
        model=str(tmp_path), budgets=budgets, name=f"family-{family}", num_actors=1, device="cpu"
    )
    try:
        assert_same_outputs(pool.encode(items), reference.encode(items))
        with pytest.raises(InvalidItemError, match="item 1: .*must be tiles"):
            pool.encode([items[0], Image(torch.randn(2, 3, 8, 6))])
    finally:
        pool.shutdown()


# per family of several inputs (a global view and crops: its case's LOCAL_ROW_SHAPE): its token
# budgets (a few tiles of each path) and crops per item, one of them over every budget of the
# crops' path
SEVERAL_INPUTS = {
    "step3p7": ([4, 8], (2, 0, 12, 5)),  # 4 tokens a view, 1 a crop
    "deepseek_ocr2": ([257, 514], (2, 0, 4)),  # 257 a view (its separator too), 144 a crop
}


@pytest.mark.parametrize("family", families_offering("LOCAL_ROW_SHAPE"))
def test_a_pool_of_a_family_of_several_inputs_joins_each_items_parts(ray_cluster, tmp_path, family):
    """Through the pool, each item's global view and crops go as parts of their own paths
    (checked in the caller), possibly to different batches, and come back as one Embedding equal
    to the in-process encoder's; encode_refs and encode_async join them too."""
    import asyncio

    import ray

    case = case_module(family)

    from vitpool import Image

    model = case.hf_model(seed=4)
    model.config.vision_config.local_image_size = case.LOCAL_SIZE
    model.save_pretrained(tmp_path, safe_serialization=True)
    budgets, crop_counts = SEVERAL_INPUTS[family]
    generator = torch.Generator().manual_seed(0)

    def item(crops: int) -> Image:
        view = torch.randn(1, *case.GLOBAL_ROW_SHAPE, generator=generator)
        local = torch.randn(crops, *case.LOCAL_ROW_SHAPE, generator=generator)
        return Image(view, inputs={"pixel_values_local": local} if crops else None)

    items = [item(count) for count in crop_counts]
    reference = GraphEncoder.from_pretrained(tmp_path, budgets=budgets, device="cpu", dtype=torch.float32)
    pool = EncoderPool.launch(
        model=str(tmp_path), budgets=budgets, name=f"family-{family}", num_actors=1, device="cpu"
    )
    try:
        expected = reference.encode(items)
        assert_same_outputs(pool.encode(items), expected)
        assert_same_outputs(ray.get(pool.encode_refs(items)), expected)
        assert_same_outputs(asyncio.run(pool.encode_async(items)), expected)
        crops = case.LOCAL_ROW_SHAPE
        bad = Image(
            items[0].pixel_values,
            inputs={"pixel_values_local": torch.randn(2, crops[0], crops[1], crops[2] + 2)},
        )
        outcomes = pool.encode([items[0], bad], return_exceptions=True)
        assert isinstance(outcomes[1], InvalidItemError) and outcomes[1].index == 1
        assert_same_outputs(outcomes[:1], expected[:1])
    finally:
        pool.shutdown()


def test_a_pool_of_minicpmv4_6_equals_its_encoder(ray_cluster, tmp_path):
    """MiniCPM-V 4.6 through the pool: images of several slices of unlike sizes (one over every
    budget), the processor's strip as the item's pixels, checked in the caller."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from family_cases import minicpmv4_6 as case

    from vitpool import Image

    if case.TOO_OLD:
        pytest.skip(case.TOO_OLD)
    case.tiny_model(seed=4).save_pretrained(tmp_path, safe_serialization=True)
    budgets = [8, 16]
    generator = torch.Generator().manual_seed(0)

    def image(sizes: list[list[int]]) -> Image:
        rows = torch.randn(sum(h * w for h, w in sizes), *case.ROW_SHAPE, generator=generator)
        return Image(case.strip_of(rows), sizes)  # as the processor emits it

    items = [
        image([[4, 4]]),
        image([[8, 4], [4, 8], [4, 4]]),
        image([[8, 8], [8, 12], [12, 12]]),
    ]  # 19 tokens: eager
    reference = GraphEncoder.from_pretrained(tmp_path, budgets=budgets, device="cpu", dtype=torch.float32)
    pool = EncoderPool.launch(
        model=str(tmp_path), budgets=budgets, name="family-minicpmv4_6", num_actors=1, device="cpu"
    )
    try:
        assert_same_outputs(pool.encode(items), reference.encode(items))
        with pytest.raises(InvalidItemError, match="item 1: .*multiples of 4"):
            pool.encode([items[0], Image(torch.randn(12, *case.ROW_SHAPE), [[2, 6]])])
    finally:
        pool.shutdown()
