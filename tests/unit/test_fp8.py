"""The opt-in FP8 GEMMs off the GPU: the quantization and the scaled product (torch's CPU
`_scaled_mm`), which Linears are prepared, that nothing changes outside `use_fp8`, and the
setting's checks (the kernels on a GPU: tests/gpu/test_fp8_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error

from vitpool import GraphEncoder, PoolSettings
from vitpool.cli import _parser
from vitpool.errors import ConfigError
from vitpool.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_WEIGHT,
    fp8_linear,
    install_fp8_linears,
    quantize_rows,
    use_fp8,
)


def test_rows_are_quantized_to_the_fp8_range_with_one_scale_each():
    rows = (
        torch.randn(37, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 37)[:, None]
    )
    rows[5] = 0.0  # an all-zero row still gets a finite scale
    quantized, scale = quantize_rows(rows)
    assert quantized.dtype == FP8_DTYPE and quantized.shape == rows.shape and scale.shape == (37, 1)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    values = quantized.float()
    assert values.abs().amax() <= FP8_MAX
    # each nonzero row's largest value lands on the top of the range
    assert torch.allclose(values.abs().amax(dim=1)[rows.abs().amax(dim=1) > 0], torch.tensor(FP8_MAX))
    # e4m3 keeps 3 mantissa bits: every value within half a step (2^-4 relative) of the row's
    assert ((values * scale - rows).abs() <= rows.abs() * 2**-4 + scale * 2**-9).all()


@torch.no_grad()
def test_the_scaled_product_is_the_product_of_the_dequantized_operands():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 64, generator=generator)
    linear = torch.nn.Linear(64, 48)
    install_fp8_linears(
        torch.nn.ModuleList([torch.nn.Sequential(linear), torch.nn.Sequential(torch.nn.Linear(64, 48))])
    )
    weight, weight_scale, _ = linear.__dict__[FP8_WEIGHT]
    got = fp8_linear(x, weight, weight_scale, linear.bias.detach())
    assert got.shape == (2, 9, 48)
    quantized, scale = quantize_rows(x.reshape(-1, 64))
    dequantized_x = (quantized.float() * scale).reshape(2, 9, 64)
    dequantized_w = weight.float() * weight_scale.reshape(-1, 1)
    assert relative_error(got, F.linear(dequantized_x, dequantized_w, linear.bias)) <= 1e-5
    # and near the full-precision product: FP8's rounding of both operands, no more
    assert relative_error(got, linear(x)) <= 0.05


def test_only_the_blocks_aligned_linears_are_prepared_and_nothing_changes_outside_fp8():
    blocks = torch.nn.ModuleList(
        [
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 24))
            for _ in range(3)
        ]
    )
    tower = torch.nn.Module()
    tower.blocks, tower.head = blocks, torch.nn.Linear(32, 32)
    state = {name: value.clone() for name, value in tower.state_dict().items()}
    assert (
        install_fp8_linears(tower) == 3
    )  # the 64 -> 24 Linears are not multiples of 16; the head is outside
    assert FP8_WEIGHT not in tower.head.__dict__ and FP8_WEIGHT not in blocks[0][2].__dict__
    assert tower.state_dict().keys() == state.keys()  # the FP8 copies are neither parameters nor buffers
    tower.to(torch.float64)
    assert blocks[1][0].__dict__[FP8_WEIGHT][0].dtype == FP8_DTYPE  # a cast leaves them alone
    x = torch.randn(5, 32, dtype=torch.float64)
    with use_fp8(True):  # CPU tensors: the plain Linear, bit for bit
        assert torch.equal(
            blocks[0](x), blocks[0][2](F.gelu(F.linear(x, blocks[0][0].weight, blocks[0][0].bias)))
        )


def test_installing_again_refreshes_the_copy_of_a_changed_weight():
    blocks = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])
    install_fp8_linears(blocks)
    before = blocks[0].__dict__[FP8_WEIGHT][0].float().clone()
    with torch.no_grad():
        blocks[0].weight.mul_(-1)
    assert install_fp8_linears(blocks) == 2
    assert torch.equal(blocks[0].__dict__[FP8_WEIGHT][0].float(), -before)
    assert isinstance(blocks[0].forward, type(blocks[1].forward))  # wrapped once


def test_precision_is_checked_where_it_is_set():
    with pytest.raises(ConfigError, match="precision 'fp16' is not one of"):
        GraphEncoder.from_pretrained(None, budgets=[16], device="cpu", precision="fp16")
    with pytest.raises(ConfigError, match="compute capability 8.9"):
        GraphEncoder.from_pretrained(None, budgets=[16], device="cpu", precision="fp8")
    with pytest.raises(ConfigError, match="precision 'int8'"):
        PoolSettings(precision="int8")
    with pytest.raises(ConfigError, match="GPU actors"):
        PoolSettings(precision="fp8", device="cpu")
    assert PoolSettings(precision="fp8").encoder_spec().precision == "fp8"
    assert GraphEncoder.from_pretrained(None, budgets=[16], device="cpu").precision == "bf16"


def test_the_cli_takes_the_precision():
    parser = _parser()
    assert parser.parse_args(["serve", "--precision", "fp8"]).precision == "fp8"
    assert parser.parse_args(["serve"]).precision is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--precision", "int4"])


def test_a_family_that_refuses_fp8_says_why(monkeypatch):
    from vitpool.graphs import encoder as encoder_module
    from vitpool.models import load_adapter

    adapter = load_adapter(None, torch.device("cpu"), torch.float32)
    adapter.fp8_refused = "its FP8 tokens were far from bf16"
    # past the device check, as on a GPU with FP8 tensor cores
    monkeypatch.setattr(encoder_module, "check_precision", lambda precision, *rest: precision)
    with pytest.raises(ConfigError, match="not offered for .*far from bf16"):
        GraphEncoder(adapter, budgets=[16], device="cpu", precision="fp8")
