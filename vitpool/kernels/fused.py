"""Fused work in the Hugging Face towers on a GPU, installed through shared code for every family.

What it replaces, and why (`benchmarks/studies/kernel_breakdown.py` and `gemm_shapes.py`; figures:
`benchmarks/HISTORY.md`, "FlashAttention-4 and fused ops (issue 14, second step)" and "GELU in the
GEMM epilogue, host work per call, and what bounds the rest (issue 14, fifth step)"; the kernel
counts: `benchmarks/RESULTS.md`, "Figures the code's design rests on"):

- rotary position embedding: every family's `apply_rotary_pos_emb_vision(q, k, cos, sin)` casts
  q and k to fp32, multiplies, rotates halves with a `cat`, adds and casts back: about 16 kernels
  and several fp32 copies of [rows, heads, head_dim] per layer, most of the elementwise and copy
  kernels of a small forward. Here one Triton kernel per tensor computes the same fp32 math from
  the bf16 input and writes bf16.
- patch embedding: a Conv3d / Conv2d whose kernel equals its stride, applied to one patch per row
  (every family's patch embedding), runs as a slow implicit fp32-accumulating convolution; it is
  the same product as a Linear over the flattened patch, a small GEMM. Over a whole image (the
  SigLIP towers) it is one GEMM over the image's patches, and its output comes back channels-last
  so that the rows the tower goes on with are contiguous (see `_patch_grid_forward`).
- RMSNorm: Hugging Face's plain one and Gemma 4's run seven kernels each (casts, square, mean,
  rsqrt, products); torch's `rms_norm` computes the same in fp32 in one kernel.

- MLP activation: a two-layer MLP with a tanh GELU between its Linears (Qwen3-VL, Qwen3.5,
  Kimi-K2.5, PaddleOCR-VL) runs its first Linear's bias and the GELU in cuBLASLt's GEMM epilogue
  (`torch._addmm_activation`), so the [rows, intermediate] activation is written once instead of
  written, read and written again, which saves that round trip at every size. The GELU is taken
  on the fp32 accumulator before rounding.

All take effect only inside `use_fused_ops(True)` (the encoder sets it around its forwards) and
only on CUDA tensors in half precision; anything else runs Hugging Face's own code, so a reference
tower in the same process is untouched and the CPU path stays the exact reference.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import inspect
import logging
import sys
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vitpool.kernels.fp8 import fp8_active, fp8_gelu_mlp
from vitpool.kernels.scoped import scoped_value

logger = logging.getLogger(__name__)

ROTARY_FUNCTION = "apply_rotary_pos_emb_vision"
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_FUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("vitpool_fused_ops", default=False)


def use_fused_ops(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Let the installed fused kernels run (on CUDA, half precision) while the block runs."""
    return scoped_value(_FUSED, enabled)


def fused_ops_apply(x: torch.Tensor) -> bool:
    """Whether a tower's own code may take its fused path on `x`: under `use_fused_ops(True)`,
    outside a compiled block (inductor fuses the plain code itself), on CUDA in half precision,
    and with no autograd through `x` (the Triton kernels have no backward)."""
    return (
        _FUSED.get()
        and not torch.compiler.is_compiling()
        and x.is_cuda
        and x.dtype in _HALF_DTYPES
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def install_fused_ops(tower: torch.nn.Module) -> None:
    """Route `tower`'s rotary embedding, patch convolutions, tanh-GELU MLPs and RMSNorms through the
    fused versions (in effect only under `use_fused_ops(True)`). Installing again is harmless."""
    for module in tower.modules():
        modeling = sys.modules.get(type(module).__module__)
        if modeling is not None and callable(getattr(modeling, ROTARY_FUNCTION, None)):
            _patch_rotary(modeling)
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)) and _is_patch_conv(module):
            # a partial of a module-level function (not a bound method): the tower still pickles
            module.forward = functools.partial(_patch_conv_forward, module)
        layout = gelu_mlp_layout(module)
        if layout is not None:
            _patch_gelu_mlp(module, layout)
        kind = rms_norm_kind(module)
        if kind is not None:
            _patch_rms_norm(type(module), kind)


# ---- rotary -----------------------------------------------------------------------------------


def _patch_rotary(modeling: types.ModuleType) -> None:
    original = getattr(modeling, ROTARY_FUNCTION)
    if getattr(original, "__vitpool_original__", None) is not None:
        return

    @functools.wraps(original)
    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        # inside a compiled block (`vitpool.kernels.compiled`) inductor fuses Hugging Face's math itself
        if not torch.compiler.is_compiling() and _FUSED.get():
            # Kimi-K2.5 passes [1, rows, heads, head_dim] (and may pass cos as [1, rows, head_dim])
            batched = q.dim() == 4 and q.shape[0] == 1 and k.dim() == 4 and k.shape[0] == 1
            q3, k3 = (q[0], k[0]) if batched else (q, k)
            cos2 = cos[0] if cos.dim() == 3 and cos.shape[0] == 1 else cos
            sin2 = sin[0] if sin.dim() == 3 and sin.shape[0] == 1 else sin
            if _rotary_fits(q3, k3, cos2, sin2):
                q_out, k_out = fused_rotary(q3, cos2, sin2), fused_rotary(k3, cos2, sin2)
                return (q_out[None], k_out[None]) if batched else (q_out, k_out)
        return original(q, k, cos, sin)

    apply_rotary_pos_emb_vision.__vitpool_original__ = original
    setattr(modeling, ROTARY_FUNCTION, apply_rotary_pos_emb_vision)


def _rotary_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The shapes every family passes: q, k [rows, heads, head_dim] in half precision with unit
    stride in head_dim; cos, sin [rows, head_dim] fp32 with unit stride."""
    if not (q.is_cuda and q.dtype in _HALF_DTYPES and k.dtype == q.dtype and triton_available()):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return False  # the kernel has no backward
    if q.dim() != 3 or k.shape != q.shape or cos.dim() != 2 or sin.shape != cos.shape:
        return False
    rows, _, head_dim = q.shape
    return (
        cos.shape == (rows, head_dim)
        and head_dim % 2 == 0
        and cos.dtype == sin.dtype == torch.float32
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
        and cos.stride(0) == sin.stride(0)
    )


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def fused_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in fp32, cast back to x's dtype: [rows, heads, head_dim].

    cos and sin are fp32 [positions, head_dim] (unit stride in head_dim), and row r of x takes
    position r % positions: one table per row, or one sequence's table for a batch of
    equal-length sequences flattened to rows (no copy of the table per sequence)."""
    rows, heads, head_dim = x.shape
    positions = cos.shape[0]
    if sin.shape != cos.shape or cos.shape[1] != head_dim or (rows and (not positions or rows % positions)):
        raise ValueError(f"rotary tables {tuple(cos.shape)} do not fit rows {tuple(x.shape)}")
    out = torch.empty((rows, heads, head_dim), device=x.device, dtype=x.dtype)
    if rows:
        half = head_dim // 2
        _rotary_kernel()[(rows,)](
            x,
            cos,
            sin,
            out,
            heads,
            positions,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            HALF=half,
            BLOCK_HEADS=_next_power_of_two(heads),
            BLOCK_HALF=_next_power_of_two(half),
        )
    return out


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _rotary_kernel() -> Callable:
    """The Triton kernel, defined on first use (triton is imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rotary(
        x_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        num_heads,
        num_positions,
        x_row_stride,
        x_head_stride,
        cos_row_stride,
        HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # row * stride overflows int32 past ~600k rows
        position = row % num_positions
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        cols = tl.arange(0, BLOCK_HALF)[None, :]
        col_ok = cols < HALF
        mask = (heads < num_heads) & col_ok
        x = x_ptr + row * x_row_stride + heads * x_head_stride + cols
        x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
        c = cos_ptr + position * cos_row_stride + cols
        s = sin_ptr + position * cos_row_stride + cols
        cos1 = tl.load(c, mask=col_ok, other=0.0)
        cos2 = tl.load(c + HALF, mask=col_ok, other=0.0)
        sin1 = tl.load(s, mask=col_ok, other=0.0)
        sin2 = tl.load(s + HALF, mask=col_ok, other=0.0)
        # rotate_half(x) = cat(-x2, x1), as Hugging Face computes it, in fp32
        first = x1 * cos1 + (-x2) * sin1
        second = x2 * cos2 + x1 * sin2
        out = out_ptr + row * (num_heads * 2 * HALF) + heads * (2 * HALF) + cols
        tl.store(out, first.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, second.to(out_ptr.dtype.element_ty), mask=mask)

    return rotary


# ---- patch embedding ----------------------------------------------------------------------------


def _is_patch_conv(conv: torch.nn.Conv2d | torch.nn.Conv3d) -> bool:
    """A convolution that cuts non-overlapping patches: kernel == stride, no padding or groups."""
    return (
        tuple(conv.kernel_size) == tuple(conv.stride)
        and all(p == 0 for p in _padding(conv))
        and all(d == 1 for d in conv.dilation)
        and conv.groups == 1
    )


def _padding(conv: torch.nn.Conv2d | torch.nn.Conv3d) -> tuple[int, ...]:
    return (0,) * len(conv.kernel_size) if conv.padding == "valid" else tuple(conv.padding)


def _patch_conv_forward(self: torch.nn.Conv2d | torch.nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    """One patch per input (spatial size == kernel): a Linear over the flattened patch. A whole
    image (a Conv2d over a grid of patches): a Linear over its patches, cut out as rows."""
    if _FUSED.get() and x.is_cuda and x.dtype in _HALF_DTYPES:
        if tuple(x.shape[2:]) == tuple(self.kernel_size):
            out = F.linear(x.reshape(x.shape[0], -1), self.weight.reshape(self.out_channels, -1), self.bias)
            return out.reshape(x.shape[0], self.out_channels, *([1] * len(self.kernel_size)))
        if (
            isinstance(self, torch.nn.Conv2d)
            and x.dim() == 4
            and x.shape[2] >= self.kernel_size[0]
            and x.shape[3] >= self.kernel_size[1]
        ):
            return _patch_grid_forward(self, x)
    return type(self).forward(self, x)


def _patch_grid_forward(self: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The patch convolution of whole images [batch, channels, H, W] as one GEMM over their
    patches. The output [batch, out_channels, H/kh, W/kw] is returned channels-last: the
    towers go on with `flatten(2).transpose(1, 2)`, which is then already contiguous [batch,
    patches, width]. The convolution's own output made that a transposed view, and the residual
    stream kept its layout through every layer: each LayerNorm copied it and each residual add
    read it strided (SigLIP towers: a quarter of a 896² view's GPU time,
    `benchmarks/studies/family_profile.py`)."""
    batch, channels, height, width = x.shape
    kh, kw = self.kernel_size
    rows, cols = height // kh, width // kw
    # the convolution drops the pixels past the last whole patch (384² over patches of 14: 27 a side)
    x = x[:, :, : rows * kh, : cols * kw]
    patches = x.reshape(batch, channels, rows, kh, cols, kw).permute(0, 2, 4, 1, 3, 5)
    out = F.linear(
        patches.reshape(-1, channels * kh * kw), self.weight.reshape(self.out_channels, -1), self.bias
    )
    return out.reshape(batch, rows, cols, self.out_channels).permute(0, 3, 1, 2)


# ---- MLP with a tanh GELU -----------------------------------------------------------------------

# (first Linear, activation, second Linear): the attribute names of the towers' two-layer MLPs whose
# forward is second(activation(first(x))): Qwen3-VL / Qwen3.5, SigLIP-style (PaddleOCR-VL), Kimi-K2.5
MLP_LAYOUTS = (("linear_fc1", "act_fn", "linear_fc2"), ("fc1", "activation_fn", "fc2"), ("fc1", "act", "fc2"))
GELU_MLP_LAYOUT = "_vitpool_gelu_mlp_layout"  # the instance attribute that marks an MLP for the epilogue


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
        if not torch.compiler.is_compiling() and _FUSED.get() and len(args) == 1 and not kwargs:
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
    if not (x.is_cuda and x.dtype in _HALF_DTYPES and first.weight.dtype == x.dtype):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or first.weight.requires_grad):
        return None
    rows = x.reshape(-1, x.shape[-1])
    hidden = torch._addmm_activation(first.bias, rows, first.weight.t(), use_gelu=True)
    return second(hidden.reshape(*x.shape[:-1], hidden.shape[-1]))


# ---- RMSNorm -----------------------------------------------------------------------------------

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
    return _body(cls.forward) == _PLAIN_RMS_NORM_BODY


@functools.cache
def _has_scaled_rms_norm_forward(cls: type) -> bool:
    return all(_body(getattr(cls, name, None)) == body for name, body in _SCALED_RMS_NORM_BODIES.items())


def _body(function: Callable | None) -> tuple[str, ...] | None:
    """A function's statements after its signature, whitespace, comments and docstring removed."""
    function = getattr(function, "__vitpool_original__", function)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    lines = ["".join(line.split()) for line in source.splitlines()]
    start = (
        next((number for number, line in enumerate(lines) if line.endswith(":")), 0) + 1
    )  # past the signature
    return tuple(line for line in lines[start:] if line and not line.startswith(("#", '"""')))


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


# ---- padding for dense attention ----------------------------------------------------------------


def pad_for_dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padded_rows: int,
    padded_dim: int,
    masked_from: int | torch.Tensor,
    masked_key: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q, k, v [rows, heads, head_dim] copied into zeros of [padded_rows, heads, padded_dim] by one
    Triton kernel, column head_dim set to 1 in q and, in k, to `masked_key` from row `masked_from`
    (an int, or a 0-d int32 tensor on the device) on (`vitpool.kernels.attention`'s dense cuDNN
    path). Torch's own ops take six kernels (a fill and a copy per tensor) and the two column
    writes, about twice the GPU time of this kernel and the copies left (benchmarks/HISTORY.md,
    "Attention where compute dominates: cuDNN on the default install (issue 42, first step)").
    None where the kernel cannot run (CPU, no Triton, a head stride that is not unit)."""
    rows, heads, head_dim = q.shape
    if not (
        q.is_cuda and triton_available() and all(t.stride(-1) == 1 and t.shape == q.shape for t in (k, v))
    ):
        return None
    on_device = isinstance(masked_from, torch.Tensor)
    outputs = [
        torch.empty((padded_rows, heads, padded_dim), device=q.device, dtype=q.dtype) for _ in range(3)
    ]
    with torch.cuda.device(q.device):
        _pad_kernel()[(padded_rows,)](
            q,
            k,
            v,
            *outputs,
            rows,
            masked_from if on_device else q,
            0 if on_device else int(masked_from),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            heads,
            masked_key,
            HEAD_DIM=head_dim,
            PADDED_DIM=padded_dim,
            MASK_FROM_DEVICE=on_device,
            BLOCK_HEADS=_next_power_of_two(heads),
            BLOCK_DIM=_next_power_of_two(padded_dim),
        )
    return outputs[0], outputs[1], outputs[2]


@functools.cache
def _pad_kernel() -> Callable:
    """The Triton kernel, defined on first use (triton is imported only where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def pad(
        q_ptr,
        k_ptr,
        v_ptr,
        q_out,
        k_out,
        v_out,
        rows,
        limit_ptr,
        limit_value,
        q_row_stride,
        q_head_stride,
        k_row_stride,
        k_head_stride,
        v_row_stride,
        v_head_stride,
        num_heads,
        masked_key,
        HEAD_DIM: tl.constexpr,
        PADDED_DIM: tl.constexpr,
        MASK_FROM_DEVICE: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_DIM: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        cols = tl.arange(0, BLOCK_DIM)[None, :]
        load_mask = (heads < num_heads) & (cols < HEAD_DIM) & (row < rows)
        q = tl.load(q_ptr + row * q_row_stride + heads * q_head_stride + cols, mask=load_mask, other=0.0)
        k = tl.load(k_ptr + row * k_row_stride + heads * k_head_stride + cols, mask=load_mask, other=0.0)
        v = tl.load(v_ptr + row * v_row_stride + heads * v_head_stride + cols, mask=load_mask, other=0.0)
        limit = tl.load(limit_ptr).to(tl.int64) if MASK_FROM_DEVICE else limit_value
        extra = cols == HEAD_DIM
        q = tl.where(extra, 1.0, q)
        k = tl.where(extra & (row >= limit), masked_key, k)
        offsets = row * (num_heads * PADDED_DIM) + heads * PADDED_DIM + cols
        store_mask = (heads < num_heads) & (cols < PADDED_DIM)
        tl.store(q_out + offsets, q.to(q_out.dtype.element_ty), mask=store_mask)
        tl.store(k_out + offsets, k.to(k_out.dtype.element_ty), mask=store_mask)
        tl.store(v_out + offsets, v.to(v_out.dtype.element_ty), mask=store_mask)

    return pad
