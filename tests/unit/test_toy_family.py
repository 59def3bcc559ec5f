"""A family with 4-D pixels and no grid (tests/toy_family.py) runs through GraphEncoder and the
family registry without any change outside its own module."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import toy_family
from conftest import relative_error
from safetensors.torch import save_file

from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError, Video
from vitpool.models import FAMILIES
from vitpool.models.registry import FAMILY_MODULES_VARIABLE

BUDGETS = [8, 16, 32]  # output tokens: 2, 4 and 8 tiles of 4 tokens
TOLERANCE = 1e-5


def tiles(num_tiles: int, generator: torch.Generator | None = None) -> Image:
    return Image(torch.randn(num_tiles, 3, 8, 8, generator=generator))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return toy_family.write_checkpoint(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def encoder(checkpoint) -> GraphEncoder:
    return GraphEncoder.from_pretrained(checkpoint, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def tower_outputs(encoder: GraphEncoder, item: Image) -> list[torch.Tensor]:
    """The toy tower run on the item alone, directly: what the encoder must give."""
    with torch.no_grad():
        return list(encoder.adapter.tower(item.pixel_values))


def assert_matches_tower(encoder, items, embeddings) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings):
        expected = tower_outputs(encoder, item)
        assert embedding.tokens.shape == (item.pixel_values.shape[0] * 4, 24)
        assert [tuple(d.shape[1:]) for d in embedding.deepstack] == [(2, 16)]
        for got, want in zip(embedding.outputs, expected, strict=True):
            assert torch.isfinite(got).all()
            assert relative_error(got, want) <= TOLERANCE


def test_items_of_several_tile_counts_match_the_tower(encoder):
    generator = torch.Generator().manual_seed(0)
    items = [tiles(n, generator) for n in (1, 3, 2, 5, 1)]  # 48 tokens: two batches
    before = sum(encoder.stats().replays_per_budget.values())
    assert_matches_tower(encoder, items, encoder.encode(items))
    assert sum(encoder.stats().replays_per_budget.values()) == before + 2


def test_every_budget_matches_the_tower(encoder):
    generator = torch.Generator().manual_seed(1)
    for budget, num_tiles in zip(BUDGETS, (2, 3, 7)):  # just over half of each budget's tiles
        items = [tiles(num_tiles, generator)]
        before = encoder.stats().replays_per_budget.get(budget, 0)
        assert_matches_tower(encoder, items, encoder.encode(items))
        assert encoder.stats().replays_per_budget[budget] == before + 1


def test_an_oversized_item_runs_eager_alone(encoder):
    items = [tiles(2), tiles(12)]  # 48 tokens > the largest budget, 32
    before = encoder.stats()
    assert_matches_tower(encoder, items, encoder.encode(items))
    after = encoder.stats()
    assert after.eager_batches == before.eager_batches + 1
    assert sum(after.replays_per_budget.values()) == sum(before.replays_per_budget.values()) + 1


# name: (bad item, words the message must contain)
BAD_ITEMS = {
    "a grid": (Image(torch.randn(2, 3, 8, 8), (1, 2, 2)), "no grid"),
    "a video": (Video(torch.randn(2, 3, 8, 8)), "images (tiles) only"),
    "tile of another size": (Image(torch.randn(2, 3, 16, 16)), "must be tiles [tiles, 3, 8, 8]"),
    "flattened patches": (Image(torch.randn(4, 192)), "must be tiles"),
    "NaN pixels": (Image(torch.full((1, 3, 8, 8), float("nan"))), "NaN or infinity"),
}


@pytest.mark.parametrize("name", sorted(BAD_ITEMS))
def test_a_bad_item_is_named(encoder, name):
    bad, words = BAD_ITEMS[name]
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([tiles(1), bad])
    assert raised.value.index == 1 and words in str(raised.value)
    outcomes = encoder.encode_each([tiles(1), bad, tiles(2)])
    assert isinstance(outcomes[1], InvalidItemError) and outcomes[1].index == 1
    assert outcomes[0].tokens.shape == (4, 24) and outcomes[2].tokens.shape == (8, 24)


def test_random_weights_are_the_same_in_every_process(checkpoint, encoder):
    again = GraphEncoder.from_pretrained(checkpoint, budgets=[8], device="cpu")
    for mine, theirs in zip(
        encoder.adapter.tower.state_dict().values(), again.adapter.tower.state_dict().values()
    ):
        assert torch.equal(mine, theirs)


def test_saved_weights_load_strictly(tmp_path, encoder):
    directory = toy_family.write_checkpoint(tmp_path, seed=5)  # the weights, not the seed, decide
    state = {name: tensor.contiguous() for name, tensor in encoder.adapter.tower.state_dict().items()}
    save_file(state, directory / "model.safetensors")
    item = tiles(3, torch.Generator().manual_seed(2))
    loaded = GraphEncoder.from_pretrained(directory, budgets=[16], device="cpu").encode([item])[0]
    assert torch.allclose(loaded.tokens, encoder.encode([item])[0].tokens, rtol=1e-5, atol=1e-6)
    del state["out.bias"]
    save_file(state, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing keys \['out.bias'\]"):
        GraphEncoder.from_pretrained(directory, budgets=[16], device="cpu")


def test_the_family_module_named_in_the_environment_is_imported_on_lookup(monkeypatch, checkpoint):
    """As in a Ray actor's process: the family is not registered until its module is imported."""
    monkeypatch.delitem(FAMILIES, toy_family.MODEL_TYPE)
    monkeypatch.delitem(sys.modules, "toy_family")
    with pytest.raises(CheckpointError, match="not supported"):
        GraphEncoder.from_pretrained(checkpoint, budgets=[8], device="cpu")
    monkeypatch.setenv(FAMILY_MODULES_VARIABLE, " toy_family, ")
    encoder = GraphEncoder.from_pretrained(checkpoint, budgets=[8], device="cpu")
    assert type(encoder.adapter).__name__ == "ToyTilesAdapter"
    assert encoder.output_layout.row_shapes == ((24,), (2, 16))


def test_an_unimportable_family_module_is_named(monkeypatch, checkpoint):
    monkeypatch.setenv(FAMILY_MODULES_VARIABLE, "toy_family,no_such_family_module")
    with pytest.raises(CheckpointError, match="no_such_family_module"):
        GraphEncoder.from_pretrained(checkpoint, budgets=[8], device="cpu")


def test_config_fields_are_read(tmp_path):
    directory = toy_family.write_checkpoint(tmp_path, tokens_per_tile=2, out_hidden_size=12)
    assert json.loads((directory / "config.json").read_text())["model_type"] == toy_family.MODEL_TYPE
    encoder = GraphEncoder.from_pretrained(directory, budgets=[8], device="cpu")
    [embedding] = encoder.encode([tiles(3)])
    assert embedding.tokens.shape == (6, 12)


def test_a_familys_budget_range_sets_its_default_budgets(checkpoint):
    """No budgets given: the toy family's range (whole tiles, up to MAX_GRAPH_TILES) decides, not
    the device's ladder; a batch of more tiles runs eager at its own size."""
    from vitpool.graphs.defaults import family_budgets
    from vitpool.models.protocol import BudgetRange

    encoder = GraphEncoder.from_pretrained(checkpoint, device="cpu")
    step = encoder.adapter.tokens_per_tile
    expected = family_budgets(BudgetRange(step, toy_family.MAX_GRAPH_TILES * step, step))
    assert [budget.num_tokens for budget in encoder.budgets] == expected
    assert all(tokens % step == 0 for tokens in expected) and len(expected) > 3
    generator = torch.Generator().manual_seed(2)
    largest, over = (tiles(toy_family.MAX_GRAPH_TILES + extra, generator) for extra in (0, 1))
    encoder.encode([largest])
    assert encoder.stats().replays_per_budget == {expected[-1]: 1} and encoder.stats().eager_batches == 0
    encoder.encode([over])
    assert encoder.stats().eager_batches == 1


def test_a_budget_range_refuses_bounds_off_its_step():
    from vitpool.graphs.defaults import family_budgets
    from vitpool.models.protocol import BudgetRange

    assert family_budgets(BudgetRange(256, 3328, 256)) == [
        256,
        512,
        768,
        1024,
        1280,
        1536,
        1792,
        2048,
        2304,
        2816,
        3328,
    ]  # one InternVL tile is 256 tokens: every tile count to 8, then about 12.5% apart
    for bounds in ((250, 1024, 256), (256, 1000, 256), (512, 256, 256), (0, 256, 1)):
        with pytest.raises(ValueError):
            BudgetRange(*bounds)
