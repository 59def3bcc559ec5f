"""One image per side, 224² to 1792²: Hugging Face eager (sdpa) against vitpool, on the real-size
Qwen3-VL-8B tower (random bf16 weights), all in one run on one GPU.

vitpool runs each image two ways, from the same weights:
- "graph": the device's default ladder, the image padded into the smallest budget that holds it
  and replayed in that budget's CUDA graph (packed FA2 attention);
- "exact": eager at the image's own rows, no padding, where a batch of one attention sequence
  takes SDPA's dense cuDNN attention (`vitpool.models.attention.host_boundaries`).

With --compiled, also the HF tower under torch.compile(mode="reduce-overhead") (one compile per
side: slow). Prints median (p99) ms and ratios; writes JSON with --out.

    python benchmarks/size_sweep.py [--sides 224,448,...] [--runs 30] [--compiled] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import tempfile
from pathlib import Path

import torch
from common import QWEN3_VL_8B_VISION, image, summarize, time_ms

from vitpool import GraphEncoder

DEFAULT_SIDES = "224,448,672,896,1120,1344,1568,1792"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sides", default=DEFAULT_SIDES)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    gpu = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(QWEN3_VL_8B_VISION))
        torch.manual_seed(0)
        graph = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    # the same adapter and weights, one tiny budget: every image of the sweep runs eager, exact
    exact = GraphEncoder(graph.adapter, budgets=[16], device="cuda", dtype=torch.bfloat16)
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
            want = hugging_face(tower, items).float()
            row = {"side": side, "patches": items[0].pixel_values.shape[0]}
            paths = {
                "hf_eager": lambda items=items: hugging_face(tower, items),
                "graph": lambda items=items: graph.encode(items),
                "exact": lambda items=items: exact.encode(items),
            }
            if compiled is not None:
                paths["hf_compiled"] = lambda items=items: hugging_face(compiled, items).clone()
            for name, run in paths.items():
                row[name] = summarize(time_ms(run, args.runs, args.warmup))
            for name in ("graph", "exact"):
                got = torch.cat([e.tokens for e in paths[name]()]).float()
                row[f"{name}_rel_error"] = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
            rows.append(row)
            if args.out:
                args.out.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"\nGPU: {gpu}; median (p99) ms of {args.runs} runs after {args.warmup} warm-up; ratios over HF eager")
    head = "| side | patches | HF eager | " + ("HF compiled | " if compiled is not None else "")
    print(head + "graph | exact | graph / eager | exact / eager | rel. err graph, exact |")
    print("|---" * (8 + (compiled is not None)) + "|")
    for row in rows:
        cells = [f"{row['side']}²", str(row["patches"]), _cell(row["hf_eager"])]
        if compiled is not None:
            cells.append(_cell(row["hf_compiled"]))
        eager = row["hf_eager"]["median_ms"]
        cells += [_cell(row["graph"]), _cell(row["exact"]), f"{row['graph']['median_ms'] / eager:.2f}",
                  f"{row['exact']['median_ms'] / eager:.2f}",
                  f"{row['graph_rel_error']:.1e}, {row['exact_rel_error']:.1e}"]
        print("| " + " | ".join(cells) + " |")


def _cell(stats: dict) -> str:
    return f"{stats['median_ms']:.2f} ({stats['p99_ms']:.2f})"


if __name__ == "__main__":
    main()
