"""Where a fresh encoder process spends its start: imports, CUDA context, loading, capture.

Each start runs in a new Python process (as a replacement actor's does) and prints the seconds
of each phase as one JSON line; per-budget capture times come from the encoder's INFO log.

    python benchmarks/studies/start_phases.py [--starts 2] [--out start_phases.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD_FLAG = "--child"


def child(tower: str) -> None:
    began = time.perf_counter()
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks[name] = round(time.perf_counter() - began, 3)

    import torch

    mark("import torch")
    import transformers  # noqa: F401

    mark("import transformers")
    import vitpool.graphs  # noqa: F401
    from vitpool.models import loading  # noqa: F401

    mark("import vitpool engine")
    try:
        import flash_attn.cute  # noqa: F401 - FlashAttention-4, where installed
    except ImportError as error:
        marks["flash_attn.cute"] = repr(error)
    mark("import FlashAttention-4")
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    mark("CUDA context")
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(relativeCreated)d %(message)s")
    from vitpool import GraphEncoder

    encoder = GraphEncoder.from_pretrained(tower, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    mark("built")
    marks["capture_s"] = round(encoder.stats().capture_seconds, 3)
    print(json.dumps(marks), flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == CHILD_FLAG:
        child(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import save_random_tower

    tower = save_random_tower(tempfile.mkdtemp(prefix="vitpool-start-phases-"))
    rows = []
    for _ in range(args.starts):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, __file__, CHILD_FLAG, str(tower)], capture_output=True, text=True, check=False
        )
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        row = {"process_s": round(wall, 3), **json.loads(done.stdout.strip().splitlines()[-1])}
        rows.append(row)
        print(json.dumps(row), flush=True)
        print(
            "\n".join(line for line in done.stderr.splitlines() if "budget" in line or "load" in line),
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
