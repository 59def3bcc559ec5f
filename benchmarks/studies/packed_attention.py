"""Packed attention at the towers' shape (16 heads of 72, bf16): FlashAttention-2 (`varlen_attn`),
and cuDNN's packed SDPA through the frontend (`vitpool.kernels.cudnn_packed`), eager and captured
in a CUDA graph. (torch's own `_cudnn_attention_forward` over THD tensors, which needs no extra
package, was tried too: its capture failed with cudaErrorStreamCaptureInvalidated on torch 2.11.)

Each case is a batch as an encoder sees it: its sequences, then (for a budget's graph) empty
sequence slots up to the budget's count and the rows bound by the budget. Every figure is the
median (and p99) of `--runs` CUDA-event timings after warm-up; errors are against fp32 SDPA per
sequence; the captured graph is replayed on fresh inputs copied into its buffers with its output
poisoned with NaN first.

    python benchmarks/studies/packed_attention.py [--runs 100] [--out results.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py lives one folder up

import torch
import torch.nn.functional as F
from common import gpu_ms, summarize
from torch.nn.attention.varlen import varlen_attn

from vitpool.kernels.cudnn_packed import packed_cudnn_attention, plans_built

HEADS, HEAD_DIM = 16, 72
# name: (sequence lengths, rows of the batch, sequence slots of the batch's metadata)
CASES = {
    "5 images, 4096 rows (exact)": ([1024, 784, 1296, 576, 416], 4096, 5),
    "16 x 196 (exact)": ([196] * 16, 3136, 16),
    "2 x 3136 (exact)": ([3136, 3136], 6272, 2),
    "1 x 9604 (exact)": ([9604], 9604, 1),
    "5 images in a 4096-row budget of 64 slots": ([1024, 784, 1296, 576, 400], 4096, 65),
    "16 x 196 in a 4096-row budget of 64 slots": ([196] * 16, 4096, 65),
    "1 x 784 in a 1024-row budget of 16 slots": ([784], 1024, 17),
    "1 x 3136 in a 4096-row budget of 64 slots": ([3136], 4096, 65),
}


def boundaries(lengths: list[int], rows: int, slots: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens as an encoder builds them: the sequences, the padding rows as one more, then
    empty slots (repeats of `rows`)."""
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    if cu[-1] < rows:
        cu.append(rows)
    cu += [rows] * (slots + 1 - len(cu))
    return torch.tensor(cu, device=device, dtype=torch.int32)


def kernels(cu: torch.Tensor, rows: int):
    """name -> f(q, k, v) for the packed kernels, max_seqlen the batch's rows (as the graphs pass it)."""

    def fa2(q, k, v):
        return varlen_attn(q, k, v, cu, cu, rows, rows)

    def cudnn_frontend(q, k, v):
        return packed_cudnn_attention(q, k, v, cu, rows, None)

    return {"fa2": fa2, "cudnn_frontend": cudnn_frontend}


def reference(q, k, v, lengths) -> torch.Tensor:
    out, start = torch.zeros_like(q, dtype=torch.float32), 0
    for length in lengths:
        piece = slice(start, start + length)
        out[piece] = F.scaled_dot_product_attention(
            *(t[piece].transpose(0, 1).float() for t in (q, k, v))
        ).transpose(0, 1)
        start += length
    return out


def timed(fn, runs: int) -> tuple[float, float]:
    """Median and p99 ms of `runs` CUDA-event timings after 10 warm-up calls."""
    summary = summarize(gpu_ms(fn, runs, warmup=10))
    return summary["median_ms"], summary["p99_ms"]


def relative_error(got: torch.Tensor, expected: torch.Tensor, rows: int) -> float:
    return ((got[:rows].float() - expected[:rows]).norm() / expected[:rows].norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    results = {"gpu": gpu, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "cases": {}}
    print(f"{gpu}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for name, (lengths, rows, slots) in CASES.items():
        cu = boundaries(lengths, rows, slots, device)
        real_rows = sum(lengths)
        row = {}
        for kernel, fn in kernels(cu, rows).items():
            # fresh inputs per kernel: the capture check below overwrites them
            q, k, v = (
                torch.randn((rows, HEADS, HEAD_DIM), device=device, dtype=torch.bfloat16) for _ in range(3)
            )
            expected = reference(q, k, v, lengths)
            entry: dict = {}
            try:
                before, started = plans_built(), time.perf_counter()
                got = fn(q, k, v)
                torch.cuda.synchronize()
                entry["first_call_ms"] = 1e3 * (time.perf_counter() - started)
                entry["plans_built"] = plans_built() - before
                entry["error"] = relative_error(got, expected, real_rows)
                entry["finite"] = bool(torch.isfinite(got).all())
                entry["eager_ms"], entry["eager_p99_ms"] = timed(functools.partial(fn, q, k, v), args.runs)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn(q, k, v)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # on the warm-up's stream, to which cuDNN's handle is bound
                with torch.cuda.graph(graph, stream=side):
                    captured = fn(q, k, v)
                q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
                q.copy_(q2), k.copy_(k2), v.copy_(v2)
                captured.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                fresh = reference(q, k, v, lengths)
                entry["graph_error"] = relative_error(captured, fresh, real_rows)
                entry["graph_finite"] = bool(torch.isfinite(captured).all())
                entry["replay_ms"], entry["replay_p99_ms"] = timed(graph.replay, args.runs)
                del graph
            except Exception as error:  # noqa: BLE001 - a study: report what failed and go on
                entry["failed"] = f"{type(error).__name__}: {error}"[:300]
            row[kernel] = entry
        results["cases"][name] = row
        print(f"\n{name}")
        for kernel, entry in row.items():
            if "failed" in entry:
                print(f"  {kernel:15s} FAILED {entry['failed']}")
                continue
            print(
                f"  {kernel:15s} eager {entry['eager_ms']:.3f} ms (p99 {entry['eager_p99_ms']:.3f})  "
                f"replay {entry['replay_ms']:.3f} (p99 {entry['replay_p99_ms']:.3f})  "
                f"err {entry['error']:.2e} "
                f"graph err {entry['graph_error']:.2e} finite {entry['finite'] and entry['graph_finite']}  "
                f"first call {entry['first_call_ms']:.1f} ms"
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
