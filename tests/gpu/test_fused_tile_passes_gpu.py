"""GPU: the passes fused for the tiled and CLIP towers against Hugging Face's own code (bf16): the
quick GELU in one pass, the rotary of a batch of tiles against one table (Step-3.7), Llama 4's
interleaved complex rotary; and each patched function reached through the towers' own modules."""

from __future__ import annotations

import pytest
import torch
from conftest import relative_error

from vitpool.kernels.fused import install_fused_ops, use_fused_ops
from vitpool.kernels.rotary import INTERLEAVED_ROTARY_FUNCTION, ROTARY_FUNCTION

pytestmark = pytest.mark.gpu


def _original(function):
    return getattr(function, "__vitpool_original__", function)


def _at_most_one_ulp_apart(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same fp32 math with one bf16 rounding at the end against Hugging Face's roundings."""
    return bool((got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-6)


@pytest.mark.parametrize("shape", [(4096, 4304), (7, 33), (3, 577, 5632)])
def test_the_quick_gelu_pass_matches_hugging_face(shape):
    from transformers.activations import QuickGELUActivation

    from vitpool.kernels import quick_gelu

    generator = torch.Generator(device="cuda").manual_seed(shape[-1])
    x = 3 * torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    module = QuickGELUActivation()
    install_fused_ops(module)
    calls = []
    fused = quick_gelu.fused_quick_gelu
    quick_gelu.fused_quick_gelu = lambda t: calls.append(1) or fused(t)
    try:
        with use_fused_ops(True):
            got = module(x)
    finally:
        quick_gelu.fused_quick_gelu = fused
    want = _original(QuickGELUActivation.forward)(module, x.float()).to(torch.bfloat16)
    assert calls and got.dtype == torch.bfloat16 and got.shape == x.shape
    assert torch.isfinite(got).all()
    assert relative_error(got, want) <= 1e-2 and _at_most_one_ulp_apart(got, want)
    with use_fused_ops(False):  # off: Hugging Face's own three passes
        assert torch.equal(module(x), _original(QuickGELUActivation.forward)(module, x))


TILE_SHAPES = [(7, 2704, 16, 64), (1, 196, 16, 72), (3, 50, 2, 16)]


@pytest.mark.parametrize("tiles, rows, heads, head_dim", TILE_SHAPES)
def test_the_rotary_of_a_batch_of_tiles_against_one_table_matches_hugging_face(tiles, rows, heads, head_dim):
    """Step-3.7's tiles: q, k [tiles, rows, heads, head_dim] against cos, sin [rows, head_dim]."""
    from transformers.models.step3p7 import modeling_step3p7

    generator = torch.Generator(device="cuda").manual_seed(rows)
    shape = (tiles, rows, 3, heads, head_dim)
    qkv = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    angles = torch.randn(rows, head_dim // 2, device="cuda", generator=generator)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    install_fused_ops(modeling_step3p7.Step3p7VisionAttention(_step_config(heads, head_dim)))
    patched = getattr(modeling_step3p7, ROTARY_FUNCTION)
    assert patched is not _original(patched)
    with use_fused_ops(True):
        got_q, got_k = patched(q, k, cos, sin)
    want_q, want_k = _original(patched)(q, k, cos, sin)
    assert got_q.shape == want_q.shape == q.shape and got_q.dtype == torch.bfloat16
    assert torch.isfinite(got_q).all() and torch.isfinite(got_k).all()
    assert _at_most_one_ulp_apart(got_q, want_q) and _at_most_one_ulp_apart(got_k, want_k)
    assert relative_error(got_q, want_q) <= 1e-3 and relative_error(got_k, want_k) <= 1e-3


def _step_config(heads: int, head_dim: int):
    from transformers.models.step3p7.configuration_step3p7 import Step3p7VisionConfig

    return Step3p7VisionConfig(hidden_size=heads * head_dim, num_attention_heads=heads)


@pytest.mark.parametrize("views", [7, 1])
def test_llama4s_interleaved_rotary_matches_hugging_face(views):
    from transformers.models.llama4 import modeling_llama4
    from transformers.models.llama4.configuration_llama4 import Llama4VisionConfig

    config = Llama4VisionConfig(hidden_size=1408, num_attention_heads=16, image_size=336, patch_size=14)
    table = modeling_llama4.Llama4VisionRotaryEmbedding(config).freqs_ci.to("cuda")  # [577, 1, 44]
    rows, head_dim = table.shape[0], 1408 // 16
    generator = torch.Generator(device="cuda").manual_seed(views)
    q = torch.randn(views, rows, 16, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    k = torch.randn(views, rows, 16, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    install_fused_ops(modeling_llama4.Llama4VisionAttention(config))
    patched = getattr(modeling_llama4, INTERLEAVED_ROTARY_FUNCTION)
    assert patched is not _original(patched)
    with use_fused_ops(True):
        got_q, got_k = patched(q, k, table)
    want_q, want_k = _original(patched)(q, k, table)
    assert got_q.shape == want_q.shape == q.shape and got_k.dtype == torch.bfloat16
    assert torch.isfinite(got_q).all() and torch.isfinite(got_k).all()
    assert _at_most_one_ulp_apart(got_q, want_q) and _at_most_one_ulp_apart(got_k, want_k)
    assert relative_error(got_q, want_q) <= 1e-3 and relative_error(got_k, want_k) <= 1e-3


@pytest.mark.parametrize("family", ["internvl", "step3p7"])
def test_the_layer_scaled_blocks_match_hugging_face(family):
    if family == "internvl":
        from transformers.models.internvl.configuration_internvl import InternVLVisionConfig as Config
        from transformers.models.internvl.modeling_internvl import InternVLVisionLayer as Layer
    else:
        from transformers.models.step3p7.configuration_step3p7 import Step3p7VisionConfig as Config
        from transformers.models.step3p7.modeling_step3p7 import Step3p7VisionEncoderLayer as Layer
    torch.manual_seed(0)
    layer = Layer(Config(hidden_size=256, num_attention_heads=4, intermediate_size=1024)).to(
        "cuda", torch.bfloat16
    )
    layer.eval()
    with torch.no_grad():
        layer.lambda_1.normal_()  # not the init's constant: a wrong channel order would show
        layer.lambda_2.normal_()
    install_fused_ops(layer)
    x = torch.randn(3, 64, 256, device="cuda", dtype=torch.bfloat16)
    kwargs = {}
    if family == "step3p7":
        angles = torch.randn(64, 32, device="cuda")
        kwargs["position_embeddings"] = (
            torch.cat([angles, angles], -1).cos(),
            torch.cat([angles, angles], -1).sin(),
        )
    calls = []
    addcmul = torch.addcmul
    torch.addcmul = lambda *a, **k: calls.append(1) or addcmul(*a, **k)
    try:
        with torch.no_grad(), use_fused_ops(True):
            got = layer(x, **kwargs)
    finally:
        torch.addcmul = addcmul
    with torch.no_grad():
        want = _original(Layer.forward)(layer, x, **kwargs)
    assert len(calls) == 2 and got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all() and relative_error(got, want) <= 1e-2


@pytest.mark.parametrize("rows, heads, head_dim, width", [(1369, 16, 80, 60), (50, 2, 16, 12)])
def test_minimax_m3_vls_partial_rotary_matches_hugging_face(rows, heads, head_dim, width):
    """The first `width` dims of each head turned from bf16 tables, the rest passed through."""
    modeling = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    from vitpool.kernels.fused_switch import source_body
    from vitpool.kernels.rotary import PARTIAL_ROTARY_BODY, _patch_rotary

    if source_body(getattr(modeling, ROTARY_FUNCTION)) != PARTIAL_ROTARY_BODY:
        pytest.skip("this transformers' MiniMax-M3-VL rotary is another function")
    _patch_rotary(modeling)
    patched = getattr(modeling, ROTARY_FUNCTION)
    generator = torch.Generator(device="cuda").manual_seed(rows)
    qkv = torch.randn(rows, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    q, k = qkv[:, 0], qkv[:, 1]
    angles = torch.cat([torch.randn(rows, width // 2, device="cuda", generator=generator)] * 2, -1)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    with use_fused_ops(True):
        got_q, got_k = patched(q, k, cos, sin)
    want_q, want_k = _original(patched)(q, k, cos, sin)
    assert got_q.shape == want_q.shape and torch.isfinite(got_q).all() and torch.isfinite(got_k).all()
    assert torch.equal(got_q[..., width:], q[..., width:]) and torch.equal(got_k[..., width:], k[..., width:])
    # Hugging Face's math is bf16 throughout, the kernel's fp32 with one rounding
    assert _at_most_one_ulp_apart(got_q, want_q) and _at_most_one_ulp_apart(got_k, want_k)
    assert relative_error(got_q, want_q) <= 1e-2 and relative_error(got_k, want_k) <= 1e-2
