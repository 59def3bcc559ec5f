"""Top CUDA kernels of one static forward of the Qwen3-VL-8B tower at a given row count.

python benchmarks/studies/profile_tower.py [--rows 3328]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
from common import QWEN3_VL_8B_VISION, padded_image_batch
from torch.profiler import ProfilerActivity, profile

from vitpool.models import load_adapter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3328)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(QWEN3_VL_8B_VISION))
        adapter = load_adapter(directory, torch.device("cuda"), torch.bfloat16)
    pixels, metadata = padded_image_batch(adapter, args.rows)
    with torch.no_grad():
        for _ in range(3):
            adapter.forward(pixels, metadata)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            adapter.forward(pixels, metadata)
            torch.cuda.synchronize()
    print(f"GPU: {torch.cuda.get_device_name()}, rows {args.rows} (one square image, the rest padding)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    main()
