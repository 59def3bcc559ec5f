"""The rotary wrappers' shapes on the CPU: which calls reach the kernel and how they are laid out
for it (Step-3.7's batch of tiles against one table, MiniMax-M3-VL's partial rotary, Llama 4's
complex pairs), with the kernel replaced by its contract written in torch, against Hugging Face's
own function (the kernel itself: tests/gpu/test_fused_tile_passes_gpu.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from vitpool.kernels import rotary
from vitpool.kernels.fused_switch import HALF_DTYPES
from vitpool.kernels.rotary import INTERLEAVED_ROTARY_FUNCTION, ROTARY_FUNCTION


def rotary_contract(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`fused_rotary`'s documented contract: row r takes table row r % positions; the table's width
    of each head turned in fp32, the rest as it is; one rounding to x's dtype."""
    rows, width = x.shape[0], cos.shape[1]
    rows_table = torch.arange(rows) % cos.shape[0]
    c, s = cos[rows_table].float()[:, None, :], sin[rows_table].float()[:, None, :]
    turned = x[..., :width].float()
    first, second = turned.chunk(2, dim=-1)
    out = turned * c + torch.cat([-second, first], dim=-1) * s
    return torch.cat([out.to(x.dtype), x[..., width:]], dim=-1)


def interleaved_contract(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`fused_interleaved_rotary`'s: each pair of row r times table[r % positions] as complex numbers."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    turned = pairs * table[torch.arange(x.shape[0]) % table.shape[0]][:, None, :]
    return torch.view_as_real(turned).flatten(-2).to(x.dtype)


@pytest.fixture
def kernels_on_the_cpu(monkeypatch):
    """The wrappers' own checks, but CPU tensors taken and the kernels' contracts run; the calls counted."""
    calls = []
    monkeypatch.setattr(rotary, "_kernel_takes", lambda q, k: q.dtype in HALF_DTYPES and k.dtype == q.dtype)
    monkeypatch.setattr(rotary, "fused_rotary", lambda *a: calls.append("halves") or rotary_contract(*a))
    monkeypatch.setattr(
        rotary, "fused_interleaved_rotary", lambda *a: calls.append("pairs") or interleaved_contract(*a)
    )
    return calls


def _wrapped(module_name: str, function: str):
    modeling = importlib.import_module(module_name)
    patch = (
        rotary._patch_interleaved_rotary if function == INTERLEAVED_ROTARY_FUNCTION else rotary._patch_rotary
    )
    patch(modeling)
    wrapped = getattr(modeling, function)
    return wrapped, wrapped.__vitpool_original__


def _angles(rows: int, width: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.cat([torch.randn(rows, width // 2)] * 2, dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def test_a_batch_of_tiles_against_one_table_is_flattened_to_rows(kernels_on_the_cpu):
    from vitpool.kernels.fused import use_fused_ops

    wrapped, original = _wrapped("transformers.models.step3p7.modeling_step3p7", ROTARY_FUNCTION)
    q, k = torch.randn(7, 50, 4, 16).bfloat16(), torch.randn(7, 50, 4, 16).bfloat16()
    cos, sin = _angles(50, 16)
    with use_fused_ops(True):
        got = wrapped(q, k, cos, sin)
    assert kernels_on_the_cpu == ["halves", "halves"]
    for mine, theirs in zip(got, original(q, k, cos, sin), strict=True):
        assert mine.shape == theirs.shape == q.shape and torch.equal(mine, theirs)


def test_a_table_that_fits_no_broadcast_of_hugging_faces_is_left_to_it(kernels_on_the_cpu):
    from vitpool.kernels.fused import use_fused_ops

    wrapped, _ = _wrapped("transformers.models.step3p7.modeling_step3p7", ROTARY_FUNCTION)
    q = torch.randn(7, 50, 4, 16).bfloat16()
    with use_fused_ops(True), pytest.raises(RuntimeError):  # 49 table rows for 50: HF's error, not ours
        wrapped(q, q, *_angles(49, 16))
    narrower = _angles(50, 12)  # a narrower table: only MiniMax-M3-VL's function turns part of a head
    with use_fused_ops(True), pytest.raises(RuntimeError):
        wrapped(q, q, *narrower)
    assert kernels_on_the_cpu == []


def test_minimax_m3_vls_partial_rotary_turns_the_tables_width_and_keeps_the_rest(kernels_on_the_cpu):
    from vitpool.kernels.fused import use_fused_ops

    wrapped, original = _wrapped("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl", ROTARY_FUNCTION)
    q, k = torch.randn(40, 3, 20).bfloat16(), torch.randn(40, 3, 20).bfloat16()
    cos, sin = _angles(40, 12, torch.bfloat16)
    with use_fused_ops(True):
        got = wrapped(q, k, cos, sin)
    assert kernels_on_the_cpu == ["halves", "halves"]
    for mine, theirs, given in zip(got, original(q, k, cos, sin), (q, k), strict=True):
        assert mine.shape == theirs.shape and torch.equal(mine[..., 12:], given[..., 12:])
        # Hugging Face's products round to bf16 each, the kernel's once
        assert (mine.float() - theirs.float()).abs().max() <= theirs.float().abs().max() * 2**-6


def test_llama4s_complex_pairs_read_the_table_in_place(kernels_on_the_cpu):
    from transformers.models.llama4.configuration_llama4 import Llama4VisionConfig
    from transformers.models.llama4.modeling_llama4 import Llama4VisionRotaryEmbedding

    from vitpool.kernels.fused import use_fused_ops

    wrapped, original = _wrapped("transformers.models.llama4.modeling_llama4", INTERLEAVED_ROTARY_FUNCTION)
    config = Llama4VisionConfig(hidden_size=64, num_attention_heads=4, image_size=56, patch_size=14)
    table = Llama4VisionRotaryEmbedding(config).freqs_ci  # [17, 1, 8] complex64
    q, k = torch.randn(3, 17, 4, 16).bfloat16(), torch.randn(3, 17, 4, 16).bfloat16()
    with use_fused_ops(True):
        got = wrapped(q, k, table)
    assert kernels_on_the_cpu == ["pairs", "pairs"]
    for mine, theirs in zip(got, original(q, k, table), strict=True):
        assert mine.shape == theirs.shape == q.shape and torch.equal(mine, theirs)
