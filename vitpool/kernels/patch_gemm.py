"""The patch embedding as a GEMM.

A Conv3d / Conv2d whose kernel equals its stride, applied to one patch per row (every family's
patch embedding), runs as a slow implicit fp32-accumulating convolution; it is the same product as
a Linear over the flattened patch, a small GEMM. Over a whole image (the SigLIP towers) it is one
GEMM over the image's patches, and its output comes back channels-last so that the rows the tower
goes on with are contiguous (see `_patch_grid_forward`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from vitpool.kernels.fused_switch import FUSED_OPS, HALF_DTYPES


def install_patch_gemm(module: torch.nn.Module) -> None:
    """Route `module`'s forward through the GEMM if it is a patch convolution."""
    if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)) and _is_patch_conv(module):
        # a partial of a module-level function (not a bound method): the tower still pickles
        module.forward = functools.partial(_patch_conv_forward, module)


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
    if FUSED_OPS.get() and x.is_cuda and x.dtype in HALF_DTYPES:
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
    read it strided (the SigLIP towers' profiles, `benchmarks/studies/family_profile.py`:
    `benchmarks/RESULTS.md`, "What moved the large workloads: three changes, measured before and
    after in one process each")."""
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
