"""RMSNorm as torch's one-kernel `rms_norm`.

Hugging Face's plain RMSNorm and Gemma 4's run seven kernels each (casts, square, mean, rsqrt,
products); torch's `rms_norm` computes the same in fp32 in one kernel. Only the forwards whose
source is exactly one of those two are replaced: any other RMSNorm keeps its own.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from vitpool.kernels.fused_switch import fused_ops_apply, source_body


def install_rms_norm(module: torch.nn.Module) -> None:
    """Wrap the forward of `module`'s class if it is one of the RMSNorms `rms_norm_kind` knows."""
    kind = rms_norm_kind(module)
    if kind is not None:
        _patch_rms_norm(type(module), kind)


# The body of Hugging Face's plain RMSNorm forward (Llama's, copied into many towers: GLM-4.1V,
# GLM-OCR, Qwen2.5-VL, ...), whitespace removed: norm in fp32, cast back, times the weight. Other
# RMSNorms (Gemma's 1 + weight, a cast after the product) differ in the last line and keep theirs.
_PLAIN_RMS_NORM_BODY = (
    "input_dtype=hidden_states.dtype",
    "hidden_states=hidden_states.to(torch.float32)",
    "variance=hidden_states.pow(2).mean(-1,keepdim=True)",
    "hidden_states=hidden_states*torch.rsqrt(variance+self.variance_epsilon)",
    "returnself.weight*hidden_states.to(input_dtype)",
)


# Gemma 4's RMSNorm: the norm, the (optional) weight and the product all in fp32, one cast at the end
# (its `_norm`, then its forward): torch's rms_norm with the weight does the same in one kernel.
_SCALED_RMS_NORM_BODIES = {
    "_norm": (
        "mean_squared=hidden_states.pow(2).mean(-1,keepdim=True)+self.eps",
        "returnhidden_states*torch.pow(mean_squared,-0.5)",
    ),
    "forward": (
        "normed_output=self._norm(hidden_states.float())",
        "ifself.with_scale:",
        "normed_output=normed_output*self.weight.float()",
        "returnnormed_output.type_as(hidden_states)",
    ),
}


def rms_norm_kind(module: torch.nn.Module) -> str | None:
    """ "plain" for Hugging Face's plain RMSNorm (a 1-D weight, `variance_epsilon`, exactly that
    forward), "scaled" for Gemma 4's (`eps`, `with_scale`, its weight where it has one, exactly its
    `_norm` and forward); None for anything else, which keeps its own forward."""
    if any(True for _ in module.children()):
        return None
    weight = getattr(module, "weight", None)
    if (
        isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and _has_plain_rms_norm_forward(type(module))
    ):
        return "plain"
    scale = getattr(module, "with_scale", None)
    if (
        isinstance(getattr(module, "eps", None), float)
        and isinstance(scale, bool)
        and (not scale or (isinstance(weight, torch.nn.Parameter) and weight.dim() == 1))
        and _has_scaled_rms_norm_forward(type(module))
    ):
        return "scaled"
    return None


@functools.cache
def _has_plain_rms_norm_forward(cls: type) -> bool:
    return source_body(cls.forward) == _PLAIN_RMS_NORM_BODY


@functools.cache
def _has_scaled_rms_norm_forward(cls: type) -> bool:
    return all(
        source_body(getattr(cls, name, None)) == body for name, body in _SCALED_RMS_NORM_BODIES.items()
    )


def _patch_rms_norm(cls: type, kind: str) -> None:
    """Wrap the class's forward once: under the fused ops, torch's one-kernel RMSNorm (fp32 inside,
    rounded once to the input's dtype). The plain one rounds before its weight, as Hugging Face's
    cast does, then multiplies: two kernels instead of seven (GLM-OCR runs four RMSNorms a layer, on
    q and k too). Gemma 4's takes its weight in fp32 before the one rounding: one kernel instead of
    seven (seven RMSNorms a layer)."""
    original = cls.forward
    if getattr(original, "__vitpool_original__", None) is not None:
        return

    @functools.wraps(original)
    def forward(self, hidden_states):
        if fused_ops_apply(hidden_states):
            width = hidden_states.shape[-1:]
            if kind == "plain":
                return self.weight * F.rms_norm(hidden_states, width, None, self.variance_epsilon)
            weight = self.weight if self.with_scale else None
            if weight is None or weight.dtype == hidden_states.dtype:
                return F.rms_norm(hidden_states, width, weight, self.eps)
        return original(self, hidden_states)

    forward.__vitpool_original__ = original
    cls.forward = forward
