"""An encoder beside another CUDA-graph user in one process: the sequence of
`shared/repro/compile_then_encode.py` (issue 27), timed and checked.

Real-size Qwen3-VL-8B vision config (random bf16 weights) and a one-layer LLM of the real width:
an encoder built and dropped (`--throwaway drop`; `keep` keeps it, `none` builds none), a second
encoder from the saved model, then per workload HF eager, for 1x224 also HF under
`torch.compile(mode=--mode)` put back after, and vitpool's encode: median and p99 of --runs
after warm-up, and vitpool's largest relative error against HF eager (bf16) with a finiteness
check. Before the fix in `vitpool/graphs/capture.py` (`_workspace_in_graph_pool`) the 1x1024
encode faulted ("unspecified launch failure") on an H100.

    python benchmarks/studies/compile_beside_encoder.py [--throwaway drop|keep|none] [--fused 0|1]
        [--mode reduce-overhead|default] [--runs 50] [--json out.json]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import torch
from common import QWEN3_VL_8B_VISION
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

import vitpool

# a one-layer LLM of Qwen3-VL-8B's width: only its vision tower is timed
TEXT = {
    "hidden_size": 4096,
    "num_hidden_layers": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 1024,
    "vocab_size": 512,
    "head_dim": 128,
}


def items(count: int, side: int, seed: int) -> list[tuple[tuple[int, int, int], torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    h = w = side // 16
    return [((1, h, w), torch.randn(h * w, 3 * 2 * 16 * 16, generator=generator)) for _ in range(count)]


@torch.no_grad()
def hf_features(model, batch):
    pixels = torch.cat([p for _, p in batch]).to("cuda", torch.bfloat16)
    grid = torch.tensor([g for g, _ in batch], device="cuda")
    return model.model.get_image_features(pixels, grid)


def timed(fn, runs: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))],
    }


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--throwaway", choices=["none", "drop", "keep"], default="drop")
    parser.add_argument("--fused", type=int, default=1, help="the encoders' fused_ops")
    parser.add_argument("--mode", default="reduce-overhead", help="torch.compile mode of the HF model")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args()
    settings = {"device": "cuda", "dtype": torch.bfloat16, "fused_ops": bool(args.fused)}

    config = Qwen3VLConfig(text_config=TEXT, vision_config=QWEN3_VL_8B_VISION)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration(config)
    model = model.to(torch.bfloat16).eval()
    directory = tempfile.mkdtemp()
    kept = None
    if args.throwaway != "none":
        model.config.save_pretrained(directory + "/config-only")
        throwaway = vitpool.GraphEncoder.from_pretrained(directory + "/config-only", **settings)
        kept = throwaway if args.throwaway == "keep" else None
        del throwaway
    model.save_pretrained(directory + "/full", safe_serialization=True)
    encoder = vitpool.GraphEncoder.from_pretrained(directory + "/full", **settings)
    print("settings", vars(args), "torch", torch.__version__, torch.cuda.get_device_name(), flush=True)

    results: dict[str, dict] = {}
    for name, batch in {
        "1x224": items(1, 224, 1),
        "4x224": items(4, 224, 1),
        "1x1024": items(1, 1024, 1),
    }.items():
        expected = hf_features(model, batch).pooler_output
        results[f"{name} hf_eager"] = timed(lambda batch=batch: hf_features(model, batch), args.runs)
        if name == "1x224":
            torch._dynamo.reset()
            original = model.model.get_image_features
            model.model.get_image_features = torch.compile(original, mode=args.mode)
            results[f"{name} hf_compiled"] = timed(lambda batch=batch: hf_features(model, batch), args.runs)
            model.model.get_image_features = original
        images = [vitpool.Image(pixels, grid) for grid, pixels in batch]
        embeddings = encoder.encode(images)
        results[f"{name} vitpool"] = {
            **timed(lambda images=images: encoder.encode(images), args.runs),
            "max_relative_error_vs_hf": max(
                relative_error(e.tokens, t) for e, t in zip(embeddings, expected)
            ),
            "finite": all(bool(torch.isfinite(e.tokens).all()) for e in embeddings),
        }
        for key in [k for k in results if k.startswith(name)]:
            print(
                key,
                {k: round(v, 4) if isinstance(v, float) else v for k, v in results[key].items()},
                flush=True,
            )
    stats = encoder.stats()
    print(f"passed; graph items {stats.graph_items}, eager items {stats.eager_items}", flush=True)
    del kept
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "settings": vars(args),
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "results": results,
                },
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()
