"""Bad input gets an InvalidItemError naming the item; the encoder keeps working."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ROW_WIDTH, image, make_encoder

from vitpool import ConfigError, Image, InvalidItemError, Video


def nan_pixels():
    item = image(4, 4)
    item.pixel_values[3, 7] = float("nan")
    return item


def inf_pixels():
    item = image(4, 4)
    item.pixel_values[0, 0] = float("inf")
    return item


# name: (bad item, words the message must contain)
BAD_ITEMS = {
    "feature size": (Image(torch.randn(16, 1000), (1, 4, 4)), "1000 features per row"),
    "rows != t*h*w": (Image(torch.randn(20, ROW_WIDTH), (1, 4, 4)), "needs t*h*w = 16"),
    "grid not divisible by merge": (
        Image(torch.randn(15, ROW_WIDTH), (1, 3, 5)),
        "multiples of the spatial merge size",
    ),
    "zero size": (Image(torch.randn(0, ROW_WIDTH), (1, 0, 4)), "zero or negative"),
    "no pixel rows": (Image(torch.randn(0, ROW_WIDTH), (1, 4, 4)), "needs t*h*w = 16"),
    "negative size": (Video(torch.randn(16, ROW_WIDTH), (-1, 4, 4)), "zero or negative"),
    "integer dtype": (Image(torch.zeros(16, ROW_WIDTH, dtype=torch.int64), (1, 4, 4)), "floating-point"),
    "numpy integer dtype": (Image(np.zeros((16, ROW_WIDTH), dtype=np.uint8), (1, 4, 4)), "floating-point"),
    "NaN pixels": (nan_pixels(), "NaN or infinity"),
    "inf pixels": (inf_pixels(), "NaN or infinity"),
    "3-D pixels": (Image(torch.randn(1, 16, ROW_WIDTH), (1, 4, 4)), "must be 2-D"),
    "grid with two numbers": (Image(torch.randn(16, ROW_WIDTH), (4, 4)), "three integers"),
    "float grid": (Image(torch.randn(16, ROW_WIDTH), (1.0, 4.0, 4.0)), "three integers"),
    "image with several frames": (Image(torch.randn(32, ROW_WIDTH), (2, 4, 4)), "use Video"),
    "not an item": ({"pixel_values": torch.randn(16, ROW_WIDTH)}, "expected vitpool.Image"),
    "list of pixels": (Image([[0.0] * ROW_WIDTH] * 16, (1, 4, 4)), "torch tensor or NumPy array"),
}


@pytest.fixture(scope="module")
def encoder(tiny_adapter):
    return make_encoder(tiny_adapter, [16, 64])


@pytest.mark.parametrize("name", sorted(BAD_ITEMS))
def test_bad_item_is_named_and_encoder_keeps_working(encoder, name):
    bad, words = BAD_ITEMS[name]
    good = image(4, 4, torch.Generator().manual_seed(0))
    before = encoder.encode([good])[0].tokens
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([image(2, 2), bad])
    assert raised.value.index == 1
    assert "item 1" in str(raised.value) and words in str(raised.value)
    assert torch.equal(encoder.encode([good])[0].tokens, before)


# (settings, words the ConfigError must contain)
BAD_SETTINGS = [
    ({"budgets": []}, "empty"),
    ({"budgets": [16, 0]}, "positive integers"),
    ({"budgets": [16, 16]}, "duplicates"),
    ({"budgets": [16.5]}, "positive integers"),
    ({"budgets": [8, 64], "max_items_per_batch": 9}, "exceeds the smallest budget"),
    ({"budgets": [64], "max_items_per_batch": 0}, ">= 1"),
    ({"budgets": [64], "max_items_per_batch": 8, "max_frames_per_batch": 4}, "max_frames_per_batch"),
    ({"budgets": [64], "dtype": torch.int32}, "not supported"),
    ({"budgets": [64], "device": "tpu"}, "torch device"),
    ({"budgets": [64], "capacity_limits": {"windows": 8}}, "bounds no 'windows'"),  # Qwen3-VL has no windows
    ({"budgets": [64], "capacity_limits": {"sequences": 0}}, "positive integer"),
]


@pytest.mark.parametrize("settings, words", BAD_SETTINGS)
def test_invalid_settings_are_rejected(tiny_adapter, settings, words):
    from vitpool import GraphEncoder

    settings = {"device": "cpu", **settings}
    with pytest.raises(ConfigError, match=words):
        GraphEncoder(tiny_adapter, **settings)


def test_capacity_limits_bound_the_familys_own_capacities(tiny_adapter):
    """A limit is set by the capacity's name, for any family; max_frames_per_batch is the
    attention-sequence bound under its long-standing name."""
    from vitpool import GraphEncoder

    by_name = GraphEncoder(
        tiny_adapter, budgets=[64, 512], device="cpu", max_items_per_batch=6, capacity_limits={"sequences": 6}
    )
    by_frames = GraphEncoder(
        tiny_adapter, budgets=[64, 512], device="cpu", max_items_per_batch=6, max_frames_per_batch=6
    )
    assert {b.limit("sequences") for b in by_name.budgets} == {4, 6}  # the few-sequence variant, and 6
    assert {b.limit("sequences") for b in by_frames.budgets} == {4, 6}


def test_a_tiled_family_takes_a_frame_bound_as_tiles_per_batch():
    """A tile is one attention sequence: max_frames_per_batch bounds a batch's tiles."""
    import toy_family

    from vitpool import GraphEncoder, Image

    adapter = toy_family.ToyTilesAdapter(toy_family.ToyTilesTower(toy_family.ToyTilesConfig()))
    encoder = GraphEncoder(adapter, budgets=[8, 16], device="cpu", max_frames_per_batch=1)
    assert all(budget.limits == (("sequences", 1),) for budget in encoder.budgets)
    one_tile = (1, *adapter.row_shape)
    encoder.encode([Image(torch.randn(one_tile)), Image(torch.randn(one_tile))])
    assert sum(encoder.stats().replays_per_budget.values()) == 2  # one tile a batch
    encoder.encode([Image(torch.randn(2, *adapter.row_shape))])
    assert encoder.stats().eager_batches == 1  # two tiles fit no budget: eager, alone


@pytest.mark.parametrize(
    "limits, expected",
    [
        (None, ()),
        ({"windows": 64, "sequences": 8}, (("sequences", 8), ("windows", 64))),  # sorted, hashable
        ([("windows", 64)], (("windows", 64),)),
    ],
)
def test_pool_settings_keep_capacity_limits_as_pairs(limits, expected):
    from vitpool import PoolSettings

    settings = PoolSettings(capacity_limits=limits)
    assert settings.capacity_limits == expected
    assert settings.encoder_spec().capacity_limits == expected


@pytest.mark.parametrize("limits", [{"windows": 0}, {"windows": 1.5}, "windows", [("windows",)]])
def test_pool_settings_refuse_bad_capacity_limits(limits):
    from vitpool import PoolSettings

    with pytest.raises(ConfigError, match="capacity_limits"):
        PoolSettings(capacity_limits=limits)
