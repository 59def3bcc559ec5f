"""DeepSeek-OCR-2's fused path (`vitpool.families.deepseek_ocr2.tower`: `rms_norm`, `masked_attention`,
`fused_sam_attention`, `fused_encoder_layer`), taken only under `use_fused_ops(True)` on CUDA in
half precision. On the CPU each piece runs in fp32 against the reference it replaces (the Triton
rotary by its math in torch); the `gpu` tests run the kernel and the whole fused tower in bf16
against Hugging Face's in fp32. The tiny random model is family_cases/deepseek_ocr2.py's."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import relative_error
from family_cases import deepseek_ocr2 as case

from vitpool.families.deepseek_ocr2 import tower as deepseek_ocr2
from vitpool.kernels.fused import use_fused_ops

TOLERANCE = 1e-5  # fp32 against the reference path
GPU_TOLERANCE = 1.5e-2  # bf16 against Hugging Face's own path in fp32


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=5)


def encoder_module(model) -> deepseek_ocr2.DeepseekOcr2Encoder:
    return deepseek_ocr2.DeepseekOcr2Encoder(
        copy.deepcopy(model.model.vision_tower),
        copy.deepcopy(model.model.multi_modal_projector),
        model.model.view_separator,
        case.LOCAL_SIZE,
    )


def rotary_in_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`fused_rotary`'s contract in plain torch: row r of x [rows, heads, d] takes table row
    r % len(cos), rotate-half in fp32, cast back."""
    repeats = x.shape[0] // cos.shape[0]
    cos, sin = cos.repeat(repeats, 1)[:, None], sin.repeat(repeats, 1)[:, None]
    return deepseek_ocr2.rotate(x.float(), cos, sin).to(x.dtype)


def test_rms_norm_is_the_encoders_rms_norm():
    from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2VisionRMSNorm

    generator = torch.Generator().manual_seed(0)
    norm = DeepseekOcr2VisionRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(96, generator=generator))
    hidden = 3 * torch.randn(2, 40, 96, generator=generator)
    with torch.no_grad():
        want = norm(hidden)
        assert relative_error(deepseek_ocr2.rms_norm(norm, hidden), want) <= 1e-6
        # in bf16 the weight multiplies before the one rounding: within a bf16 unit in the last place
        norm, hidden = norm.to(torch.bfloat16), hidden.to(torch.bfloat16)
        got, want = deepseek_ocr2.rms_norm(norm, hidden).float(), norm(hidden).float()
    assert ((got - want).abs() <= want.abs() * 2**-7 + 1e-6).all()


@pytest.mark.parametrize("batch, num_patches, num_queries", [(1, 16, 16), (3, 12, 7)])
def test_masked_attention_is_the_reference_attention(batch, num_patches, num_queries):
    generator = torch.Generator().manual_seed(num_patches)
    length, heads, kv_heads, dim = num_patches + num_queries, 4, 2, 16
    query = torch.randn(batch, length, heads, dim, generator=generator)
    key, value = (torch.randn(batch, length, kv_heads, dim, generator=generator) for _ in range(2))
    mask = deepseek_ocr2.encoder_mask(num_patches, num_queries)
    repeated = [deepseek_ocr2.repeat_heads(t.transpose(1, 2), heads) for t in (key, value)]
    want = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), *repeated, attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    bias = deepseek_ocr2.attention_bias(mask, query.dtype)
    got = deepseek_ocr2.masked_attention(query, key, value, bias, 0.3)
    assert got.shape == (batch, length, heads, dim)
    assert relative_error(got, want) <= TOLERANCE


def test_fused_sam_attention_is_sam_attention(model):
    module = encoder_module(model)
    sam = module.vision_tower.sam_encoder
    generator = torch.Generator().manual_seed(1)
    for layer in sam.layers:  # a windowed layer (14², its table padded) and a global one (64²)
        size = layer.window_size or module.grids[deepseek_ocr2.GLOBAL]
        hidden = torch.randn(2, size, size, sam.config.hidden_size, generator=generator)
        args = (layer.attn, hidden, module.rel_index(size), module.key_positions(size))
        want = deepseek_ocr2.sam_attention(*args)
        assert relative_error(deepseek_ocr2.fused_sam_attention(*args), want) <= TOLERANCE


@pytest.mark.parametrize("path", [deepseek_ocr2.GLOBAL, deepseek_ocr2.LOCAL])
def test_the_fused_tower_is_the_reference_tower(model, monkeypatch, path):
    """The whole fused path in fp32 on the CPU (the guard and the Triton kernel stood in for):
    what the tower gives through it is what the reference path gives."""
    module = encoder_module(model)
    size = module.tile_sizes[path]
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = deepseek_ocr2.tile_features(module, path, pixels)
        calls = []
        monkeypatch.setattr(deepseek_ocr2, "fused_ops_apply", lambda x: True)
        monkeypatch.setattr(deepseek_ocr2, "triton_available", lambda: True)
        monkeypatch.setattr(deepseek_ocr2, "fused_rotary", lambda *a: calls.append(1) or rotary_in_torch(*a))
        got = deepseek_ocr2.tile_features(module, path, pixels)
    assert len(calls) == 2 * module.vision_tower.vision_encoder.config.num_hidden_layers
    assert relative_error(got, want) <= TOLERANCE


def test_off_cuda_the_reference_path_runs(model, monkeypatch):
    module = encoder_module(model)
    calls = []
    for name in ("fused_encoder_layer", "fused_sam_attention", "rms_norm"):
        monkeypatch.setattr(deepseek_ocr2, name, lambda *a, name=name: calls.append(name))
    pixels = torch.randn(1, 3, case.LOCAL_SIZE, case.LOCAL_SIZE)
    with torch.no_grad(), use_fused_ops(True):
        deepseek_ocr2.tile_features(module, deepseek_ocr2.LOCAL, pixels)
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("batch, length, heads", [(1, 512, 14), (3, 288, 2), (8, 512, 14)])
def test_the_rotary_kernel_takes_one_table_for_every_tile(batch, length, heads):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from vitpool.kernels.fused import fused_rotary

    generator = torch.Generator(device="cuda").manual_seed(length)
    x = torch.randn(batch * length, heads, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
    angles = torch.randn(length, 32, device="cuda", generator=generator)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    got = fused_rotary(x, cos, sin)
    assert torch.equal(got, fused_rotary(x, cos.repeat(batch, 1), sin.repeat(batch, 1)))
    want = rotary_in_torch(x, cos, sin).float()
    assert (got.float() - want).abs().max() <= want.abs().max() * 2**-7


@pytest.mark.gpu
@pytest.mark.parametrize("path", [deepseek_ocr2.GLOBAL, deepseek_ocr2.LOCAL])
def test_the_fused_tower_on_cuda_matches_hugging_face(model, monkeypatch, path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    module = encoder_module(model).to("cuda")
    for parameter in module.parameters():  # as the encoder places a tower: buffers stay fp32
        parameter.data = parameter.data.to(torch.bfloat16)
    calls = []
    for name in ("fused_encoder_layer", "fused_sam_attention", "masked_attention"):
        original = getattr(deepseek_ocr2, name)
        monkeypatch.setattr(
            deepseek_ocr2, name, lambda *a, name=name, original=original: calls.append(name) or original(*a)
        )
    size = module.tile_sizes[path]
    pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(3)).cuda()
    reference = copy.deepcopy(model.model.vision_tower).to("cuda", torch.float32)
    with torch.no_grad():
        want = reference(pixels).last_hidden_state
        with use_fused_ops(True):
            got = deepseek_ocr2.tile_features(module, path, pixels.to(torch.bfloat16))
        plain = deepseek_ocr2.tile_features(module, path, pixels.to(torch.bfloat16))
    assert {"fused_encoder_layer", "fused_sam_attention", "masked_attention"} <= set(calls)
    assert torch.isfinite(got).all()
    assert relative_error(got, want) <= GPU_TOLERANCE
    assert relative_error(got, plain) <= GPU_TOLERANCE
