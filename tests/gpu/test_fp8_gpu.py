"""GPU: the opt-in FP8 GEMMs. The Triton row quantization against torch's, the FP8 Linear against
bf16, and every family's FP8 encoder (the families whose case offers a tower-only checkpoint:
`family_tiny.TOWER_FAMILIES`): each budget captured and checked against the eager FP8 forward at
capture, its tokens finite and near the bf16 tower's. Skipped without a GPU of
compute capability 8.9 or newer."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import relative_error
from family_tiny import TOWER_FAMILIES, mixed_items, reference_tokens, save_tiny_tower, use_sdpa

from vitpool import GraphEncoder
from vitpool.kernels import fp8
from vitpool.kernels.fp8 import (
    FP8_MAX,
    fp8_gelu_mlp,
    fp8_linear,
    fp8_supported,
    gelu_tanh_rows,
    install_fp8_linears,
    layer_norm_rows,
    quantize_rows,
    use_fp8,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not fp8_supported(torch.device("cuda")),
        reason="needs FP8 tensor cores",
    ),
]
BUDGETS = [16, 64, 256]
# FP8 (e4m3: 3 mantissa bits) in every block's GEMMs of a tiny random tower, against the bf16 tower
FP8_TOLERANCE = 0.12


@pytest.mark.parametrize("rows, width", [(1, 64), (333, 1152), (4096, 4304), (7, 8192)])
def test_the_triton_row_quantization_matches_torch(rows, width):
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) * 3
    quantized, scale = quantize_rows(x)
    want_scale = x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    want = (x.float() / want_scale).clamp(-FP8_MAX, FP8_MAX).to(quantized.dtype)
    # the same fp32 quotient, rounded to e4m3 by Triton and by torch: at most one step apart
    assert (quantized.float() - want.float()).abs().max() <= 32
    assert (quantized.float() == want.float()).float().mean() >= 0.999


def _assert_same_fp8_rows(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """FP8 rows and scales of one computation done two ways: scales equal to float rounding, the
    FP8 values at most one e4m3 step apart and nearly all identical."""
    (quantized, scale), (want_quantized, want_scale) = got, want
    torch.testing.assert_close(scale, want_scale, rtol=1e-5, atol=0)
    assert (quantized.float() - want_quantized.float()).abs().max() <= 32
    assert (quantized.float() == want_quantized.float()).float().mean() >= 0.995


@pytest.mark.parametrize("rows, width, bias", [(1, 1152, True), (333, 1152, False), (4096, 1024, True)])
def test_the_fused_layer_norm_writes_its_output_and_the_same_fp8_rows_as_quantizing_it(rows, width, bias):
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
    norm = torch.nn.LayerNorm(width, bias=bias, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    if bias:
        torch.nn.init.normal_(norm.bias, 0.0, 0.3)
    with torch.no_grad():
        out, quantized, scale = layer_norm_rows(x, norm.weight, norm.bias, norm.eps)
        want = norm(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1.6e-2)  # bf16 rounding of the same fp32 norm
    _assert_same_fp8_rows((quantized, scale), quantize_rows(out))


@pytest.mark.parametrize("rows, width", [(1, 4304), (700, 4304), (64, 1024)])
def test_the_fused_gelu_writes_the_fp8_rows_of_torchs_tanh_gelu(rows, width):
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) * 3
    want = torch.nn.functional.gelu(x, approximate="tanh")
    quantized, scale = gelu_tanh_rows(x)
    assert torch.isfinite(scale).all()
    _assert_same_fp8_rows((quantized, scale), quantize_rows(want))


@torch.no_grad()
def test_a_linear_after_a_layer_norm_takes_the_rows_the_norm_wrote_unless_they_changed(monkeypatch):
    blocks = torch.nn.ModuleList(
        [torch.nn.Sequential(torch.nn.LayerNorm(1152), torch.nn.Linear(1152, 3456)) for _ in range(2)]
    ).to("cuda", torch.bfloat16)
    install_fp8_linears(blocks)
    x = torch.randn(500, 1152, device="cuda", dtype=torch.bfloat16)
    quantized_now = []
    original = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda rows: quantized_now.append(rows.shape) or original(rows))
    norm, linear = blocks[0]
    with use_fp8(True):
        normed = norm(x)
        got = linear(normed)
    assert quantized_now == []  # the norm's own FP8 rows were used
    weight, weight_scale, _ = linear.__dict__["_vitpool_fp8_weight"]
    with use_fp8(False):
        plain = norm(x)
    assert torch.equal(plain, torch.nn.functional.layer_norm(x, (1152,), norm.weight, norm.bias, norm.eps))
    rows, row_scale = quantize_rows(normed)
    unfused = torch._scaled_mm(
        rows, weight.t(), scale_a=row_scale, scale_b=weight_scale, bias=linear.bias, out_dtype=torch.bfloat16
    )
    assert torch.isfinite(got).all() and relative_error(got, unfused) <= 1e-2
    assert relative_error(got, torch.nn.functional.linear(plain, linear.weight, linear.bias)) <= 0.05
    with use_fp8(True):
        normed.mul_(2)  # changed after the norm wrote its rows: they are stale, quantized anew
        doubled = linear(normed)
    assert quantized_now == [(500, 1152)]
    assert relative_error(doubled, torch.nn.functional.linear(normed, linear.weight, linear.bias)) <= 0.05


@torch.no_grad()
def test_the_fp8_gelu_mlp_is_near_the_bf16_one_and_declines_where_a_linear_is_not_fp8():
    mlps = torch.nn.ModuleList(
        [
            torch.nn.ModuleDict({"fc1": torch.nn.Linear(1152, 4304), "fc2": torch.nn.Linear(4304, 1152)})
            for _ in range(2)
        ]
    ).to("cuda", torch.bfloat16)
    install_fp8_linears(mlps)
    first, second = mlps[0]["fc1"], mlps[0]["fc2"]
    x = torch.randn(2, 300, 1152, device="cuda", dtype=torch.bfloat16)
    want = second(torch.nn.functional.gelu(first(x), approximate="tanh"))
    with use_fp8(True):
        got = fp8_gelu_mlp(first, second, x)
    assert got.shape == want.shape and torch.isfinite(got).all() and relative_error(got, want) <= 0.06
    assert fp8_gelu_mlp(first, second, x) is None  # outside use_fp8
    del second.__dict__["_vitpool_fp8_weight"]
    with use_fp8(True):
        assert fp8_gelu_mlp(first, second, x) is None


@torch.no_grad()
def test_the_fp8_linear_is_near_the_bf16_one():
    blocks = torch.nn.ModuleList([torch.nn.Linear(1152, 4304) for _ in range(2)]).to("cuda", torch.bfloat16)
    install_fp8_linears(blocks)
    x = torch.randn(3, 600, 1152, device="cuda", dtype=torch.bfloat16)
    calls = []
    scaled_mm = torch._scaled_mm
    torch._scaled_mm = lambda *a, **k: calls.append(1) or scaled_mm(*a, **k)
    try:
        with use_fp8(True):
            got = blocks[0](x)
    finally:
        torch._scaled_mm = scaled_mm
    assert calls and got.dtype == torch.bfloat16 and got.shape == (3, 600, 4304)
    assert (
        torch.isfinite(got).all()
        and relative_error(got, torch.nn.functional.linear(x, blocks[0].weight, blocks[0].bias)) <= 0.05
    )
    with use_fp8(False):
        assert torch.equal(blocks[0](x), torch.nn.functional.linear(x, blocks[0].weight, blocks[0].bias))
    weight, weight_scale, _ = blocks[0].__dict__["_vitpool_fp8_weight"]
    assert relative_error(got, fp8_linear(x, weight, weight_scale, blocks[0].bias)) == 0


@pytest.mark.parametrize("family", TOWER_FAMILIES)
def test_every_familys_fp8_encoder_is_checked_at_capture_and_near_bf16(tmp_path, family, monkeypatch):
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or scaled_mm(*a, **k))
    encoder = GraphEncoder.from_pretrained(
        save_tiny_tower(family, tmp_path), budgets=BUDGETS, device="cuda", precision="fp8"
    )
    stats = encoder.stats()
    # a graph whose replay differed from the eager FP8 forward would be disabled
    assert (
        sorted({tokens for tokens, _ in stats.captured_budgets}) == BUDGETS and stats.disabled_budgets == []
    )
    assert calls  # the FP8 GEMMs ran at capture
    module = use_sdpa(copy.deepcopy(encoder.adapter.tower))
    items = mixed_items(family, seed=1)
    errors = []
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        want = reference_tokens(family, module, item, encoder.device, encoder.dtype)
        assert torch.isfinite(embedding.tokens).all()
        errors.append(relative_error(embedding.tokens, want))
    assert max(errors) <= FP8_TOLERANCE, errors
    # the bf16 encoder on the same adapter is untouched by the FP8 one
    bf16 = GraphEncoder(encoder.adapter, budgets=BUDGETS, device="cuda")
    calls.clear()
    for item, embedding in zip(items, bf16.encode(items), strict=True):
        want = reference_tokens(family, module, item, bf16.device, bf16.dtype)
        assert relative_error(embedding.tokens, want) <= 1.5e-2
    assert not calls
    print(f"{family}: fp8 vs HF bf16 relative error max {max(errors):.3e}")
