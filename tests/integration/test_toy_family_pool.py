"""A family unlike Qwen3-VL (4-D tile pixels, no grid, extra outputs shaped unlike the tokens)
through a CPU pool: it was added as an adapter, its item rules and one registry line
(`tests/toy_family.py`), touching nothing in pool/, the transport, the codec or graphs/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
import torch
import toy_family

from vitpool import EncoderPool, GraphEncoder, Image, InvalidItemError
from vitpool.codec import decode_results, encode_request

pytestmark = pytest.mark.ray

TESTS_DIRECTORY = Path(__file__).resolve().parents[1]
BUDGETS = [8, 16, 32]


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory) -> Path:
    return toy_family.write_checkpoint(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def toy_pool(toy_checkpoint):
    """A local cluster whose workers import the toy family (as an out-of-tree family would be
    installed), and a pool of two CPU actors on it."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    python_path = os.pathsep.join(filter(None, [str(TESTS_DIRECTORY), os.environ.get("PYTHONPATH")]))
    # address="local": this module's own cluster, never one started elsewhere on the machine
    ray.init(
        address="local",
        num_gpus=2,
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"VITPOOL_FAMILY_MODULES": "toy_family", "PYTHONPATH": python_path}},
    )
    try:
        pool = EncoderPool.launch(model=str(toy_checkpoint), budgets=BUDGETS, name="toy", device="cpu")
        yield pool
        pool.shutdown()
    finally:
        ray.shutdown()  # also when the launch failed: the next module starts a cluster of its own


def tiles(count: int, seed: int) -> Image:
    config = toy_family.ToyTilesConfig()
    generator = torch.Generator().manual_seed(seed)
    return Image(torch.randn(count, config.channels, config.tile_size, config.tile_size, generator=generator))


def test_a_tiled_family_runs_through_a_cpu_pool(toy_pool, toy_checkpoint):
    reference = GraphEncoder.from_pretrained(
        toy_checkpoint, budgets=BUDGETS, device="cpu", dtype=torch.float32
    )
    items = [tiles(n, seed=n) for n in (1, 3, 2, 9, 1)]  # 9 tiles: larger than every budget, runs eager
    results = toy_pool.encode(items)
    expected = reference.encode(items)
    for got, want in zip(results, expected, strict=True):
        assert got.tokens.shape == want.tokens.shape
        torch.testing.assert_close(got.tokens, want.tokens, rtol=1e-5, atol=1e-5)
        assert len(got.deepstack) == len(want.deepstack) == 1
        assert got.deepstack[0].shape[1:] != got.tokens.shape[1:]  # an extra output of another row shape
        torch.testing.assert_close(got.deepstack[0], want.deepstack[0], rtol=1e-5, atol=1e-5)
        assert bool(torch.isfinite(got.tokens).all())
    # through the codec too: specs and outputs of any shape cross it
    decoded = decode_results(toy_pool.encode_bytes(encode_request(items[:2])))
    for got, want in zip(decoded, expected[:2]):
        torch.testing.assert_close(got.deepstack[0], want.deepstack[0], rtol=1e-5, atol=1e-5)


def test_bad_tiles_name_their_item(toy_pool):
    wrong_size = Image(torch.randn(2, 3, 7, 7))
    with pytest.raises(InvalidItemError, match="item 1"):
        toy_pool.encode([tiles(1, 0), wrong_size])
    nan_tiles = tiles(2, 1)
    nan_tiles.pixel_values[1, 0, 0, 0] = float("nan")
    with pytest.raises(InvalidItemError, match="item 0: pixel_values contain NaN"):
        toy_pool.encode([nan_tiles, tiles(1, 2)])
    assert (
        toy_pool.encode([tiles(2, 3)])[0].tokens.shape[0] == 2 * toy_family.ToyTilesConfig().tokens_per_tile
    )
