"""A block's layer-scaled residual, `residual + scale * x`, as one kernel (`torch.addcmul`).

InternVL's and Step-3.7's blocks scale each branch by a learned per-channel vector before adding it
back (`lambda_1`, `lambda_2`): a product and a sum, two passes over the residual stream, twice a
layer. `addcmul` computes both in one, in fp32, rounded once (`benchmarks/HISTORY.md`, "The fused
passes of the tiled and CLIP towers (issue 52, third step)"). Only the forwards whose source is
exactly Hugging Face's are replaced; anything else keeps its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vitpool.kernels.fused_switch import fused_ops_apply, source_body

# Hugging Face's InternVLVisionLayer.forward, whitespace removed (what `source_body` returns)
_INTERNVL_LAYER_BODY = (
    "attention_output,_=self.attention(",
    "self.layernorm_before(hidden_states),#inInternVLVision,layernormisappliedbeforeself-attention",
    ")",
    "attention_output=self.lambda_1*attention_output",
    "hidden_states=attention_output+hidden_states",
    "layer_output=self.layernorm_after(hidden_states)",
    "layer_output=self.mlp(layer_output)",
    "layer_output=self.dropout(layer_output)",
    "ifself.lambda_2isnotNone:",
    "layer_output=self.lambda_2*layer_output",
    "layer_output=layer_output+hidden_states",
    "returnlayer_output",
)
# Hugging Face's Step3p7VisionEncoderLayer.forward
_STEP3P7_LAYER_BODY = (
    "residual=hidden_states",
    "hidden_states=self.layernorm_before(hidden_states)",
    "hidden_states,_=self.self_attn(",
    "hidden_states,",
    "attention_mask=attention_mask,",
    "position_embeddings=position_embeddings,",
    "**kwargs,",
    ")",
    "hidden_states=self.lambda_1*hidden_states",
    "hidden_states=hidden_states+residual",
    "residual=hidden_states",
    "hidden_states=self.layernorm_after(hidden_states)",
    "hidden_states=self.mlp(hidden_states)",
    "hidden_states=self.lambda_2*hidden_states",
    "hidden_states=hidden_states+residual",
    "returnhidden_states",
)


def _internvl_layer(self, hidden_states: torch.Tensor) -> torch.Tensor:
    attention_output, _ = self.attention(self.layernorm_before(hidden_states))
    hidden_states = torch.addcmul(hidden_states, self.lambda_1, attention_output)
    layer_output = self.mlp(self.layernorm_after(hidden_states))  # its dropout: eval, the identity
    if self.lambda_2 is None:
        return layer_output + hidden_states
    return torch.addcmul(hidden_states, self.lambda_2, layer_output)


def _step3p7_layer(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
    attention_output, _ = self.self_attn(
        self.layernorm_before(hidden_states),
        attention_mask=attention_mask,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states = torch.addcmul(hidden_states, self.lambda_1, attention_output)
    return torch.addcmul(hidden_states, self.lambda_2, self.mlp(self.layernorm_after(hidden_states)))


_FUSED_FORWARDS: tuple[tuple[tuple[str, ...], Callable], ...] = (
    (_INTERNVL_LAYER_BODY, _internvl_layer),
    (_STEP3P7_LAYER_BODY, _step3p7_layer),
)


def install_layer_scale(module: torch.nn.Module) -> None:
    """Wrap the forward of `module`'s class once if it is one of the layer-scaled blocks above."""
    fused = layer_scale_forward(type(module))
    if fused is not None:
        _patch(type(module), fused)


@functools.cache
def layer_scale_forward(cls: type) -> Callable | None:
    """The one-kernel forward for a block class whose forward is exactly Hugging Face's, else None."""
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        return None
    body = source_body(getattr(cls, "forward", None))
    return next((fused for known, fused in _FUSED_FORWARDS if body == known), None)


def _patch(cls: type, fused: Callable) -> None:
    original = cls.forward
    if getattr(original, "__vitpool_original__", None) is not None:
        return

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if not self.training and fused_ops_apply(hidden_states):
            return fused(self, hidden_states, *args, **kwargs)
        return original(self, hidden_states, *args, **kwargs)

    forward.__vitpool_original__ = original
    cls.forward = forward
