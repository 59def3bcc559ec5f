"""Latency of one encode per model family at its flagship's real size: Hugging Face eager (sdpa)
vs vitpool's GraphEncoder, same random bf16 weights, same run, on one GPU.

Each family's vision config is its flagship checkpoint's published one
(`benchmarks/flagship_vision_configs.json`, from the project's family notes). Both paths start from
the processor's output (float32 pixels on the host) and end with the tokens on the GPU,
synchronised; Hugging Face takes all of a call's items in one tower call, as `get_image_features`
does. Also reports the capture and check time of the device's default budgets.

    python benchmarks/family_latency.py [--families qwen2_vl,glm4v] [--runs 30] [--compiled] \
        [--out results.json]

`--compiled` also times Hugging Face's path under `torch.compile(mode="reduce-overhead")` (its own
CUDA graphs, where the shapes are fixed: the anchor for the tiled families). `--baseline-attention
fa2` also times a second encoder on the same adapter with that attention setting (before / after
in one run). `--fp8` also times an encoder with `precision="fp8"` on the same adapter and compares its
tokens with the bf16 encoder's: per-token cosine similarity (the lowest and the median) and the
relative error of the whole output.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import json
import logging
import tempfile
from pathlib import Path

import torch
from common import software, summarize, time_ms

from vitpool import GraphEncoder, Image, Video

CONFIGS = Path(__file__).with_name("flagship_vision_configs.json")
# Families whose benchmark path is a module of its own, `family_paths/<family>.py`: its
# VISION_MODEL_TYPE, PROJECTOR_FIELDS (what its tower-only config adds), workloads(vision_config)
# and hugging_face(module, items) (Hugging Face's own path over a call's items, on `module`, a copy
# of the encoder's tower module). Adding a family's benchmark touches only its file.
FAMILY_PATHS = sorted(path.stem for path in Path(__file__).with_name("family_paths").glob("[a-z]*.py"))
VISION_MODEL_TYPES = {
    "qwen2_vl": "qwen2_vl_vision",
    "qwen2_5_vl": "qwen2_5_vl_vision",
    "qwen2_5_omni": "qwen2_5_omni_vision_encoder",
    "qwen3_5": "qwen3_5_vision",
    "qwen4_exp": "qwen4_exp_vision",
    "qwen3_omni_moe": "qwen3_omni_moe_vision_encoder",
    "glm4v": "glm4v_vision",
    "glm_ocr": "glm_ocr_vision",
    "glm5_next": "glm5_next_vision",
    "kimi_k25": "kimi_k25_vision",
    "paddleocr_vl": "paddleocr_vl_vision",
    "internvl": "internvl_vision",
    "llama4": "llama4_vision_model",
    "step3p7": "step3p5_vision",
    "deepseek_ocr2": "deepseek_ocr2_vision",
    "minicpmv4_6": "minicpmv4_6_vision",
    "gemma3": "siglip_vision_model",
    "idefics3": "idefics3_vision",
}
# Families whose vitpool module holds the projector too: what their tower-only config adds (the
# flagship's LLM width and projector settings, from the config file's "extra").
PROJECTOR_FIELDS = {
    "kimi_k25": {"text_hidden_size": 7168, "projection_hidden_size": 1152, "projection_layer_norm_eps": 1e-5},
    "paddleocr_vl": {"text_hidden_size": 1024},
    # InternVL3.5-8B: Qwen3-8B's width; the releases' projector and feature selection
    "internvl": {
        "text_hidden_size": 4096,
        "downsample_ratio": 0.5,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
    },
    "llama4": {"text_hidden_size": 5120},  # Llama 4 Scout's LLM width
    "step3p7": {"text_hidden_size": 4096, "projector_bias": False},  # Step-3.7-Flash
    "deepseek_ocr2": {"text_hidden_size": 1280},  # DeepSeek-OCR-2's LLM width
    # MiniCPM-V 4.6: its LLM's width and the release's merge settings (not in the hub's vision config)
    "minicpmv4_6": {
        "text_hidden_size": 1024,
        "downsample_mode": "16x",
        "merge_kernel_size": [2, 2],
        "merger_times": 1,
        "insert_layer_id": 6,
    },
    "gemma3": {"text_hidden_size": 5376, "mm_tokens_per_image": 256},  # Gemma 3 27B's LLM width
    "idefics3": {"text_hidden_size": 4096, "scale_factor": 2},  # Idefics3-8B: Llama 3's width
}
# slices (h, w in patches) of one image as MiniCPM-V 4.6's processor cuts them: a 448² overview
# alone, or the overview and 6 slices of a ~1024² image
MINICPM_SLICES = {"1 slice": [(32, 32)], "7 slices": [(32, 32)] + [(40, 24)] * 6}
TILED = {"internvl", "llama4", "gemma3", "idefics3"}  # pixels are whole tiles [tiles, 3, S, S], no grid
# a large image's views: InternVL's 6 crops and thumbnail; Gemma 3's image and 4 pan-and-scan crops;
# Idefics3's 3x3 splits of a ~1024² image and its global image
MANY_VIEWS = {"gemma3": 5, "idefics3": 10}
# a global view and local crops, each a path of its own (Step-3.7: 728² view, 504² crops)
GLOBAL_AND_CROPS = {"step3p7": 504, "deepseek_ocr2": 768}
PATCH_ROWS = {"kimi_k25", "paddleocr_vl"}  # pixels are unflattened patches [rows, 3, P, P]
IMAGES_ONLY = {"paddleocr_vl"}


def family_path(family: str):
    """The family's own benchmark module (`family_paths/<family>.py`), or None."""
    return importlib.import_module(f"family_paths.{family}") if family in FAMILY_PATHS else None


for _family in FAMILY_PATHS:
    VISION_MODEL_TYPES[_family] = family_path(_family).VISION_MODEL_TYPE
    PROJECTOR_FIELDS[_family] = family_path(_family).PROJECTOR_FIELDS


def workloads(family: str, vision_config: dict) -> dict[str, list]:
    """Small, several small, large, and a video where the family takes one, at its patch size;
    for a tiled family one view, four one-view images, and one image of 7 views; for a family of
    a global view and crops one global view, four images of one, and one image of a global view
    and 6 crops."""
    if family_path(family) is not None:
        return family_path(family).workloads(vision_config)
    if family == "minicpmv4_6":  # the processor's strip [1, 3, P, N*P] and target_sizes, per image
        patch = vision_config["patch_size"]

        def image(sizes: list) -> Image:
            rows = sum(h * w for h, w in sizes)
            return Image(torch.randn(1, 3, patch, rows * patch), [list(size) for size in sizes])

        one = MINICPM_SLICES["1 slice"]
        return {
            "1 slice": [image(one)],
            "4x1 slice": [image(one) for _ in range(4)],
            "7 slices": [image(MINICPM_SLICES["7 slices"])],
        }
    if family in GLOBAL_AND_CROPS:
        size = vision_config.get("image_size") or vision_config["sam_config"]["image_size"]
        crop = GLOBAL_AND_CROPS[family]

        def view(crops: int) -> Image:
            local = {"pixel_values_local": torch.randn(crops, 3, crop, crop)} if crops else None
            return Image(torch.randn(1, 3, size, size), inputs=local)

        return {"1 view": [view(0)], "4x1 view": [view(0) for _ in range(4)], "1 view + 6 crops": [view(6)]}
    if family in TILED:
        size = vision_config["image_size"]
        size = size if isinstance(size, int) else size[0]  # InternVL writes [448, 448], Llama 4 336

        def tiles(count: int) -> Image:
            return Image(torch.randn(count, 3, size, size))

        many = MANY_VIEWS.get(family, 7)
        return {
            "1 view": [tiles(1)],
            "4x1 view": [tiles(1) for _ in range(4)],
            f"{many} views": [tiles(many)],
        }
    patch = vision_config["patch_size"]
    merge = vision_config.get("spatial_merge_size") or vision_config["merge_kernel_size"][0]
    row_shape = (3, patch, patch) if family in PATCH_ROWS else (3 * 2 * patch * patch,)
    # frames per temporal row: 2 for the Qwen and GLM towers; Kimi-K2.5 takes frames as they are
    # (at most pos_emb_time of them in one clip)
    frames_per_row = 1 if family == "kimi_k25" else 2

    def side(pixels: int) -> int:  # patches per side, a multiple of the merge size
        return max(merge, round(pixels / (patch * merge)) * merge)

    def image(pixels: int) -> Image:
        s = side(pixels)
        return Image(torch.randn(s * s, *row_shape), (1, s, s))

    def video(frames: int, pixels: int) -> Video:
        s, t = side(pixels), frames // frames_per_row
        return Video(torch.randn(t * s * s, *row_shape), (t, s, s))

    loads = {"1x224": [image(224)], "4x224": [image(224) for _ in range(4)], "1x1024": [image(1024)]}
    if family == "kimi_k25":
        loads["video 4x224"] = [video(4, 224)]
    elif family not in IMAGES_ONLY:
        loads["video 8x224"] = [video(8, 224)]
    return loads


def hugging_face_eager(family: str, module: torch.nn.Module, items: list) -> torch.Tensor:
    """All of a call's items in one tower call, as the model's get_image_features runs them."""
    if family_path(family) is not None:
        return family_path(family).hugging_face(module, items)
    if family == "minicpmv4_6":  # MiniCPMV4_6Model.get_image_features: one strip of every slice
        strip = torch.cat([item.pixel_values for item in items], dim=-1).to("cuda", torch.bfloat16)
        sizes = torch.tensor(
            [size for item in items for size in item.grid_thw], dtype=torch.int32, device="cuda"
        )
        hidden = module.vision_tower(strip, target_sizes=sizes, use_vit_merger=True).last_hidden_state
        return torch.cat(module.merger(hidden, sizes // 2))
    pixels = torch.cat([item.pixel_values for item in items]).to("cuda", torch.bfloat16)
    if family in GLOBAL_AND_CROPS:  # get_image_features: every global view in one call, every crop in another
        tower = module.vision_model if family == "step3p7" else module.vision_tower
        views = module.multi_modal_projector(tower(pixels).last_hidden_state)  # [views, tokens, width]
        if family == "deepseek_ocr2":  # each view's tokens, then the separator
            separators = module.view_separator.reshape(1, 1, -1).expand(views.shape[0], 1, -1)
            views = torch.cat([views, separators.to(views.dtype)], dim=1)
        views = views.reshape(-1, views.shape[-1])
        crops = [item.inputs["pixel_values_local"] for item in items if item.inputs]
        if not crops:
            return views
        local = torch.cat(crops).to("cuda", torch.bfloat16)
        crop_tokens = module.multi_modal_projector(tower(local).last_hidden_state)
        return torch.cat([crop_tokens.reshape(-1, views.shape[-1]), views])
    if family == "internvl":  # InternVLModel.get_image_features, with Hugging Face's own modules
        from transformers.models.internvl.modeling_internvl import InternVLModel

        hidden = module.vision_tower(pixel_values=pixels).last_hidden_state[:, 1:, :]
        side = int(hidden.shape[1] ** 0.5)
        shuffled = InternVLModel.pixel_shuffle(None, hidden.reshape(hidden.shape[0], side, side, -1), 0.5)
        tokens = module.multi_modal_projector(shuffled.reshape(hidden.shape[0], -1, shuffled.shape[-1]))
        return tokens.reshape(-1, tokens.shape[-1])
    if family in ("gemma3", "idefics3"):  # get_image_features: the tower, then the projector per view
        if family == "gemma3":
            features = module.multi_modal_projector(
                module.vision_tower(pixel_values=pixels).last_hidden_state
            )
        else:  # every split whole: the processor's splits have no padding (patch_attention_mask all ones)
            features = module.connector(module.vision_model(pixel_values=pixels).last_hidden_state)
        return features.reshape(-1, features.shape[-1])
    if family == "llama4":  # get_image_features, flattened and projected as the model's forward does
        features = module.vision_model(pixel_values=pixels).last_hidden_state
        return module.multi_modal_projector(features.reshape(-1, features.shape[-1]))
    rows = []
    for item in items:
        t, h, w = item.grid_thw
        rows.extend(
            [[1, h, w]] * t if family in ("glm4v", "glm_ocr", "glm5_next") else [[t, h, w]]
        )  # GLM: one row per frame
    grid = torch.tensor(rows, device="cuda")
    if family == "kimi_k25":
        return module.mm_projector(module.vision_tower(pixels, grid_thw=grid).pooler_output).squeeze(1)
    if family == "paddleocr_vl":
        hidden = module.visual(pixel_values=pixels.unsqueeze(0), grid_thw=grid).last_hidden_state
        return module.projector(hidden, grid)
    return module(pixels, grid_thw=grid).pooler_output


def flagship_encoder(
    family: str,
    vision_config: dict,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    **options: object,
) -> GraphEncoder:
    """vitpool's encoder of `family` from `vision_config` (a flagship's, or a cut-down copy) and what
    its tower-only config adds (PROJECTOR_FIELDS), with random weights (seed 0) and the parameters
    that start at zero given random values (`randomize_zero_parameters`)."""
    config = {**vision_config, **PROJECTOR_FIELDS.get(family, {}), "model_type": VISION_MODEL_TYPES[family]}
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(config))
        torch.manual_seed(0)
        encoder = GraphEncoder.from_pretrained(directory, device=device, dtype=dtype, **options)
    randomize_zero_parameters(encoder.adapter.tower)
    return encoder


def randomize_zero_parameters(module: torch.nn.Module) -> None:
    """Random values, in place, for the parameters that start at zero when no weights are loaded
    (Gemma 3's `mm_input_projection_weight`): else both paths give all-zero tokens and the
    comparison says nothing. The graphs read the parameters' own memory, so they see the change; a
    kernel that kept a copy would show as a large rel. error."""
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.is_floating_point() and not parameter.any():
                parameter.normal_(std=parameter.shape[-1] ** -0.5)


def use_sdpa(module: torch.nn.Module) -> torch.nn.Module:
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = "sdpa"
    return module


def measure(
    family: str,
    vision_config: dict,
    runs: int,
    warmup: int,
    compiled: bool = False,
    compiled_blocks: bool = False,
    only: set[str] | None = None,
    baseline_attention: str | None = None,
    fp8: bool = False,
) -> dict:
    gc.collect()  # the previous family's encoder and reference, held by reference cycles
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    encoder = flagship_encoder(family, vision_config, compiled_blocks=compiled_blocks)
    torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in encoder.adapter.tower.parameters())
    # the encoder's memory once captured: weights, static buffers and the graphs' pool
    memory = {
        "weights_gib": weights / 2**30,
        "after_capture_gib": (torch.cuda.memory_allocated() - before) / 2**30,
    }
    stats = encoder.stats()
    baseline = None
    if baseline_attention is not None:
        baseline = GraphEncoder(
            encoder.adapter,
            device="cuda",
            dtype=torch.bfloat16,
            compiled_blocks=compiled_blocks,
            attention=baseline_attention,
        )
    fp8_encoder = None
    if fp8:
        fp8_encoder = GraphEncoder(encoder.adapter, device="cuda", dtype=torch.bfloat16, precision="fp8")
    reference = use_sdpa(copy.deepcopy(encoder.adapter.tower))
    rows = {}
    with torch.no_grad():
        for name, items in workloads(family, vision_config).items():
            if only and name not in only:
                continue
            got = torch.cat([e.tokens for e in encoder.encode(items)]).float()
            want = hugging_face_eager(family, reference, items).float()
            rel_error = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
            eager = summarize(
                time_ms(lambda items=items: hugging_face_eager(family, reference, items), runs, warmup)
            )
            graph = summarize(time_ms(lambda items=items: encoder.encode(items), runs, warmup))
            rows[name] = {
                # rows of pixels (patches, tiles or crops; a family_paths/ family's items vary in form:
                # its tokens)
                "patches": got.shape[0]
                if family_path(family) is not None
                else sum(item.pixel_values.shape[0] for item in items if family != "minicpmv4_6")
                + sum(tensor.shape[0] for item in items for tensor in (item.inputs or {}).values()),
                "hf_eager": eager,
                "vitpool": graph,
                "ratio": graph["median_ms"] / eager["median_ms"],
                "rel_error": rel_error,
            }
            if fp8_encoder is not None:
                low = torch.cat([e.tokens for e in fp8_encoder.encode(items)]).float()
                low_ms = time_ms(lambda items=items: fp8_encoder.encode(items), runs, warmup)
                rows[name]["fp8"] = summarize(low_ms)
                rows[name]["fp8_speedup"] = graph["median_ms"] / rows[name]["fp8"]["median_ms"]
                rows[name]["fp8_accuracy"] = fp8_accuracy(low, got)
            if baseline is not None:
                rows[name]["baseline"] = summarize(
                    time_ms(lambda items=items: baseline.encode(items), runs, warmup)
                )
                rows[name]["baseline_ratio"] = rows[name]["baseline"]["median_ms"] / eager["median_ms"]
            if compiled:
                torch._dynamo.reset()
                fast = torch.compile(hugging_face_eager, mode="reduce-overhead")
                try:
                    rows[name]["hf_compiled"] = summarize(
                        time_ms(lambda items=items, fast=fast: fast(family, reference, items), runs, warmup)
                    )
                    rows[name]["ratio_compiled"] = graph["median_ms"] / rows[name]["hf_compiled"]["median_ms"]
                except Exception as error:  # noqa: BLE001 - a tower torch.compile cannot take is a result
                    rows[name]["hf_compile_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    result = {
        "family": family,
        "params_m": sum(p.numel() for p in encoder.adapter.tower.parameters()) / 1e6,
        "capture_s": stats.capture_seconds,
        "budgets": len(encoder.budgets),
        "memory": memory,
        "disabled_budgets": stats.disabled_budgets,
        "workloads": rows,
    }
    return result


def fp8_accuracy(low: torch.Tensor, high: torch.Tensor) -> dict:
    """FP8 tokens against bf16 ones: per-token cosine similarity and the whole output's relative error."""
    width = high.shape[-1]
    cosine = torch.nn.functional.cosine_similarity(low.reshape(-1, width), high.reshape(-1, width), dim=-1)
    return {
        "cosine_min": float(cosine.min()),
        "cosine_median": float(cosine.median()),
        "rel_error": float(torch.linalg.vector_norm(low - high) / torch.linalg.vector_norm(high)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default=",".join(VISION_MODEL_TYPES))
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--compiled", action="store_true", help="also time HF under torch.compile (reduce-overhead)"
    )
    parser.add_argument("--compiled-blocks", action="store_true", help="vitpool with compiled_blocks=True")
    parser.add_argument(
        "--workloads", default=None, help='comma-separated workload names (e.g. "1 view"); default all'
    )
    parser.add_argument(
        "--baseline-attention", default=None, help="also time an encoder with this attention (fa2)"
    )
    parser.add_argument(
        "--fp8", action="store_true", help="also time precision='fp8' and compare it with bf16"
    )
    args = parser.parse_args()
    unknown = sorted(set(args.families.split(",")) - set(VISION_MODEL_TYPES))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(VISION_MODEL_TYPES)}")
    logging.basicConfig(level=logging.WARNING)
    configs = json.loads(CONFIGS.read_text())
    gpu = torch.cuda.get_device_name()
    results = {
        "gpu": gpu,
        **software(),
        "runs": args.runs,
        "compiled_blocks": args.compiled_blocks,
        "families": [],
    }
    failed = {}
    for family in args.families.split(","):
        try:
            results["families"].append(
                measure(
                    family,
                    configs[family]["vision_config"],
                    args.runs,
                    args.warmup,
                    args.compiled,
                    args.compiled_blocks,
                    set(args.workloads.split(",")) if args.workloads else None,
                    args.baseline_attention,
                    args.fp8,
                )
            )
        except Exception as error:  # one family's failure is its result; the others still run
            logging.exception("family %s failed", family)  # noqa: LOG015 - a script: basicConfig's root logger
            failed[family] = f"{type(error).__name__}: {str(error)[:500]}"
            results["failed"] = failed
        torch.cuda.empty_cache()  # the family's encoder and reference are gone: give their memory back
        if args.out:
            args.out.write_text(json.dumps(results, indent=2))
    print(
        f"\nGPU: {gpu}; median (p99) ms of {args.runs} runs after {args.warmup} warm-up; "
        f"ratio = vitpool / HF eager; {', '.join(f'{k} {v}' for k, v in software().items())}"
    )
    for result in results["families"]:
        memory = result["memory"]
        print(
            f"{result['family']}: capture and check {result['capture_s']:.1f} s "
            f"for {result['budgets']} budgets; "
            f"GPU memory after capture {memory['after_capture_gib']:.2f} GiB "
            f"(weights {memory['weights_gib']:.2f})"
        )
    print(
        "| family (vision params) | capture s (budgets) | workload | patches | HF eager | vitpool | ratio "
        "| rel. err |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for result in results["families"]:
        for number, (name, row) in enumerate(result["workloads"].items()):
            head = (
                (
                    f"{result['family']} ({result['params_m']:.0f}M) "
                    f"| {result['capture_s']:.1f} ({result['budgets']}, "
                    f"{len(result['disabled_budgets'])} disabled)"
                )
                if number == 0
                else " | "
            )
            print(
                f"| {head} | {name} | {row['patches']} | {row['hf_eager']['median_ms']:.2f} "
                f"({row['hf_eager']['p99_ms']:.2f}) "
                f"| {row['vitpool']['median_ms']:.2f} ({row['vitpool']['p99_ms']:.2f}) "
                f"| {row['ratio']:.2f} | {row['rel_error']:.1e} |"
                + (
                    f" HF compiled {row['hf_compiled']['median_ms']:.2f} "
                    f"({row['hf_compiled']['p99_ms']:.2f}), "
                    f"ratio {row['ratio_compiled']:.2f} |"
                    if "hf_compiled" in row
                    else ""
                )
                + (
                    f" HF compile failed: {row['hf_compile_error'][:120]} |"
                    if "hf_compile_error" in row
                    else ""
                )
                + (
                    f" {args.baseline_attention}: {row['baseline']['median_ms']:.2f} "
                    f"({row['baseline']['p99_ms']:.2f}), "
                    f"ratio {row['baseline_ratio']:.2f} |"
                    if "baseline" in row
                    else ""
                )
                + (
                    f" fp8: {row['fp8']['median_ms']:.2f} ({row['fp8']['p99_ms']:.2f}), "
                    f"{row['fp8_speedup']:.2f}x bf16, "
                    f"cosine min {row['fp8_accuracy']['cosine_min']:.4f} "
                    f"median {row['fp8_accuracy']['cosine_median']:.4f}, "
                    f"rel. err {row['fp8_accuracy']['rel_error']:.1e} |"
                    if "fp8" in row
                    else ""
                )
            )
    for family, error in failed.items():
        print(f"{family}: failed: {error}")


if __name__ == "__main__":
    main()
