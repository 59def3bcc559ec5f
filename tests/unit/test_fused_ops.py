"""The fused rotary and patch embedding are installed in every family's modeling code through the
shared attention hook, and stay out of the way off the GPU (the kernels themselves: tests/gpu)."""

from __future__ import annotations

import sys

import torch

from vitpool import GraphEncoder
from vitpool.models.fused import ROTARY_FUNCTION, _is_patch_conv, use_fused_ops


def test_installing_wraps_the_rotary_function_of_the_towers_modeling_module():
    encoder = GraphEncoder.from_pretrained(None, budgets=[16], device="cpu")
    modeling = sys.modules[type(encoder.adapter.tower).__module__]
    wrapped = getattr(modeling, ROTARY_FUNCTION)
    original = wrapped.__vitpool_original__
    assert original is not None and getattr(original, "__vitpool_original__", None) is None  # wrapped once
    q, k = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    cos, sin = torch.randn(6, 8), torch.randn(6, 8)
    with use_fused_ops(True):  # CPU tensors: Hugging Face's own math, bit for bit
        got = wrapped(q, k, cos, sin)
    want = original(q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_patch_convolution_keeps_its_weights_and_its_cpu_result():
    encoder = GraphEncoder.from_pretrained(None, budgets=[16], device="cpu")
    convs = [m for m in encoder.adapter.tower.modules() if isinstance(m, torch.nn.Conv3d)]
    assert convs and all(_is_patch_conv(conv) for conv in convs)
    conv = convs[0]
    assert "forward" in vars(conv)  # the instance's own forward, its parameters unchanged
    x = torch.randn(5, conv.in_channels, *conv.kernel_size)
    with use_fused_ops(True):
        assert torch.equal(conv(x), torch.nn.Conv3d.forward(conv, x))


def test_a_strided_or_padded_convolution_is_not_a_patch_convolution():
    assert not _is_patch_conv(torch.nn.Conv2d(3, 8, kernel_size=3, stride=1))
    assert not _is_patch_conv(torch.nn.Conv2d(3, 8, kernel_size=2, stride=2, padding=1))
    assert _is_patch_conv(torch.nn.Conv2d(3, 8, kernel_size=14, stride=14))


def test_a_tower_with_fused_ops_installed_still_pickles(tmp_path):
    encoder = GraphEncoder.from_pretrained(None, budgets=[16], device="cpu")
    path = tmp_path / "tower.pt"
    torch.save(encoder.adapter.tower, path)
    loaded = torch.load(path, weights_only=False)
    conv = next(m for m in loaded.modules() if isinstance(m, torch.nn.Conv3d))
    x = torch.randn(2, conv.in_channels, *conv.kernel_size)
    assert torch.equal(conv(x), torch.nn.Conv3d.forward(conv, x))
