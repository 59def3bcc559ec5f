"""FP8 GEMMs for a tower's blocks: the opt-in `precision="fp8"` of `GraphEncoder`.

Every Linear of the tower's repeated blocks (attention projections, MLPs, Qwen3-VL's deepstack
mergers) whose sizes are multiples of 16 keeps its bf16 weight and gains an FP8 copy (e4m3, one
scale per output channel). Under `use_fp8(True)`, on CUDA in bfloat16, its forward runs
`torch._scaled_mm` with one scale per input row and per weight channel and the bias in its
epilogue, writing bf16. The input's FP8 rows come from the pass that already wrote them where
there is one, so quantizing costs no pass of its own:

- a block's LayerNorm writes its bf16 output and, in the same Triton kernel, that output's FP8
  rows and their scales, attached to the output tensor; the Linear that takes exactly that tensor
  (the qkv and fc1 after it) uses them;
- a two-layer tanh-GELU MLP (`vitpool.kernels.gelu_mlp`) runs its first GEMM in FP8 to bf16, then one
  Triton kernel takes the GELU and writes FP8 rows and scales for the second GEMM;
- any other input (the attention's output before proj, say) is quantized per row by one Triton
  kernel (the row's absolute maximum, the scale and the cast in one pass).

The patch embedding, the position embeddings and the final projector stay bf16: they are a few
percent of the FLOPs and the first and last to see the values.

Attention stays bf16: torch 2.11 ships no FP8 attention (SDPA's cuDNN and Flash backends take
half precision only), so at large images, where attention is most of the time, FP8 shortens only
the GEMM part (`benchmarks/RESULTS.md`, "FP8 GEMMs").

The FP8 copies live in the module's `__dict__`, not as parameters or buffers: `state_dict` and
`tower.to(dtype)` never see them (a cast would turn them back into bf16). Outside `use_fp8(True)`
the Linears run as before, so a bf16 encoder on the same adapter is untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vitpool.kernels.compiled import repeated_block_stacks
from vitpool.kernels.scoped import scoped_value

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FP8_WEIGHT = "_vitpool_fp8_weight"  # (fp8 weight [out, in], its scale [1, out] fp32, the weight's version)
# on a LayerNorm's output tensor: (its FP8 rows, their scales [rows, 1], the output's version when written)
FP8_ROWS = "_vitpool_fp8_rows"
_ALIGNMENT = 16  # _scaled_mm's rule for both sizes of the weight
_MIN_SCALE = 1e-12  # an all-zero row or channel still gets a finite scale
_FP8: contextvars.ContextVar[bool] = contextvars.ContextVar("vitpool_fp8", default=False)


def use_fp8(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Let the Linears that `install_fp8_linears` prepared run in FP8 while the block runs."""
    return scoped_value(_FP8, enabled)


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_active(linear: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `linear` runs in FP8 on `x` now: prepared, under `use_fp8(True)`, bf16 on CUDA,
    and no autograd (the path has no backward)."""
    return (
        _FP8.get()
        and FP8_WEIGHT in linear.__dict__
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and not (torch.is_grad_enabled() and (x.requires_grad or linear.weight.requires_grad))
    )


def install_fp8_linears(tower: torch.nn.Module) -> int:
    """Prepare the Linears of `tower`'s repeated blocks for FP8 (in effect under `use_fp8`);
    returns how many. Installing again refreshes the FP8 copies of weights that changed."""
    count = 0
    for stack in repeated_block_stacks(tower):
        for module in stack.modules():
            if isinstance(module, torch.nn.Linear) and _fits(module):
                _quantize_weight(module)
                if not isinstance(module.forward, functools.partial):
                    # a partial of a module-level function (not a bound method): the tower still pickles
                    module.forward = functools.partial(_linear_forward, module)
                count += 1
            elif _is_row_layer_norm(module) and not isinstance(module.forward, functools.partial):
                module.forward = functools.partial(_layer_norm_forward, module)
    return count


def _is_row_layer_norm(module: torch.nn.Module) -> bool:
    """A LayerNorm over the last dimension with a weight (the blocks' pre-norms)."""
    return (
        isinstance(module, torch.nn.LayerNorm)
        and len(module.normalized_shape) == 1
        and module.weight is not None
        and module.normalized_shape[0] % _ALIGNMENT == 0
    )


def _fits(linear: torch.nn.Linear) -> bool:
    return linear.in_features % _ALIGNMENT == 0 and linear.out_features % _ALIGNMENT == 0


def _quantize_weight(linear: torch.nn.Linear) -> None:
    """The weight's FP8 copy with one scale per output channel."""
    weight = linear.weight.detach()
    cached = linear.__dict__.get(FP8_WEIGHT)
    if cached is not None and cached[2] == (weight.data_ptr(), weight._version):
        return
    scale = weight.abs().amax(dim=1, keepdim=True).float().clamp(min=_MIN_SCALE) / FP8_MAX
    quantized = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    linear.__dict__[FP8_WEIGHT] = (
        quantized,
        scale.reshape(1, -1).contiguous(),
        (weight.data_ptr(), weight._version),
    )


def _linear_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling() or not fp8_active(linear, x):
        return F.linear(x, linear.weight, linear.bias)
    return fp8_linear(x, *linear.__dict__[FP8_WEIGHT][:2], linear.bias)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias with `x` quantized per row to FP8 (or its rows as a LayerNorm already
    wrote them) and `weight` [out, in] already FP8 with `weight_scale` [1, out]; in x's dtype."""
    quantized, scale = _rows_of(x)
    out = torch._scaled_mm(
        quantized, weight.t(), scale_a=scale, scale_b=weight_scale, bias=bias, out_dtype=x.dtype
    )
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _rows_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x`'s rows in FP8 and their scales: those its LayerNorm wrote if `x` is that very output,
    unchanged since, else quantized now."""
    written = x.__dict__.get(FP8_ROWS)
    if written is not None and written[2] == x._version:
        return written[0], written[1]
    return quantize_rows(x.reshape(-1, x.shape[-1]))


def fp8_gelu_mlp(first: torch.nn.Linear, second: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """second(tanh-GELU(first(x))) with both GEMMs in FP8 and the GELU writing the second's FP8
    rows; None where either Linear does not run in FP8 on `x`."""
    if not (fp8_active(first, x) and FP8_WEIGHT in second.__dict__ and _triton_available()):
        return None
    hidden = fp8_linear(x, *first.__dict__[FP8_WEIGHT][:2], first.bias)
    quantized, scale = gelu_tanh_rows(hidden.reshape(-1, hidden.shape[-1]))
    weight, weight_scale = second.__dict__[FP8_WEIGHT][:2]
    out = torch._scaled_mm(
        quantized, weight.t(), scale_a=scale, scale_b=weight_scale, bias=second.bias, out_dtype=x.dtype
    )
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _layer_norm_forward(norm: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    if (
        torch.compiler.is_compiling()
        or not _FP8.get()
        or not x.is_cuda
        or x.dtype != torch.bfloat16
        or norm.weight.dtype != x.dtype
        or not _triton_available()
        or x.numel() == 0
        or (torch.is_grad_enabled() and (x.requires_grad or norm.weight.requires_grad))
    ):
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    out, quantized, scale = layer_norm_rows(x.reshape(-1, x.shape[-1]), norm.weight, norm.bias, norm.eps)
    out = out.reshape(x.shape)
    out.__dict__[FP8_ROWS] = (quantized, scale, out._version)
    return out


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` [n, k] as FP8 with one fp32 scale per row ([n, 1]): row / scale spans ±448."""
    if rows.is_cuda and _triton_available() and rows.shape[0] > 0:
        return _quantize_rows_triton(rows)
    scale = rows.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) / FP8_MAX
    return (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _quantize_rows_triton(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp8_row_pass(_quantize_kernel(), rows)


def _fp8_row_pass(kernel: Callable, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row of `rows` [n, k] running `kernel(rows, quantized, scales, width,
    row_stride, fp8_max, min_scale, BLOCK)`, a pass that writes each row as FP8 and its scale:
    (the FP8 rows, the scales [n, 1] fp32)."""
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    quantized, scale = _fp8_rows_for(rows)
    count, width = rows.shape
    block = _block(width)
    kernel[(count,)](
        rows,
        quantized,
        scale,
        width,
        rows.stride(0),
        FP8_MAX,
        _MIN_SCALE,
        BLOCK=block,
        num_warps=_warps(block),
    )
    return quantized, scale


def _fp8_rows_for(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty FP8 rows shaped as `rows` [n, k] and their scales [n, 1] fp32, on its device."""
    count, width = rows.shape
    return (
        torch.empty((count, width), dtype=FP8_DTYPE, device=rows.device),
        torch.empty((count, 1), dtype=torch.float32, device=rows.device),
    )


@functools.cache
def _quantize_kernel() -> Callable:
    import triton
    import triton.language as tl

    @triton.jit
    def quantize(rows, out, scales, width, row_stride, fp8_max, min_scale, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        inside = columns < width
        values = tl.load(rows + row * row_stride + columns, mask=inside, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(values), axis=0), min_scale) / fp8_max
        scaled = tl.clamp(values / scale, -fp8_max, fp8_max)
        tl.store(out + row * width + columns, scaled.to(tl.float8e4nv), mask=inside)
        tl.store(scales + row, scale)

    return quantize


def layer_norm_rows(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm of `rows` [n, k] (CUDA) in one Triton pass: (the output in rows' dtype, that
    output quantized per row to FP8, the scales [n, 1] fp32), the FP8 rows taken from the rounded
    output, as `quantize_rows` of the output would."""
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    count, width = rows.shape
    out = torch.empty((count, width), dtype=rows.dtype, device=rows.device)
    quantized, scale = _fp8_rows_for(rows)
    block = _block(width)
    _layer_norm_kernel()[(count,)](
        rows,
        weight,
        bias if bias is not None else weight,
        out,
        quantized,
        scale,
        width,
        rows.stride(0),
        eps,
        FP8_MAX,
        _MIN_SCALE,
        HAS_BIAS=bias is not None,
        BLOCK=block,
        num_warps=_warps(block),
    )
    return out, quantized, scale


def gelu_tanh_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh-GELU of `rows` [n, k] (CUDA) quantized per row to FP8 in one Triton pass: (FP8 rows,
    scales [n, 1] fp32); the GELU in fp32 and rounded to rows' dtype first, as torch's would be."""
    return _fp8_row_pass(_gelu_kernel(), rows)


def _block(width: int) -> int:
    return 1 << max(4, (width - 1).bit_length())


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 4096 else 16


@functools.cache
def _layer_norm_kernel() -> Callable:
    import triton
    import triton.language as tl

    @triton.jit
    def layer_norm(
        rows,
        weight,
        bias,
        out,
        quantized,
        scales,
        width,
        row_stride,
        eps,
        fp8_max,
        min_scale,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        inside = columns < width
        values = tl.load(rows + row * row_stride + columns, mask=inside, other=0.0).to(tl.float32)
        mean = tl.sum(values, axis=0) / width
        centered = tl.where(inside, values - mean, 0.0)
        variance = tl.sum(centered * centered, axis=0) / width
        normed = (
            centered
            * tl.rsqrt(variance + eps)
            * tl.load(weight + columns, mask=inside, other=0.0).to(tl.float32)
        )
        if HAS_BIAS:
            normed += tl.load(bias + columns, mask=inside, other=0.0).to(tl.float32)
        rounded = normed.to(out.dtype.element_ty)
        tl.store(out + row * width + columns, rounded, mask=inside)
        exact = rounded.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(exact), axis=0), min_scale) / fp8_max
        tl.store(
            quantized + row * width + columns,
            tl.clamp(exact / scale, -fp8_max, fp8_max).to(tl.float8e4nv),
            mask=inside,
        )
        tl.store(scales + row, scale)

    return layer_norm


@functools.cache
def _gelu_kernel() -> Callable:
    import triton
    import triton.language as tl

    @triton.jit
    def gelu(rows, quantized, scales, width, row_stride, fp8_max, min_scale, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        inside = columns < width
        values = tl.load(rows + row * row_stride + columns, mask=inside, other=0.0)
        x = values.to(tl.float32)
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2 / pi)
        # 0.5 * x * (1 + tanh(inner)) = x * sigmoid(2 * inner)
        activated = (x * tl.sigmoid(2.0 * inner)).to(values.dtype).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(activated), axis=0), min_scale) / fp8_max
        tl.store(
            quantized + row * width + columns,
            tl.clamp(activated / scale, -fp8_max, fp8_max).to(tl.float8e4nv),
            mask=inside,
        )
        tl.store(scales + row, scale)

    return gelu
