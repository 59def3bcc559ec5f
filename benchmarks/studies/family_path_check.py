"""CPU check of a family's benchmark path (`benchmarks/family_paths/<family>.py`): its flagship's
vision config with fewer layers, built by vitpool on the CPU in fp32, against the path's
`hugging_face` on a copy of the same tower, for every workload (or the ones named). Run before
the path is timed on a GPU, where a wrong reference would only show as a large rel. error.

    python benchmarks/studies/family_path_check.py --family mistral3 [--layers 2] [--workloads "1x224"]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # family_latency.py lives one folder up

import torch
from family_latency import CONFIGS, flagship_encoder, hugging_face_eager, use_sdpa, workloads

LAYER_KEYS = ("num_hidden_layers", "depth", "num_layers")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workloads", default=None)
    parser.add_argument(
        "--config", type=Path, default=None, help="a JSON file with vision_config (default: the flagship's)"
    )
    args = parser.parse_args()
    entry = json.loads((args.config or CONFIGS).read_text())
    vision = entry["vision_config"] if args.config else entry[args.family]["vision_config"]
    short = {key: (args.layers if key in LAYER_KEYS else value) for key, value in vision.items()}
    encoder = flagship_encoder(args.family, short, device="cpu", dtype=torch.float32)  # as measure builds it
    reference = use_sdpa(copy.deepcopy(encoder.adapter.tower))
    only = set(args.workloads.split(",")) if args.workloads else None
    worst = 0.0
    with torch.no_grad():
        for name, items in workloads(args.family, vision).items():
            if only and name not in only:
                continue
            got = torch.cat([e.tokens for e in encoder.encode(items)]).float()
            want = hugging_face_eager(args.family, reference, items).float()
            if got.shape != want.shape:
                raise SystemExit(f"{name}: vitpool {tuple(got.shape)} vs Hugging Face {tuple(want.shape)}")
            error = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
            worst = max(worst, error)
            print(
                f"{args.family} {name}: tokens {tuple(got.shape)}, rel. error {error:.2e}, "
                f"finite {bool(torch.isfinite(got).all())}"
            )
    print(f"worst {worst:.2e}")
    if worst > 1e-4:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
