"""Startup of an encoder with the default budgets, each start in a fresh process, as an actor starts.

The real-size Qwen3-VL-8B tower (random bf16 weights) is saved once; then each start runs in a
new Python process and builds `GraphEncoder.from_pretrained` with a compile cache directory of
its own (`compile_cache_dir`): the first start finds it empty (cold), the later ones find what
the first left there (warm). Two settings, each with a fresh directory: the defaults, under which
FlashAttention-4 keeps the kernels it compiles in memory only (every process compiles them again),
and FlashAttention-4's own disk cache turned on through its variables
(`FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`, `FLASH_ATTENTION_CUTE_DSL_CACHE_DIR` inside the
directory). Reported per start: the process's wall time (Python, imports, CUDA context, build),
the build alone, and the capture and check inside it.

    python benchmarks/startup.py [--starts 3] [--compiled-blocks on|off] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD_FLAG = "--child"


def child(tower: str, cache: str, compiled_blocks: bool) -> None:
    """One start: build the encoder and print its timings as one JSON line."""
    import torch

    from vitpool import GraphEncoder

    start = time.perf_counter()
    encoder = GraphEncoder.from_pretrained(
        tower, device="cuda", dtype=torch.bfloat16, compiled_blocks=compiled_blocks, compile_cache_dir=cache
    )
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    stats = encoder.stats()
    print(
        json.dumps(
            {
                "build_s": build_s,
                "capture_s": stats.capture_seconds,
                "graphs": len(stats.captured_budgets),
                "disabled": len(stats.disabled_budgets),
                "reserved_gib": torch.cuda.memory_reserved() / 1024**3,
                "fa4_cache": os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"),
            }
        ),
        flush=True,
    )


def one_start(tower: Path, cache: Path, compiled_blocks: bool, fa4_cache: bool) -> dict:
    cache_variables = ("FLASH_ATTENTION_CUTE_DSL_CACHE", "TORCHINDUCTOR_CACHE")
    environment = {name: value for name, value in os.environ.items() if not name.startswith(cache_variables)}
    if fa4_cache:
        environment["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"
        environment["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = str(cache / "flash_attn_cute")
    blocks = "on" if compiled_blocks else "off"
    command = [sys.executable, __file__, CHILD_FLAG, str(tower), str(cache), blocks]
    start = time.perf_counter()
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    wall_s = time.perf_counter() - start
    if finished.returncode != 0:
        raise RuntimeError(f"a start failed (exit {finished.returncode}):\n{finished.stderr[-3000:]}")
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    return {"process_s": wall_s, **result}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == CHILD_FLAG:
        child(sys.argv[2], sys.argv[3], sys.argv[4] == "on")
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=3, help="starts per setting; the first is cold")
    parser.add_argument("--compiled-blocks", default="off", choices=("on", "off"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from common import save_random_tower

    tower = save_random_tower(tempfile.mkdtemp(prefix="vitpool-startup-tower-"))
    compiled_blocks = args.compiled_blocks == "on"
    results = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "compiled_blocks": args.compiled_blocks,
        "settings": {},
    }
    for label, fa4_cache in (("FA4 disk cache on", True), ("defaults (FA4 kernels in memory)", False)):
        cache = Path(tempfile.mkdtemp(prefix="vitpool-startup-cache-"))
        starts = []
        for number in range(args.starts):
            row = one_start(tower, cache, compiled_blocks, fa4_cache)
            row["start"] = "cold" if number == 0 else "warm"
            starts.append(row)
            print(label, json.dumps(row), flush=True)
        results["settings"][label] = starts
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
    print(
        f"\nGPU: {results['gpu']}, torch {results['torch']}; compiled blocks {args.compiled_blocks}; "
        "each start a fresh process"
    )
    print("| setting | start | process s | build s | capture + check s | graphs | reserved GiB |")
    print("|---|---|---|---|---|---|---|")
    for label, starts in results["settings"].items():
        for row in starts:
            print(
                f"| {label} | {row['start']} | {row['process_s']:.1f} | {row['build_s']:.1f} "
                f"| {row['capture_s']:.1f} | {row['graphs']} | {row['reserved_gib']:.2f} |"
            )


if __name__ == "__main__":
    main()
