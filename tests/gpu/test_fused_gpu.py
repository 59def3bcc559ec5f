"""GPU: the fused rotary kernel, the patch embedding as a GEMM and the GELU-epilogue MLP against
Hugging Face's own code (bf16), and an encoder with them against one without (each budget checked
at capture)."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import image, relative_error, video
from family_tiny import TOWER_FAMILIES, case_module, mixed_items, save_tiny_tower

from vitpool import GraphEncoder
from vitpool.kernels.fused import fused_rotary, use_fused_ops
from vitpool.kernels.gelu_mlp import gelu_mlp_layout
from vitpool.kernels.rotary import ROTARY_FUNCTION

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows, heads, head_dim", [(196, 16, 72), (3136, 16, 72), (7, 2, 16), (100, 12, 80)])
def test_the_rotary_kernel_matches_hugging_face(rows, heads, head_dim):
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    original = getattr(modeling_qwen3_vl, ROTARY_FUNCTION)
    original = getattr(original, "__vitpool_original__", original)
    generator = torch.Generator(device="cuda").manual_seed(rows)
    # q and k as the towers make them: views into one [rows, 3, heads, head_dim] projection
    qkv = torch.randn(rows, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    q, k = qkv[:, 0], qkv[:, 1]
    angles = torch.randn(rows, head_dim // 2, device="cuda", generator=generator)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    want_q, want_k = original(q, k, cos, sin)
    got_q, got_k = fused_rotary(q, cos, sin), fused_rotary(k, cos, sin)
    assert got_q.dtype == torch.bfloat16 and got_q.shape == want_q.shape
    # the same fp32 math, one bf16 rounding at the end: at most one bf16 ulp apart
    assert (got_q.float() - want_q.float()).abs().max() <= want_q.float().abs().max() * 2**-7
    assert relative_error(got_k, want_k) <= 1e-3 and relative_error(got_q, want_q) <= 1e-3


def test_the_patch_embedding_as_a_gemm_matches_the_convolution(monkeypatch):
    from vitpool.kernels import patch_gemm as fused

    encoder = GraphEncoder.from_pretrained(None, budgets=[16], device="cuda")
    linears = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(fused.F, "linear", lambda *args: linears.append(1) or linear(*args))
    conv = next(m for m in encoder.adapter.tower.modules() if isinstance(m, torch.nn.Conv3d))
    x = torch.randn(300, conv.in_channels, *conv.kernel_size, device="cuda", dtype=torch.bfloat16)
    with use_fused_ops(True):
        got = conv(x)
    assert linears  # the GEMM path ran
    assert relative_error(got, torch.nn.Conv3d.forward(conv, x)) <= 1e-2


@pytest.mark.parametrize("views, side", [(1, 896), (3, 364)])
def test_a_whole_images_patch_convolution_as_a_gemm_matches_and_leaves_the_rows_contiguous(views, side):
    conv = torch.nn.Conv2d(3, 1152, kernel_size=14, stride=14, padding="valid").to("cuda", torch.bfloat16)
    from vitpool.kernels.fused import install_fused_ops

    install_fused_ops(torch.nn.Sequential(conv))
    generator = torch.Generator(device="cuda").manual_seed(side)
    x = torch.randn(views, 3, side, side, device="cuda", dtype=torch.bfloat16, generator=generator)
    with torch.no_grad(), use_fused_ops(True):
        got = conv(x)
    want = torch.nn.Conv2d.forward(conv, x)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert relative_error(got, want) <= 1e-2
    assert got.flatten(2).transpose(1, 2).is_contiguous()  # what the towers do next
    odd = x[:, :, :-3, :-5]  # pixels past the last whole patch: the convolution drops them, so does the GEMM
    with torch.no_grad(), use_fused_ops(True):
        got = conv(odd)
    want = torch.nn.Conv2d.forward(conv, odd)
    assert got.shape == want.shape and relative_error(got, want) <= 1e-2


@pytest.mark.parametrize("shape", [(5184, 1024), (5184, 16, 64), (1, 7)])
@pytest.mark.parametrize("kind", ["plain", "scaled", "scaled without weight"])
def test_the_fused_rms_norm_matches_hugging_face(shape, kind):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.glm_ocr.modeling_glm_ocr import GlmOcrRMSNorm

    from vitpool.kernels.fused import install_fused_ops
    from vitpool.kernels.rms_norm import rms_norm_kind

    if kind == "plain":
        norm = GlmOcrRMSNorm(shape[-1], eps=1e-5)
    else:
        norm = Gemma4RMSNorm(shape[-1], eps=1e-5, with_scale=kind == "scaled")
    norm = norm.to("cuda", torch.bfloat16)
    assert rms_norm_kind(norm) == kind.split()[0]
    generator = torch.Generator(device="cuda").manual_seed(shape[0])
    with torch.no_grad():
        for weight in norm.parameters():
            weight.normal_(generator=generator)
    install_fused_ops(torch.nn.Sequential(norm))
    x = 3 * torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    with torch.no_grad(), use_fused_ops(True):
        got = norm(x)
    want = type(norm).forward.__vitpool_original__(norm, x)
    assert got.dtype == want.dtype and torch.isfinite(got).all()
    assert relative_error(got, want) <= 1e-2


@pytest.mark.parametrize("rows", [1, 196, 3136])
def test_the_gelu_epilogue_mlp_matches_hugging_face(monkeypatch, rows):
    encoder = GraphEncoder.from_pretrained(None, budgets=[16], device="cuda")
    mlp = next(m for m in encoder.adapter.tower.modules() if gelu_mlp_layout(m) is not None)
    epilogues = []
    addmm_activation = torch._addmm_activation
    monkeypatch.setattr(
        torch, "_addmm_activation", lambda *a, **k: epilogues.append(1) or addmm_activation(*a, **k)
    )
    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(
        rows, mlp.linear_fc1.in_features, device="cuda", dtype=torch.bfloat16, generator=generator
    )
    with torch.no_grad(), use_fused_ops(True):
        got = mlp(x)
    assert epilogues  # the epilogue path ran
    want = type(mlp).forward.__vitpool_original__(mlp, x)
    assert torch.isfinite(got).all() and relative_error(got, want) <= 1e-2


# the families whose case offers a tower-only checkpoint, what these tests load
@pytest.mark.parametrize("family", TOWER_FAMILIES)
def test_every_family_runs_the_fused_rotary(monkeypatch, tmp_path, family):
    """Each family's tower reaches the Triton kernel (Kimi-K2.5's 4-D q and k and MiniMax-M3-VL's
    partial rotary included; a case whose rotary it does not take sets FUSED_ROTARY = False), and a
    tower of tanh-GELU MLPs (its case's TANH_GELU_MLP) has the GELU in the GEMM's epilogue."""
    from vitpool.kernels import rotary as fused

    calls, epilogues = [], []
    original = fused.fused_rotary
    monkeypatch.setattr(fused, "fused_rotary", lambda *args: calls.append(1) or original(*args))
    addmm_activation = torch._addmm_activation
    monkeypatch.setattr(
        torch, "_addmm_activation", lambda *a, **k: epilogues.append(1) or addmm_activation(*a, **k)
    )
    # compiled blocks run the rotary as inductor fuses it, so they are off here
    encoder = GraphEncoder.from_pretrained(
        save_tiny_tower(family, tmp_path / family), budgets=[64], device="cuda", compiled_blocks=False
    )
    # captured with the fused kernel, unless its case says the kernel does not take its rotary
    assert bool(calls) == getattr(case_module(family), "FUSED_ROTARY", True), family
    with_tanh_gelu_mlps = any(gelu_mlp_layout(m) is not None for m in encoder.adapter.tower.modules())
    assert with_tanh_gelu_mlps == getattr(case_module(family), "TANH_GELU_MLP", False), family
    if with_tanh_gelu_mlps:
        assert epilogues, family  # and with the GELU in the GEMM's epilogue
    assert all(torch.isfinite(e.tokens).all() for e in encoder.encode(mixed_items(family, seed=3)))


@pytest.mark.parametrize("family", TOWER_FAMILIES)
def test_every_familys_blocks_compile_and_agree_with_the_uncompiled_encoder(tmp_path, family):
    """Each family's repeated blocks run compiled (none falls back to eager), inside its graphs,
    and give what the same weights give without the compile (bf16: different roundings)."""
    from vitpool.kernels import compiled

    path = save_tiny_tower(family, tmp_path / family)
    plain = GraphEncoder.from_pretrained(path, budgets=[64], device="cuda")
    fast = GraphEncoder.from_pretrained(path, budgets=[64], device="cuda", compiled_blocks=True)
    classes = {type(stack[0]) for stack in compiled.repeated_block_stacks(fast.adapter.tower)}
    assert classes and classes <= compiled._WORKING, family
    assert not classes & compiled._FAILED, family
    assert fast.stats().disabled_budgets == [], family
    items = mixed_items(family, seed=3)
    for got, want in zip(fast.encode(items), plain.encode(items), strict=True):
        assert torch.isfinite(got.tokens).all(), family
        assert relative_error(got.tokens, want.tokens) <= 1.5e-2, family


def test_fused_and_unfused_encoders_agree():
    fused = GraphEncoder.from_pretrained(None, budgets=[64, 256], device="cuda")
    plain = GraphEncoder.from_pretrained(None, budgets=[64, 256], device="cuda", fused_ops=False)
    assert fused.stats().disabled_budgets == [] and plain.stats().disabled_budgets == []
    generator = torch.Generator().manual_seed(4)
    items = [image(10, 12, generator), video(2, 8, 8, generator), image(40, 40, generator)]  # the last: eager
    for got, want in zip(fused.encode(items), plain.encode(items), strict=True):
        assert torch.isfinite(got.tokens).all()
        assert relative_error(got.tokens, want.tokens) <= 1e-2
    modeling = sys.modules[type(fused.adapter.tower).__module__]
    assert getattr(modeling, ROTARY_FUNCTION).__vitpool_original__ is not None
