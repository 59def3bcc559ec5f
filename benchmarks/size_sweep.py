"""One image per side, 224² to 1792²: Hugging Face eager (sdpa) against vitpool, on the real-size
Qwen3-VL-8B tower (random bf16 weights), all in one run on one GPU.

vitpool runs each image three ways, from the same weights:
- "graph": the defaults: the device's ladder (an image up to 1024 tokens padded into the smallest
  budget that holds it and replayed in that budget's CUDA graph), larger images eager at their
  own rows, attention chosen per batch (`attention="auto"`: cuDNN for the long sequences of an
  eager batch, FA4 where installed, FA2 otherwise);
- "fa2": the same with `attention="fa2"` (FlashAttention-2 everywhere: the default install's
  attention before cuDNN was chosen), the baseline of the same run;
- "exact": eager at the image's own rows for every size (a single tiny budget), attention "auto".

Each size also gets its arithmetic floor: the tower's GEMM FLOPs (counted from its Linear and
Conv3d layers on the HF forward) and attention FLOPs (4 · rows² · head_dim · heads · depth), over
the bf16 peak measured in the same run (an 8192³ matmul), and vitpool's time over that floor.

With --compiled, also the HF tower under torch.compile(mode="reduce-overhead") (one compile per
side: slow). Prints median (p99) ms and ratios; writes JSON with --out.

    python benchmarks/size_sweep.py [--sides 224,448,...] [--runs 30] [--compiled] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import statistics
import tempfile
from pathlib import Path

import torch
from common import QWEN3_VL_8B_VISION, gpu_ms, image, software, summarize, time_ms

from vitpool import GraphEncoder

DEFAULT_SIDES = "224,448,672,896,1120,1344,1568,1792"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sides", default=DEFAULT_SIDES)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--fp8", action="store_true", help="also time precision='fp8' on the same weights")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    gpu = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(QWEN3_VL_8B_VISION))
        torch.manual_seed(0)
        graph = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    # the same adapter and weights, one tiny budget: every image of the sweep runs eager, exact
    exact = GraphEncoder(graph.adapter, budgets=[16], device="cuda", dtype=torch.bfloat16)
    before = GraphEncoder(graph.adapter, device="cuda", dtype=torch.bfloat16, attention="fa2")
    fp8 = (
        GraphEncoder(graph.adapter, device="cuda", dtype=torch.bfloat16, precision="fp8")
        if args.fp8
        else None
    )
    peak_tflops = _bf16_peak_tflops()
    tower = copy.deepcopy(graph.adapter.tower)
    tower.config._attn_implementation = "sdpa"
    compiled = torch.compile(tower, mode="reduce-overhead") if args.compiled else None

    def hugging_face(module, items):
        pixels = torch.cat([it.pixel_values for it in items]).to("cuda", torch.bfloat16)
        grid = torch.tensor([it.grid_thw for it in items], device="cuda")
        return module(pixels, grid_thw=grid).pooler_output

    rows = []
    with torch.no_grad():
        for side in (int(s) for s in args.sides.split(",")):
            items = [image(side)]
            with _counting_gemm_flops(tower) as gemm_flops:
                want = hugging_face(tower, items).float()
            row = {"side": side, "patches": items[0].pixel_values.shape[0]}
            config = graph.adapter.tower.config
            attention_flops = 4 * row["patches"] ** 2 * config.hidden_size * config.depth
            row["floor_ms"] = (gemm_flops[0] + attention_flops) / (peak_tflops * 1e9)
            row["gemm_tflop"], row["attention_tflop"] = gemm_flops[0] / 1e12, attention_flops / 1e12
            paths = {
                "hf_eager": lambda items=items: hugging_face(tower, items),
                "graph": lambda items=items: graph.encode(items),
                "fa2": lambda items=items: before.encode(items),
                "exact": lambda items=items: exact.encode(items),
            }
            if fp8 is not None:
                paths["fp8"] = lambda items=items: fp8.encode(items)
            if compiled is not None:
                paths["hf_compiled"] = lambda items=items: hugging_face(compiled, items).clone()
            for name, run in paths.items():
                row[name] = summarize(time_ms(run, args.runs, args.warmup))
            for name in ("graph", "fa2", "exact", *(["fp8"] if fp8 is not None else [])):
                got = torch.cat([e.tokens for e in paths[name]()]).float()
                row[f"{name}_rel_error"] = float(
                    torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)
                )
            rows.append(row)
            if args.out:
                args.out.write_text(
                    json.dumps(
                        {
                            "gpu": gpu,
                            **software(),
                            "bf16_peak_tflops": peak_tflops,
                            "rows": rows,
                        },
                        indent=2,
                    )
                )
    print(
        f"\nGPU: {gpu}, torch {torch.__version__}; median (p99) ms of {args.runs} runs after {args.warmup} "
        f"warm-up; ratios over HF eager; floor at the measured bf16 peak {peak_tflops:.0f} TFLOP/s"
    )
    head = "| side | patches | HF eager | " + ("HF compiled | " if compiled is not None else "")
    print(
        head + "vitpool (defaults) | fa2 (before) | exact | vitpool / eager | fa2 / eager | floor ms | "
        "vitpool / floor | rel. err vitpool, fa2, exact |"
    )
    print("|---" * (11 + (compiled is not None)) + "|")
    fp8_lines = []
    for row in rows:
        cells = [f"{row['side']}²", str(row["patches"]), _cell(row["hf_eager"])]
        if compiled is not None:
            cells.append(_cell(row["hf_compiled"]))
        eager = row["hf_eager"]["median_ms"]
        cells += [
            _cell(row["graph"]),
            _cell(row["fa2"]),
            _cell(row["exact"]),
            f"**{row['graph']['median_ms'] / eager:.2f}**",
            f"{row['fa2']['median_ms'] / eager:.2f}",
            f"{row['floor_ms']:.1f}",
            f"{row['graph']['median_ms'] / row['floor_ms']:.2f}",
            f"{row['graph_rel_error']:.1e}, {row['fa2_rel_error']:.1e}, {row['exact_rel_error']:.1e}",
        ]
        print("| " + " | ".join(cells) + " |")
        if fp8 is not None:
            fp8_lines.append(
                f"| {row['side']}² | {_cell(row['graph'])} | {_cell(row['fp8'])} | "
                f"{row['graph']['median_ms'] / row['fp8']['median_ms']:.2f} | "
                f"{row['fp8']['median_ms'] / eager:.2f} | {row['fp8_rel_error']:.1e} |"
            )
    if fp8_lines:
        print(
            "\n| side | vitpool bf16 | vitpool fp8 | fp8 speed-up | fp8 / eager | fp8 rel. err vs HF bf16 |"
        )
        print("|---|---|---|---|---|---|")
        print("\n".join(fp8_lines))


def _bf16_peak_tflops(size: int = 8192, runs: int = 20) -> float:
    """The GPU's bf16 matmul rate on random data, TFLOP/s (median of `runs`)."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    samples = gpu_ms(lambda: a @ b, runs)
    return 2 * size**3 / (statistics.median(samples) * 1e9)


@contextlib.contextmanager
def _counting_gemm_flops(module: torch.nn.Module):
    """Counts the multiply-add FLOPs of `module`'s Linear and Conv3d layers while inside (a
    list of one number, complete on exit)."""
    total = [0]

    def count(layer, inputs, output):
        total[0] += 2 * layer.weight.numel() * output.numel() // layer.weight.shape[0]

    hooks = [
        layer.register_forward_hook(count)
        for layer in module.modules()
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv3d))
    ]
    try:
        yield total
    finally:
        for hook in hooks:
            hook.remove()


def _cell(stats: dict) -> str:
    return f"{stats['median_ms']:.2f} ({stats['p99_ms']:.2f})"


if __name__ == "__main__":
    main()
