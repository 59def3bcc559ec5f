"""A two-layer MLP with a tanh GELU between its Linears, the GELU in the first GEMM's epilogue.

Qwen3-VL, Qwen3.5, Kimi-K2.5 and PaddleOCR-VL run their first Linear's bias and the GELU in
cuBLASLt's GEMM epilogue (`torch._addmm_activation`), so the [rows, intermediate] activation is
written once instead of written, read and written again, which saves that round trip at every
size (`benchmarks/HISTORY.md`, "GELU in the GEMM epilogue, host work per call, and what bounds the
rest"). The GELU is taken on the fp32 accumulator before rounding.
"""

from __future__ import annotations

import functools

import torch

from vitpool.kernels.fp8 import fp8_active, fp8_gelu_mlp
from vitpool.kernels.fused_switch import FUSED_OPS, HALF_DTYPES

# (first Linear, activation, second Linear): the attribute names of the towers' two-layer MLPs whose
# forward is second(activation(first(x))): Qwen3-VL / Qwen3.5, SigLIP-style (PaddleOCR-VL), Kimi-K2.5
MLP_LAYOUTS = (("linear_fc1", "act_fn", "linear_fc2"), ("fc1", "activation_fn", "fc2"), ("fc1", "act", "fc2"))
GELU_MLP_LAYOUT = "_vitpool_gelu_mlp_layout"  # the instance attribute that marks an MLP for the epilogue


def install_gelu_mlp(module: torch.nn.Module) -> None:
    """Mark `module` for the epilogue if it is such an MLP."""
    layout = gelu_mlp_layout(module)
    if layout is not None:
        _patch_gelu_mlp(module, layout)


def gelu_mlp_layout(module: torch.nn.Module) -> tuple[str, str, str] | None:
    """The layout of `module` if it is exactly a Linear (with bias), a tanh GELU and a Linear (no
    other children, which could take part in its forward), else None."""
    children = dict(module.named_children())
    for names in MLP_LAYOUTS:
        if set(children) != set(names):
            continue
        first, activation, second = (children[name] for name in names)
        if (
            isinstance(first, torch.nn.Linear)
            and isinstance(second, torch.nn.Linear)
            and first.bias is not None
            and _is_tanh_gelu(activation)
        ):
            return names
    return None


def _is_tanh_gelu(activation: torch.nn.Module) -> bool:
    """The tanh approximation of GELU, cuBLASLt's epilogue: torch's nn.GELU("tanh") or Hugging
    Face's GELUTanh / PytorchGELUTanh / NewGELUActivation / FastGELUActivation."""
    if isinstance(activation, torch.nn.GELU):
        return activation.approximate == "tanh"
    return type(activation).__name__ in (
        "GELUTanh",
        "PytorchGELUTanh",
        "NewGELUActivation",
        "FastGELUActivation",
    )


def _patch_gelu_mlp(module: torch.nn.Module, layout: tuple[str, str, str]) -> None:
    """Mark `module` with its layout and wrap its class's forward once. The class, not the
    instance: a compiled block (`vitpool.kernels.compiled`) would otherwise see another function
    object in every block and compile once per block."""
    module.__dict__[GELU_MLP_LAYOUT] = layout
    cls = type(module)
    original = cls.forward
    if getattr(original, "__vitpool_original__", None) is not None:
        return

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        # inside a compiled block inductor fuses Hugging Face's GELU itself
        if not torch.compiler.is_compiling() and FUSED_OPS.get() and len(args) == 1 and not kwargs:
            layout = self.__dict__.get(GELU_MLP_LAYOUT)
            if layout is not None:
                fused = _gelu_mlp(self, layout, args[0])
                if fused is not None:
                    return fused
        return original(self, *args, **kwargs)

    forward.__vitpool_original__ = original
    cls.forward = forward


def _gelu_mlp(self: torch.nn.Module, layout: tuple[str, str, str], x: torch.Tensor) -> torch.Tensor | None:
    """second(GELU(first(x))) with the first bias and the GELU in the GEMM's epilogue; None where
    the input is not CUDA half precision in the weights' dtype."""
    first, second = getattr(self, layout[0]), getattr(self, layout[2])
    if fp8_active(first, x):  # FP8 has no GELU epilogue: the GELU writes the second GEMM's FP8 rows
        return fp8_gelu_mlp(first, second, x)
    if not (x.is_cuda and x.dtype in HALF_DTYPES and first.weight.dtype == x.dtype):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or first.weight.requires_grad):
        return None
    rows = x.reshape(-1, x.shape[-1])
    hidden = torch._addmm_activation(first.bias, rows, first.weight.t(), use_gelu=True)
    return second(hidden.reshape(*x.shape[:-1], hidden.shape[-1]))
