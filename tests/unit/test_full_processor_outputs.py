"""The full processors' output of the tiled families whose processors drop where an image's tiles
end (InternVL's and Aya Vision's `num_patches`, Llama 4's `aspect_ratios`, Gemma 3's `num_crops`):
with the family named, `items_from` cuts an item per tile, and the items' tokens joined are what the
model's `get_image_features` returns for the whole batch (fp32, CPU). Without the family the batch
is refused, saying to name it."""

from __future__ import annotations

import pytest
import torch
from conftest import relative_error
from family_cases import case_of

import vitpool
from vitpool import Image

TOLERANCE = 1e-4
# family -> the key its full processor drops
DROPPED = {
    "internvl": "num_patches",
    "aya_vision": "num_patches",
    "llama4": "aspect_ratios",
    "gemma3": "num_crops",
}


def full_processor_output(family: str, tiles: int, seed: int) -> dict:
    """What the family's full processor returns for a prompt with images: every image's tiles in
    one `pixel_values`, the prompt, and not the key that says where an image ends."""
    shape = case_of(family).TILE_SHAPE
    return {
        "pixel_values": torch.randn(tiles, *shape, generator=torch.Generator().manual_seed(seed)),
        "input_ids": torch.zeros(1, 12, dtype=torch.long),
        "attention_mask": torch.ones(1, 12, dtype=torch.long),
    }


@pytest.mark.parametrize("family", sorted(DROPPED))
def test_named_it_is_cut_per_tile_and_encodes_as_get_image_features(family):
    case = case_of(family)
    model = case.hf_model(seed=1)
    encoder = case.encoder_of(model, case.CASE_FIELDS["budgets"])
    batch = full_processor_output(family, tiles=5, seed=2)
    assert DROPPED[family] not in batch
    items = vitpool.items_from(batch, family=family)
    assert [tuple(item.pixel_values.shape) for item in items] == [(1, *case.TILE_SHAPE)] * 5
    for item, tile in zip(items, batch["pixel_values"], strict=True):
        assert torch.equal(torch.as_tensor(item.pixel_values)[0], tile)
    # the model on the whole batch at once, as its forward runs the processor's output
    want = case.image_features(model, Image(batch["pixel_values"]))
    embeddings = encoder.encode(items)
    got = torch.cat([embedding.tokens for embedding in embeddings])
    assert all(torch.isfinite(embedding.tokens).all() for embedding in embeddings)
    assert got.shape == want.shape
    assert relative_error(got, want) <= TOLERANCE


# family -> its count key's value for 3 tiles, and the tiles of each image it makes
COUNTED = {
    "internvl": (torch.tensor([2, 1]), [2, 1]),
    "aya_vision": (torch.tensor([2, 1]), [2, 1]),
    "gemma3": (torch.tensor([1, 0]), [2, 1]),  # a view and its crop, then a view alone
    "llama4": (torch.tensor([[1, 2]]), [3]),  # a 1 x 2 canvas and its global tile
}


@pytest.mark.parametrize("family", sorted(DROPPED))
def test_with_its_count_key_an_item_is_still_an_image(family):
    """The image processor's output (the count key kept) is cut per image, as before."""
    pixels = full_processor_output(family, tiles=3, seed=3)["pixel_values"]
    count, tiles = COUNTED[family]
    items = vitpool.items_from({"pixel_values": pixels, DROPPED[family]: count}, family=family)
    assert [item.pixel_values.shape[0] for item in items] == tiles


def test_unnamed_it_is_refused_saying_to_name_the_family():
    batch = full_processor_output("internvl", tiles=2, seed=4)
    with pytest.raises(ValueError, match=r"family="):
        vitpool.items_from(batch)


@pytest.mark.parametrize("family", sorted(DROPPED))
def test_pixels_that_are_not_tiles_are_refused(family):
    with pytest.raises(ValueError, match=r"tiles are \[tiles, channels, height, width\]"):
        vitpool.items_from({"pixel_values": torch.randn(2, 3, 8)}, family=family)
