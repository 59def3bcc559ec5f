"""What the benchmarks share: the real-size Qwen3-VL-8B vision tower, item builders, timing."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vitpool import Image, Video

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11; the project supports 3.10

# Qwen/Qwen3-VL-8B-Instruct vision_config
QWEN3_VL_8B_VISION = {
    "model_type": "qwen3_vl_vision",
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 4096,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
ROW_WIDTH = 3 * 2 * 16 * 16
PATCH = 16


def software() -> dict[str, str | None]:
    """The versions a figure depends on, for its JSON: torch, transformers, cuDNN, and the cuDNN
    frontend (None where it does not import: packed attention then runs FA2) and Triton."""
    import importlib.metadata

    def version(distribution: str) -> str | None:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        import cudnn  # noqa: F401 - the frontend's module: whether it imports is the question

        frontend = version("nvidia-cudnn-frontend") or "imports"
    except ImportError:
        frontend = None
    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "cudnn": None if cudnn_version is None else str(cudnn_version),
        "cudnn_frontend": frontend,
        "triton": version("triton"),
    }


def image(pixels_side: int) -> Image:
    side = pixels_side // PATCH
    return Image(torch.randn(side * side, ROW_WIDTH), (1, side, side))


def video(frames: int, pixels_side: int) -> Video:
    side = pixels_side // PATCH
    t = frames // 2
    return Video(torch.randn(t * side * side, ROW_WIDTH), (t, side, side))


def write_config(directory: str | Path) -> Path:
    """A config-only checkpoint directory: vitpool builds the tower with random weights."""
    path = Path(directory)
    (path / "config.json").write_text(json.dumps(QWEN3_VL_8B_VISION))
    return path


def save_random_tower(directory: str | Path, seed: int = 0) -> Path:
    """A vision-tower-only safetensors checkpoint with random bf16 weights, so that several
    processes (the pool's actors and an in-process encoder) load the same weights."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(seed)
    config = Qwen3VLVisionConfig(**{k: v for k, v in QWEN3_VL_8B_VISION.items() if k != "model_type"})
    Qwen3VLVisionModel(config).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    return Path(directory)


def once_ms(function) -> float:
    """One call of `function`, the GPU synchronised after it, in ms."""
    start = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def time_ms(function, runs: int, warmup: int, synchronize: bool = True) -> list[float]:
    """`runs` timings of `function` in ms after `warmup` calls; with `synchronize`, each waits for
    the GPU (host-only timings leave it False, which also keeps CUDA uninitialised)."""
    for _ in range(warmup):
        function()
    if synchronize:
        torch.cuda.synchronize()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        if synchronize:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def padded_image_batch(adapter, rows: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pixels and metadata on the GPU for one square image padded to `rows` rows (a budget of
    rows // 4 tokens, at most 4 sequences): the inputs of one static forward, as captured."""
    from vitpool.packing import SEQUENCES, Budget

    side = 2 * int(rows**0.5 / 2)  # the rest of the rows are padding
    spec = adapter.item_rules.item_spec(
        "image", (side * side, *adapter.row_shape), "bfloat16", (1, side, side)
    )
    budget = Budget(rows // 4, ((SEQUENCES, 4),), 4)
    metadata = {k: v.cuda() for k, v in adapter.build_metadata([spec], rows, budget).items()}
    pixels = torch.randn(rows, *adapter.row_shape, device="cuda", dtype=torch.bfloat16)
    return pixels, metadata


def gpu_ms(function, runs: int, warmup: int = 5) -> list[float]:
    """`runs` GPU-side timings (CUDA events around each call) of `function` in ms after `warmup`."""
    samples = []
    for _ in range(warmup + runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples[warmup:]


def summarize(samples: list[float]) -> dict:
    """Median and p99 (nearest rank) of samples in ms."""
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "runs": len(ordered),
    }


class GpuBusy:
    """The share of time the GPUs ran a kernel while the block ran, as nvidia-smi samples it
    (`utilization.gpu`, every 100 ms): `busy` is the mean per GPU index, {} without nvidia-smi."""

    def __enter__(self) -> Self:
        import shutil
        import subprocess

        self.busy: dict[int, float] = {}
        command = [
            "nvidia-smi",
            "--query-gpu=index,utilization.gpu",
            "--format=csv,noheader,nounits",
            "-lms",
            "100",
        ]
        self._process = (
            subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            if shutil.which("nvidia-smi")
            else None
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        self._process.terminate()
        output, _ = self._process.communicate()
        samples: dict[int, list[float]] = {}
        for line in output.splitlines():
            index, _, value = line.partition(",")
            try:
                samples.setdefault(int(index), []).append(float(value))
            except ValueError:
                continue
        self.busy = {index: statistics.mean(values) / 100 for index, values in samples.items()}


def hugging_face_forwards(module: torch.nn.Module) -> None:
    """Give every submodule of a copy of the encoder's tower its class's own forward again, for a
    path that needs Hugging Face's code throughout: the adapter routed some modules through vitpool's
    wrappers per instance (packed attention, which cannot take Hugging Face's padding mask; compiled
    blocks; the fused patch convolution), and a deep copy keeps them. Once per module."""
    if module.__dict__.get("_hugging_face_forwards"):
        return
    for sub in module.modules():
        sub.__dict__.pop("forward", None)
    module.__dict__["_hugging_face_forwards"] = True
