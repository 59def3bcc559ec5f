"""Latency of one encode per model family at its flagship's real size: Hugging Face eager (sdpa)
vs vitpool's GraphEncoder, same random bf16 weights, same run, on one GPU.

Each family's vision config is its flagship checkpoint's published one
(`benchmarks/flagship_vision_configs.json`, from the project's family notes). Both paths start from
the processor's output (float32 pixels on the host) and end with the tokens on the GPU,
synchronised; Hugging Face takes all of a call's items in one tower call, as `get_image_features`
does. Also reports the capture and check time of the device's default budgets.

    python benchmarks/family_latency.py [--families qwen2_vl,glm4v] [--runs 30] [--out results.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import tempfile
from pathlib import Path

import torch
from common import summarize, time_ms

from vitpool import GraphEncoder, Image, Video

CONFIGS = Path(__file__).with_name("flagship_vision_configs.json")
VISION_MODEL_TYPES = {
    "qwen2_vl": "qwen2_vl_vision",
    "qwen2_5_vl": "qwen2_5_vl_vision",
    "qwen3_5": "qwen3_5_vision",
    "glm4v": "glm4v_vision",
}


def workloads(patch: int, merge: int) -> dict[str, list]:
    """Small, several small, large, and a video, at this family's patch size."""
    row_width = 3 * 2 * patch * patch

    def side(pixels: int) -> int:  # patches per side, a multiple of the merge size
        return max(merge, round(pixels / (patch * merge)) * merge)

    def image(pixels: int) -> Image:
        s = side(pixels)
        return Image(torch.randn(s * s, row_width), (1, s, s))

    def video(frames: int, pixels: int) -> Video:
        s, t = side(pixels), frames // 2
        return Video(torch.randn(t * s * s, row_width), (t, s, s))

    return {
        "1x224": [image(224)],
        "4x224": [image(224) for _ in range(4)],
        "1x1024": [image(1024)],
        "video 8x224": [video(8, 224)],
    }


def hugging_face_eager(tower: torch.nn.Module, items: list, per_frame_grid: bool) -> torch.Tensor:
    pixels = torch.cat([item.pixel_values for item in items]).to("cuda", torch.bfloat16)
    rows = []
    for item in items:
        t, h, w = item.grid_thw
        rows.extend([[1, h, w]] * t if per_frame_grid else [[t, h, w]])  # GLM: one row per frame
    return tower(pixels, grid_thw=torch.tensor(rows, device="cuda")).pooler_output


def measure(family: str, vision_config: dict, runs: int, warmup: int) -> dict:
    config = {**vision_config, "model_type": VISION_MODEL_TYPES[family]}
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(config))
        torch.manual_seed(0)
        encoder = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    stats = encoder.stats()
    reference = copy.deepcopy(encoder.adapter.tower)
    reference.config._attn_implementation = "sdpa"
    per_frame_grid = family == "glm4v"
    rows = {}
    with torch.no_grad():
        for name, items in workloads(vision_config["patch_size"], vision_config["spatial_merge_size"]).items():
            got = torch.cat([e.tokens for e in encoder.encode(items)]).float()
            want = hugging_face_eager(reference, items, per_frame_grid).float()
            rel_error = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
            eager = summarize(time_ms(lambda items=items: hugging_face_eager(reference, items, per_frame_grid),
                                      runs, warmup))
            graph = summarize(time_ms(lambda items=items: encoder.encode(items), runs, warmup))
            rows[name] = {
                "patches": sum(item.pixel_values.shape[0] for item in items),
                "hf_eager": eager, "vitpool": graph, "ratio": graph["median_ms"] / eager["median_ms"],
                "rel_error": rel_error,
            }
    result = {
        "family": family, "params_m": sum(p.numel() for p in encoder.adapter.tower.parameters()) / 1e6,
        "capture_s": stats.capture_seconds, "budgets": len(encoder.budgets),
        "disabled_budgets": stats.disabled_budgets, "workloads": rows,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default=",".join(VISION_MODEL_TYPES))
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    configs = json.loads(CONFIGS.read_text())
    gpu = torch.cuda.get_device_name()
    results = {"gpu": gpu, "torch": torch.__version__, "runs": args.runs, "families": []}
    for family in args.families.split(","):
        results["families"].append(measure(family, configs[family]["vision_config"], args.runs, args.warmup))
        torch.cuda.empty_cache()  # the family's encoder and reference are gone: give their memory back
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
    print(f"\nGPU: {gpu}; median (p99) ms of {args.runs} runs after {args.warmup} warm-up; ratio = vitpool / HF eager")
    print("| family (vision params) | capture s (budgets) | workload | patches | HF eager | vitpool | ratio | rel. err |")
    print("|---|---|---|---|---|---|---|---|")
    for result in results["families"]:
        for number, (name, row) in enumerate(result["workloads"].items()):
            head = (f"{result['family']} ({result['params_m']:.0f}M) | {result['capture_s']:.1f} ({result['budgets']}, "
                    f"{len(result['disabled_budgets'])} disabled)") if number == 0 else " | "
            print(f"| {head} | {name} | {row['patches']} | {row['hf_eager']['median_ms']:.2f} "
                  f"({row['hf_eager']['p99_ms']:.2f}) | {row['vitpool']['median_ms']:.2f} ({row['vitpool']['p99_ms']:.2f}) "
                  f"| {row['ratio']:.2f} | {row['rel_error']:.1e} |")


if __name__ == "__main__":
    main()
