"""The fused rotary, patch embedding, GELU-epilogue MLP and RMSNorm are installed in every family's
modeling code through the shared attention hook, and stay out of the way off the GPU (the kernels
themselves: tests/gpu)."""

from __future__ import annotations

import pickle
import sys

import torch

from vitpool import GraphEncoder
from vitpool.kernels.fused import install_fused_ops, use_fused_ops
from vitpool.kernels.gelu_mlp import GELU_MLP_LAYOUT, gelu_mlp_layout
from vitpool.kernels.patch_gemm import _is_patch_conv
from vitpool.kernels.rotary import ROTARY_FUNCTION


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


def test_tanh_gelu_mlps_take_the_epilogue_forward_and_keep_their_cpu_result():
    encoder = GraphEncoder.from_pretrained(None, budgets=[16], device="cpu")
    tower = encoder.adapter.tower
    mlps = [m for m in tower.modules() if gelu_mlp_layout(m) is not None]
    assert len(mlps) == tower.config.depth  # the blocks' MLPs; the mergers' erf GELU is not tanh
    assert all(vars(mlp)[GELU_MLP_LAYOUT] == ("linear_fc1", "act_fn", "linear_fc2") for mlp in mlps)
    mlp = mlps[0]
    original = type(mlp).forward.__vitpool_original__  # the class's forward, wrapped once
    assert getattr(original, "__vitpool_original__", None) is None
    x = torch.randn(7, mlp.linear_fc1.in_features)
    with use_fused_ops(True):  # CPU tensors: Hugging Face's own math, bit for bit
        assert torch.equal(mlp(x), original(mlp, x))


class _Mlp(torch.nn.Module):
    def __init__(self, activation: torch.nn.Module, bias: bool = True, extra: bool = False) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(4, 8, bias=bias), activation, torch.nn.Linear(8, 4)
        if extra:
            self.dropout = torch.nn.Dropout(0.1)


def test_only_linear_tanh_gelu_linear_mlps_qualify():
    from transformers.activations import ACT2FN

    assert gelu_mlp_layout(_Mlp(torch.nn.GELU(approximate="tanh"))) == ("fc1", "act", "fc2")
    assert gelu_mlp_layout(_Mlp(ACT2FN["gelu_pytorch_tanh"])) is not None
    assert gelu_mlp_layout(_Mlp(ACT2FN["gelu_new"])) is not None
    assert gelu_mlp_layout(_Mlp(torch.nn.GELU())) is None  # erf GELU: not cuBLASLt's epilogue
    assert gelu_mlp_layout(_Mlp(ACT2FN["quick_gelu"])) is None
    assert gelu_mlp_layout(_Mlp(torch.nn.GELU(approximate="tanh"), bias=False)) is None
    assert (
        gelu_mlp_layout(_Mlp(torch.nn.GELU(approximate="tanh"), extra=True)) is None
    )  # may take part in forward


def test_only_hugging_faces_plain_and_gemma_4s_rms_norms_take_the_fused_forward():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.glm_ocr.modeling_glm_ocr import GlmOcrRMSNorm
    from transformers.models.pixtral.modeling_pixtral import PixtralRMSNorm
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    from vitpool.kernels.rms_norm import rms_norm_kind

    for plain in (GlmOcrRMSNorm, PixtralRMSNorm, Qwen2_5_VLRMSNorm):
        assert rms_norm_kind(plain(8)) == "plain", plain
    # Gemma 3's scales by 1 + weight: another forward, left as it is; Gemma 4's is fused as "scaled"
    assert rms_norm_kind(Gemma3RMSNorm(8)) is None
    assert rms_norm_kind(Gemma4RMSNorm(8)) == rms_norm_kind(Gemma4RMSNorm(8, with_scale=False)) == "scaled"
    assert rms_norm_kind(torch.nn.LayerNorm(8)) is None


def test_a_fused_rms_norm_keeps_its_cpu_result_and_still_pickles():
    from transformers.models.glm_ocr.modeling_glm_ocr import GlmOcrRMSNorm

    norm = GlmOcrRMSNorm(16)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(5, 16)
    want = norm(x)
    install_fused_ops(torch.nn.Sequential(norm))
    assert getattr(type(norm).forward, "__vitpool_original__", None) is not None
    with use_fused_ops(True):
        assert torch.equal(norm(x), want)  # the fused kernel runs on CUDA half precision only
    assert torch.equal(pickle.loads(pickle.dumps(norm))(x), want)


def test_llama4s_interleaved_rotary_and_the_quick_gelu_are_wrapped_once_and_keep_their_cpu_result():
    from transformers.activations import QuickGELUActivation
    from transformers.models.llama4 import modeling_llama4
    from transformers.models.llama4.configuration_llama4 import Llama4VisionConfig

    from vitpool.kernels.rotary import INTERLEAVED_ROTARY_FUNCTION

    config = Llama4VisionConfig(hidden_size=64, num_attention_heads=4, image_size=56, patch_size=14)
    activation = QuickGELUActivation()
    for _ in range(2):
        install_fused_ops(torch.nn.ModuleList([modeling_llama4.Llama4VisionAttention(config), activation]))
    wrapped = getattr(modeling_llama4, INTERLEAVED_ROTARY_FUNCTION)
    original = wrapped.__vitpool_original__
    assert getattr(original, "__vitpool_original__", None) is None  # wrapped once
    gelu = QuickGELUActivation.forward
    assert getattr(gelu.__vitpool_original__, "__vitpool_original__", None) is None
    table = modeling_llama4.Llama4VisionRotaryEmbedding(config).freqs_ci  # [17, 1, 8]
    q, k = torch.randn(3, 17, 4, 16), torch.randn(3, 17, 4, 16)
    x = torch.randn(5, 40)
    with use_fused_ops(True):  # CPU tensors: Hugging Face's own math, bit for bit
        got, got_gelu = wrapped(q, k, table), activation(x)
    assert all(torch.equal(g, w) for g, w in zip(got, original(q, k, table)))
    assert torch.equal(got_gelu, gelu.__vitpool_original__(activation, x))


def test_internvls_and_step3p7s_layer_scaled_blocks_take_the_fused_forward_and_keep_their_cpu_result():
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig
    from transformers.models.internvl.modeling_internvl import InternVLVisionLayer
    from transformers.models.step3p7.configuration_step3p7 import Step3p7VisionConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7VisionEncoderLayer

    from vitpool.kernels.layer_scale import layer_scale_forward

    assert layer_scale_forward(InternVLVisionLayer) is not None
    assert layer_scale_forward(Step3p7VisionEncoderLayer) is not None
    assert layer_scale_forward(torch.nn.TransformerEncoderLayer) is None  # another forward: its own
    internvl = InternVLVisionLayer(
        InternVLVisionConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64)
    )
    internvl.eval()
    x = torch.randn(2, 5, 32)
    want = internvl(x)
    install_fused_ops(internvl)
    assert InternVLVisionLayer.forward.__vitpool_original__ is not None
    with use_fused_ops(True):  # CPU tensors: Hugging Face's own forward, bit for bit
        assert torch.equal(internvl(x), want)
    step = Step3p7VisionEncoderLayer(
        Step3p7VisionConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64)
    )
    install_fused_ops(step)
    assert Step3p7VisionEncoderLayer.forward.__vitpool_original__ is not None
