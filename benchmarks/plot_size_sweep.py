"""Latency against image side (one image per side) from `size_sweep.py`'s JSON: Hugging Face eager,
HF under torch.compile(mode="reduce-overhead"), vitpool before and after issue 14 (with FA4), and
the default install (no FA4) after issue 42's first step beside its FA2-only baseline of the same run,
and issue 42's second step: the FA4 install and `precision="fp8"` (default install) of 2026-11-26;
written as a PNG beside benchmarks/RESULTS.md. The runs are of different days and machines (H100s):
compare lines of one run. Needs matplotlib (`pip install -e ".[bench]"`), a benchmark-only dependency.

    python benchmarks/plot_size_sweep.py [--before results/size_sweep_before.json] [--after ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).parent


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, default=HERE / "results" / "size_sweep_before.json")
    parser.add_argument("--after", type=Path, default=HERE / "results" / "size_sweep_after.json")
    parser.add_argument("--compiled", type=Path, default=HERE / "results" / "size_sweep_compiled_after.json")
    parser.add_argument(
        "--default-install", type=Path, default=HERE / "results" / "size_sweep_issue42_h100.json"
    )
    parser.add_argument("--fa4", type=Path, default=HERE / "results" / "size_sweep_fa4_issue42_h100.json")
    parser.add_argument("--fp8", type=Path, default=HERE / "results" / "size_sweep_fp8_issue42_h100.json")
    parser.add_argument("--out", type=Path, default=HERE / "size_sweep.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before, after, compiled = load(args.before), load(args.after), load(args.compiled)
    default, fa4, fp8 = load(args.default_install), load(args.fa4), load(args.fp8)
    figure, axis = plt.subplots(figsize=(7, 4.5))

    def plot(rows: list[dict], key: str, label: str, style: str) -> None:
        axis.plot([r["side"] for r in rows], [r[key]["median_ms"] for r in rows], style, label=label)

    plot(after["rows"], "hf_eager", "Hugging Face eager (sdpa)", "o-")
    plot(compiled["rows"], "hf_compiled", 'HF torch.compile("reduce-overhead")', "D")
    plot(before["rows"], "graph", "vitpool before (graphs to 4096 tokens, FA2)", "s--")
    plot(after["rows"], "graph", "vitpool after (fused ops, FA4, eager above 1024 tokens)", "^-")
    plot(default["rows"], "graph", "vitpool, default install (cuDNN attention), 2026-11-26", "v-")
    plot(default["rows"], "fa2", "the same run, FA2 only (the default install before)", "x:")
    plot(default["rows"], "hf_eager", "HF eager, same run as the default install", "o:")
    plot(fa4["rows"], "graph", "vitpool with FA4 (.[fa4]), 2026-11-26", "*-")
    plot(fp8["rows"], "fp8", 'vitpool precision="fp8", default install, 2026-11-26', "P--")
    axis.set_xlabel("image side (pixels), one image")
    axis.set_ylabel("latency, median ms")
    axis.set_title(f"Qwen3-VL-8B vision tower, {after['gpu']}, bf16")
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
