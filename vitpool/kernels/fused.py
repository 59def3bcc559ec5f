"""Fused work in the Hugging Face towers on a GPU, installed through shared code for every family.

One module per fusion, each saying what it replaces and why:

- `rotary`: the rotary position embedding as one Triton kernel per tensor;
- `patch_gemm`: a patch convolution (kernel == stride) as a GEMM, a whole image's returned
  channels-last;
- `gelu_mlp`: a two-layer tanh-GELU MLP with the first bias and the GELU in the GEMM's epilogue;
- `quick_gelu`: Hugging Face's quick GELU (Qwen2-VL, Step-3.7, CLIP) in one pass instead of three;
- `layer_scale`: InternVL's and Step-3.7's layer-scaled residual adds in one kernel instead of two;
- `rms_norm`: Hugging Face's plain RMSNorm and Gemma 4's as torch's one-kernel `rms_norm`.

The figures behind them (`benchmarks/studies/kernel_breakdown.py`, `gemm_shapes.py` and
`family_profile.py`): `benchmarks/HISTORY.md`, "FlashAttention-4 and fused ops" and "GELU in the
GEMM epilogue, host work per call, and what bounds the rest"; `benchmarks/RESULTS.md`, "What moved
the large workloads: three changes, measured before and after in one process each" and "Figures
the code's design rests on".

All take effect only inside `use_fused_ops(True)` and only on CUDA tensors in half precision
(`vitpool.kernels.fused_switch`); anything else runs Hugging Face's own code, so a reference tower
in the same process is untouched and the CPU path stays the exact reference.
"""

from __future__ import annotations

import torch

from vitpool.kernels.fused_switch import fused_ops_apply, triton_available, use_fused_ops
from vitpool.kernels.gelu_mlp import install_gelu_mlp
from vitpool.kernels.layer_scale import install_layer_scale
from vitpool.kernels.patch_gemm import install_patch_gemm
from vitpool.kernels.quick_gelu import install_quick_gelu
from vitpool.kernels.rms_norm import install_rms_norm
from vitpool.kernels.rotary import fused_rotary, install_rotary

__all__ = ["fused_ops_apply", "fused_rotary", "install_fused_ops", "triton_available", "use_fused_ops"]


def install_fused_ops(tower: torch.nn.Module) -> None:
    """Route `tower`'s rotary embedding, patch convolutions, tanh-GELU MLPs, quick GELUs, RMSNorms and
    layer-scaled residuals through the fused versions (in effect only under `use_fused_ops(True)`).
    Installing again is harmless."""
    for module in tower.modules():
        install_rotary(module)
        install_patch_gemm(module)
        install_gelu_mlp(module)
        install_quick_gelu(module)
        install_rms_norm(module)
        install_layer_scale(module)
