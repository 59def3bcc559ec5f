"""FP8 GEMMs for a tower's blocks: the opt-in `precision="fp8"` of `GraphEncoder`.

Every Linear of the tower's repeated blocks (attention projections, MLPs, Qwen3-VL's deepstack
mergers) whose sizes are multiples of 16 keeps its bf16 weight and gains an FP8 copy (e4m3, one
scale per output channel). Under `use_fp8(True)`, on CUDA in bfloat16, its forward quantizes the
activation per row (one Triton kernel: the row's absolute maximum, the scale and the cast in one
pass) and runs `torch._scaled_mm` with the row and channel scales and the bias in its epilogue,
writing bf16. The patch embedding, the position embeddings and the final projector stay bf16:
they are a few percent of the FLOPs and the first and last to see the values.

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
        _FP8.get() and FP8_WEIGHT in linear.__dict__ and x.is_cuda and x.dtype == torch.bfloat16
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
    return count


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
    linear.__dict__[FP8_WEIGHT] = (quantized, scale.reshape(1, -1).contiguous(), (weight.data_ptr(), weight._version))


def _linear_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling() or not fp8_active(linear, x):
        return F.linear(x, linear.weight, linear.bias)
    return fp8_linear(x, *linear.__dict__[FP8_WEIGHT][:2], linear.bias)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias with `x` quantized per row to FP8 and `weight` [out, in] already FP8
    with `weight_scale` [1, out]; the result in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    quantized, scale = quantize_rows(rows)
    out = torch._scaled_mm(
        quantized, weight.t(), scale_a=scale, scale_b=weight_scale, bias=bias, out_dtype=x.dtype
    )
    return out.reshape(*x.shape[:-1], weight.shape[0])


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
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    count, width = rows.shape
    quantized = torch.empty((count, width), dtype=FP8_DTYPE, device=rows.device)
    scale = torch.empty((count, 1), dtype=torch.float32, device=rows.device)
    block = 1 << max(4, (width - 1).bit_length())
    _quantize_kernel()[(count,)](
        rows, quantized, scale, width, rows.stride(0), FP8_MAX, _MIN_SCALE, BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
    )
    return quantized, scale


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
