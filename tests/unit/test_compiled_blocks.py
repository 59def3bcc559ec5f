"""The compiled blocks (`vitpool.kernels.compiled`): installed in every family through the shared
attention hook, one compile per block class whatever the rows, exact against the uncompiled
forward, and a clean eager fallback. On a GPU they run inside the captured graphs (tests/gpu);
here the GPU gate is opened on the CPU so the compile itself is exercised with inductor's C++
backend."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from conftest import image, relative_error

from vitpool import GraphEncoder, PoolSettings
from vitpool.errors import ConfigError
from vitpool.items import prepare_items
from vitpool.kernels import compiled
from vitpool.kernels.compiled import repeated_block_stacks, set_compile_cache_dir


@pytest.fixture
def fresh_compile_state(monkeypatch, tmp_path):
    """No compiled forwards from other tests, a cache of its own, and the GPU gate open on the CPU."""
    monkeypatch.setattr(compiled, "_COMPILED_FORWARDS", {})
    monkeypatch.setattr(compiled, "_WORKING", set())
    monkeypatch.setattr(compiled, "_FAILED", set())
    monkeypatch.setattr(compiled, "_first_tensor_is_cuda", lambda args, kwargs: True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _forward(encoder: GraphEncoder, items: list, compiled_blocks: bool = False) -> list[torch.Tensor]:
    """The encoder's forward over the items at their own rows (what an eager batch runs), with
    the compiled blocks on or off (on a CPU the encoder itself always leaves them off)."""
    encoder._runner("").compiled_blocks = compiled_blocks
    return encoder._runner("").run_exact(prepare_items(items, encoder.adapter.item_rules))[0]


def test_every_repeated_block_of_the_tower_is_routed():
    encoder = GraphEncoder.from_pretrained(None, budgets=[16], device="cpu")
    stacks = repeated_block_stacks(encoder.adapter.tower)
    names = {type(stack[0]).__name__ for stack in stacks}
    assert names == {"Qwen3VLVisionBlock", "Qwen3VLVisionPatchMerger"}
    for stack in stacks:
        for block in stack:
            assert "forward" in vars(block)  # the instance's own forward
    # off the GPU a routed block runs Hugging Face's forward, exactly
    items = [image(4, 8)]
    with torch.no_grad():
        routed = _forward(encoder, items, compiled_blocks=True)
        for stack in stacks:
            for block in stack:
                del block.forward
        plain = _forward(encoder, items)
    assert all(torch.equal(a, b) for a, b in zip(routed, plain))


def test_one_compile_per_block_class_serves_every_size_and_matches_eager(fresh_compile_state):
    encoder = GraphEncoder.from_pretrained(None, budgets=[16], device="cpu")
    counters = torch._dynamo.utils.counters
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    graphs_after_first = None
    with torch.no_grad():
        for h, w in ((4, 8), (8, 12), (12, 20)):  # three row counts
            items = [image(h, w, generator), image(4, 4, generator)]
            expected = _forward(encoder, items)
            got = _forward(encoder, items, compiled_blocks=True)
            for a, b in zip(got, expected):
                assert torch.isfinite(a).all()
                assert relative_error(a, b) <= 1e-5
            graphs_after_first = graphs_after_first or counters["stats"]["unique_graphs"]
    # a block stack and the deepstack mergers: one graph each, whatever the rows; no graph breaks
    assert counters["stats"]["unique_graphs"] == graphs_after_first == 2
    assert not counters["graph_break"]
    assert compiled._WORKING == {type(s[0]) for s in repeated_block_stacks(encoder.adapter.tower)}
    assert any(os.scandir(os.environ["TORCHINDUCTOR_CACHE_DIR"]))  # artifacts went to the cache


def test_a_block_class_that_does_not_compile_runs_eager_and_says_so(fresh_compile_state, monkeypatch, caplog):
    def failing_compile(function, **kwargs):
        def compiled_function(*args, **kwargs):
            raise RuntimeError("no backend for this op\nsecond line")

        return compiled_function

    monkeypatch.setattr(compiled.torch, "compile", failing_compile)
    encoder = GraphEncoder.from_pretrained(None, budgets=[16], device="cpu")
    items = [image(4, 8)]
    with torch.no_grad():
        expected = _forward(encoder, items)
        with caplog.at_level(logging.WARNING, logger="vitpool"):
            got = _forward(encoder, items, compiled_blocks=True)
            again = _forward(encoder, items, compiled_blocks=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.equal(a, b) for a, b in zip(again, expected))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("Qwen3VLVisionBlock blocks run eager" in m and "no backend for this op" in m for m in warnings)
    assert len([m for m in warnings if "Qwen3VLVisionBlock" in m]) == 1  # said once, not per block


def test_the_cache_directory_setting(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert set_compile_cache_dir(None) == tmp_path / ".cache" / "vitpool" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    assert set_compile_cache_dir(None) == tmp_path / "theirs"  # a user's inductor setting is kept
    chosen = set_compile_cache_dir(tmp_path / "ours")
    assert chosen.is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(chosen)


def test_the_settings_are_checked_and_reach_the_encoder_spec():
    with pytest.raises(ConfigError, match="compiled_blocks"):
        GraphEncoder.from_pretrained(None, budgets=[16], device="cpu", compiled_blocks="yes")
    with pytest.raises(ConfigError, match="compiled_blocks"):
        PoolSettings(compiled_blocks=1)
    spec = PoolSettings(compiled_blocks=False, compile_cache_dir="/tmp/x").encoder_spec()
    assert spec.compiled_blocks is False and spec.compile_cache_dir == "/tmp/x"
    assert GraphEncoder.from_pretrained(None, budgets=[16], device="cpu").compiled_blocks is False  # GPU only
