"""The first call at a new image size, eager at the image's own rows (sizes above the largest
budget), for each attention kernel: a kernel that builds a plan per sequence length (cuDNN's
SDPA graphs) pays it on every new size, which a sweep that repeats sizes hides.

    python benchmarks/studies/new_sizes.py [--sides 1056,1088,...] [--attention auto,fa2]

Prints per side the first call's and a repeated call's latency (ms), per kernel setting.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
from common import QWEN3_VL_8B_VISION, image

from vitpool import GraphEncoder

DEFAULT_SIDES = ",".join(str(side) for side in range(1088, 1793, 64))


def once_ms(encoder: GraphEncoder, items: list) -> float:
    start = time.perf_counter()
    encoder.encode(items)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sides", default=DEFAULT_SIDES)
    parser.add_argument("--attention", default="auto,fa2")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(QWEN3_VL_8B_VISION))
        torch.manual_seed(0)
        base = GraphEncoder.from_pretrained(directory, budgets=[16], device="cuda", dtype=torch.bfloat16)
    print(f"GPU: {torch.cuda.get_device_name()}; eager at the image's own rows; first call / second call, ms")
    settings = args.attention.split(",")
    print("| side | " + " | ".join(settings) + " |\n|---" * (len(settings) + 1) + "|")
    encoders = {
        name: GraphEncoder(base.adapter, budgets=[16], device="cuda", attention=name) for name in settings
    }
    once_ms(encoders[settings[0]], [image(512)])  # warm the common kernels
    for side in (int(s) for s in args.sides.split(",")):
        cells = []
        for encoder in encoders.values():
            items = [image(side)]
            first = once_ms(encoder, items)
            cells.append(f"{first:.1f} / {once_ms(encoder, items):.1f}")
        print(f"| {side}² | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
