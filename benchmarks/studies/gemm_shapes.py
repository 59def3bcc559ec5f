"""GPU time of the Qwen3-VL-8B tower's GEMM shapes at a few row counts, by way of computing them.

Per (rows, layer) one GEMM's time: the median over replays of a CUDA graph that runs the GEMM once
per block, each block with its own weights (27 sets, as in the tower, so the weights come from
HBM and not from L2). Ways:

- `linear`: `F.linear` as the tower runs it (cuBLAS / cuBLASLt as PyTorch picks);
- `linear+gelu`: fc1 followed by the tower's tanh GELU (two kernels);
- `addmm_gelu`: fc1 with bias and tanh GELU in cuBLASLt's epilogue (`torch._addmm_activation`);
- `fp8` (`--fp8`): `vitpool.kernels.fp8.fp8_linear`, the row quantization of the input and
  `torch._scaled_mm` with row and channel scales and the bias (what `precision="fp8"` runs);
  `fp8_mm`: the `_scaled_mm` alone on an input already quantized; `fp8_tensor`: `_scaled_mm` with
  one scale per tensor, no bias (the fastest FP8 GEMM torch has, for comparison);
- `triton`: the linear under `torch.compile(mode="max-autotune-no-cudagraphs")` with static shapes,
  Triton templates only (the best of inductor's autotuning for this one shape).

    python benchmarks/studies/gemm_shapes.py [--rows 224,784,3136] [--triton-rows 224,784] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
import torch.nn.functional as F
from common import summarize

BLOCKS = 27
HIDDEN, INTERMEDIATE = 1152, 4304
LAYERS = {
    "qkv": (HIDDEN, 3 * HIDDEN),
    "proj": (HIDDEN, HIDDEN),
    "fc1": (HIDDEN, INTERMEDIATE),
    "fc2": (INTERMEDIATE, HIDDEN),
}


def per_gemm_ms(step, inputs, weights, biases, runs: int) -> dict:
    """Median/p99 ms of one GEMM: `step` over every block's weights captured once, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for weight, bias in zip(weights, biases):
                step(inputs, weight, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for weight, bias in zip(weights, biases):
            step(inputs, weight, bias)
    samples = []
    for _ in range(runs + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / len(weights))
    return summarize(samples[5:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="224,784,3136")
    parser.add_argument("--triton-rows", default="224,784")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--fp8", action="store_true", help="also the FP8 ways")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    results = []
    triton_rows = {int(r) for r in args.triton_rows.split(",") if r}
    for rows in (int(r) for r in args.rows.split(",")):
        for layer, (fan_in, fan_out) in LAYERS.items():
            inputs = torch.randn(rows, fan_in, device=device, dtype=dtype)
            weights = [
                torch.randn(fan_out, fan_in, device=device, dtype=dtype) / fan_in**0.5 for _ in range(BLOCKS)
            ]
            biases = [torch.randn(fan_out, device=device, dtype=dtype) for _ in range(BLOCKS)]
            ways = {"linear": lambda x, w, b: F.linear(x, w, b)}
            if layer == "fc1":
                ways["linear+gelu"] = lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh")
                ways["addmm_gelu"] = lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=True)
            if args.fp8:
                ways.update(_fp8_ways(inputs, weights))
            if rows in triton_rows:
                ways["triton"] = _triton_linear()
            row = {
                "rows": rows,
                "layer": layer,
                "weight_mb": fan_in * fan_out * 2 / 1e6,
                "tflop": 2 * rows * fan_in * fan_out / 1e12,
            }
            for name, step in ways.items():
                try:
                    row[name] = per_gemm_ms(step, inputs, weights, biases, args.runs)
                except Exception as error:  # noqa: BLE001 - a way that cannot run here is reported, not fatal
                    row[name] = {"error": f"{type(error).__name__}: {error}"[:200]}
            if "addmm_gelu" in row and "median_ms" in row["addmm_gelu"]:
                reference = F.gelu(F.linear(inputs, weights[0], biases[0]).float(), approximate="tanh")
                fused = torch._addmm_activation(biases[0], inputs, weights[0].t(), use_gelu=True).float()
                row["addmm_gelu_rel_err"] = ((fused - reference).norm() / reference.norm()).item()
            results.append(row)
            print(_line(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=2))
    print(
        f"GPU: {torch.cuda.get_device_name()}; per GEMM, median µs over {args.runs} replays of {BLOCKS} GEMMs"
    )


def _fp8_ways(inputs: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    from vitpool.kernels.fp8 import FP8_DTYPE, FP8_MAX, fp8_linear, quantize_rows

    copies = {}
    for weight in weights:  # per output channel, as install_fp8_linears makes them
        scale = weight.abs().amax(dim=1, keepdim=True).float() / FP8_MAX
        copies[weight.data_ptr()] = (
            (weight.float() / scale).to(FP8_DTYPE),
            scale.reshape(1, -1).contiguous(),
        )
    quantized, row_scale = quantize_rows(inputs)
    one = torch.ones((), device=inputs.device)

    def fp8(x, w, b):
        return fp8_linear(x, *copies[w.data_ptr()], b)

    def fp8_mm(x, w, b):
        weight, scale = copies[w.data_ptr()]
        return torch._scaled_mm(
            quantized, weight.t(), scale_a=row_scale, scale_b=scale, bias=b, out_dtype=x.dtype
        )

    def fp8_tensor(x, w, b):
        return torch._scaled_mm(
            quantized, copies[w.data_ptr()][0].t(), scale_a=one, scale_b=one, out_dtype=x.dtype
        )

    return {"fp8": fp8, "fp8_mm": fp8_mm, "fp8_tensor": fp8_tensor}


def _triton_linear():
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune_gemm_backends = "TRITON"
    return torch.compile(lambda x, w, b: F.linear(x, w, b), mode="max-autotune-no-cudagraphs", dynamic=False)


def _line(row: dict) -> str:
    parts = [f"rows {row['rows']:5d} {row['layer']:4s} ({row['weight_mb']:.1f} MB)"]
    for name in ("linear", "linear+gelu", "addmm_gelu", "fp8", "fp8_mm", "fp8_tensor", "triton"):
        if name in row:
            value = row[name]
            shown = f"{value['median_ms'] * 1e3:.1f} µs" if "median_ms" in value else value["error"]
            parts.append(f"{name} {shown}")
    if "addmm_gelu_rel_err" in row:
        parts.append(f"epilogue rel err {row['addmm_gelu_rel_err']:.1e}")
    return " | ".join(parts)


if __name__ == "__main__":
    main()
