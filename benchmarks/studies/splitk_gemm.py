"""Can a split-K Triton GEMM beat cuBLAS at the tower's small-M shapes?

At 224 rows cuBLAS runs the Qwen3-VL-8B tower's GEMMs at 2-3x their weight-read time
(`gemm_shapes.py`): too few output tiles to fill 132 SMs. Splitting K gives every SM a slice of
the weights to stream. Here one kernel does it: each split writes its fp32 partial, the last
split of a tile (a per-tile counter) sums the partials in order (deterministic), adds the bias,
optionally the tanh GELU, and writes bf16. Timed like `gemm_shapes.py` (27 weight sets, one
graph, median per GEMM), against `F.linear` / `_addmm_activation` in the same run.

    python benchmarks/studies/splitk_gemm.py [--rows 224,784] [--out f.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from gemm_shapes import BLOCKS, LAYERS, per_gemm_ms

CONFIGS = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": w, "num_stages": st}
    for bm, bn, bk, sk, w, st in itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 4, 6), (4,), (3,))
    if not (bm == 128 and bn == 128 and bk == 128)
]


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def splitk_linear(
        a_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        partial_ptr,
        counter_ptr,
        M,
        N,
        K,
        GELU: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        tile = tl.program_id(0)
        split = tl.program_id(1)
        num_n = tl.cdiv(N, BLOCK_N)
        rm = (tile // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
        k_first = split * steps * BLOCK_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(steps):
            rk = k_first + step * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0
            )
            w = tl.load(
                w_ptr + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0
            )
            acc = tl.dot(a, w, acc)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offsets = rm[:, None] * N + rn[None, :]
        if SPLIT_K > 1:
            tl.store(partial_ptr + split * M * N + offsets, acc, mask=mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for other in range(SPLIT_K):
                    acc += tl.load(
                        partial_ptr + other * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg"
                    )
                acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
                if GELU:
                    inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
                    acc = 0.5 * acc * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
                tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next launch (graph replays)
        else:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if GELU:
                inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
                acc = 0.5 * acc * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
            tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return triton, splitk_linear


def make_linear(config: dict, rows: int, fan_out: int, gelu: bool, device: str):
    triton, kernel = _kernel()
    split_k = config["SPLIT_K"]
    partial = torch.empty(max(split_k, 1) * rows * fan_out, device=device, dtype=torch.float32)
    tiles = triton.cdiv(rows, config["BLOCK_M"]) * triton.cdiv(fan_out, config["BLOCK_N"])
    counters = torch.zeros(tiles, device=device, dtype=torch.int32)

    def linear(x, w, b):
        out = torch.empty(rows, fan_out, device=device, dtype=x.dtype)
        kernel[(tiles, split_k)](
            x, w, b, out, partial, counters, rows, fan_out, x.shape[1], GELU=gelu, **config
        )
        return out

    return linear


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="224,784")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for layer, (fan_in, fan_out) in LAYERS.items():
            gelu = layer == "fc1"
            inputs = torch.randn(rows, fan_in, device=device, dtype=dtype)
            weights = [
                torch.randn(fan_out, fan_in, device=device, dtype=dtype) / fan_in**0.5 for _ in range(BLOCKS)
            ]
            biases = [torch.randn(fan_out, device=device, dtype=dtype) for _ in range(BLOCKS)]
            if gelu:

                def reference(x, w, b):
                    return torch._addmm_activation(b, x, w.t(), use_gelu=True)
            else:
                reference = F.linear
            row = {
                "rows": rows,
                "layer": layer,
                "cublas": per_gemm_ms(reference, inputs, weights, biases, args.runs),
            }
            exact = F.linear(inputs.float(), weights[0].float(), biases[0].float())
            if gelu:
                exact = F.gelu(exact, approximate="tanh")
            best = None
            for config in CONFIGS:
                try:
                    linear = make_linear(config, rows, fan_out, gelu, device)
                    got = linear(inputs, weights[0], biases[0]).float()
                    error = ((got - exact).norm() / exact.norm()).item()
                    timing = per_gemm_ms(linear, inputs, weights, biases, args.runs)
                except Exception as failure:  # noqa: BLE001 - a configuration that does not compile here is skipped
                    print(f"  {config}: {type(failure).__name__}: {str(failure)[:120]}", flush=True)
                    continue
                if best is None or timing["median_ms"] < best["timing"]["median_ms"]:
                    best = {"config": config, "timing": timing, "rel_err": error}
            row["splitk_best"] = best
            results.append(row)
            print(
                f"rows {rows} {layer}: cuBLAS {row['cublas']['median_ms'] * 1e3:.1f} µs, split-K "
                f"{best['timing']['median_ms'] * 1e3:.1f} µs {best['config']} rel err {best['rel_err']:.1e}",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=2))
    print(f"GPU: {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
