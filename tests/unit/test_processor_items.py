"""The README's processor table, tested: every family's Hugging Face image processor (PIL backend,
built offline from its class) and video processor emit outputs that become vitpool items with no
reshaping, one item per row of the grid tensor and its t*h*w rows of pixels; the family's item
rules (built from the processor's patch, merge and temporal sizes, which must be the family's
vision config's) accept them and count the tokens that the family's HF processor puts in the
prompt for them.

transformers 5.23's video processors and Kimi-K2.5's image processor exist only for the
torchvision backend: those cases skip where torchvision is not installed.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from vitpool import GraphEncoder, Image, InvalidItemError, Video
from vitpool.families.kimi_k25.rules import KimiK25Rules
from vitpool.families.qwen2_5_vl.rules import WindowedMergeRules
from vitpool.items import prepare_items
from vitpool.rules.grids import SpatialMergeRules
from vitpool.specs import IMAGE, VIDEO

PILImage = pytest.importorskip("PIL.Image")

OUTPUT_WIDTH = 8  # the rules' output widths play no part in checking an item
QWEN3_SETTINGS = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}  # Qwen3-VL's, Qwen3.5's


@dataclass(frozen=True)
class Processor:
    """A Hugging Face processor class, by module and name, and the keyword arguments it is built with."""

    module: str
    name: str
    kwargs: dict = field(default_factory=dict)
    needs_torchvision: bool = False

    def build(self) -> Any:
        if self.needs_torchvision:
            pytest.importorskip("torchvision", reason=f"{self.name} exists only for the torchvision backend")
        return getattr(importlib.import_module(f"transformers.models.{self.module}"), self.name)(
            **self.kwargs
        )


@dataclass(frozen=True)
class Case:
    """One family as the README's table gives it."""

    family: str
    vision_config: tuple[str, str]  # module and class of its vision config (the tower's sizes)
    image_processor: Processor
    video_processor: Processor | None
    rules: Callable[[Any, Any], Any]  # (image processor, vision config) -> the family's item rules
    video_frames: int = 4


def qwen(vision_module: str, vision_class: str, image_kwargs: dict, video: str, video_module: str) -> dict:
    return {
        "vision_config": (vision_module, vision_class),
        "image_processor": Processor(
            "qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil", image_kwargs
        ),
        "video_processor": Processor(
            video_module, video, {"do_sample_frames": False}, needs_torchvision=True
        ),
    }


def spatial_merge_rules(processor: Any, config: Any) -> SpatialMergeRules:
    row_width = 3 * processor.temporal_patch_size * processor.patch_size**2
    return SpatialMergeRules(row_width, processor.merge_size, ((OUTPUT_WIDTH,),))


def windowed_rules(processor: Any, config: Any) -> WindowedMergeRules:
    window_tokens = config.window_size // processor.merge_size // processor.patch_size
    row_width = 3 * processor.temporal_patch_size * processor.patch_size**2
    return WindowedMergeRules(
        row_width, processor.merge_size, ((OUTPUT_WIDTH,),), window_tokens=window_tokens
    )


def kimi_rules(processor: Any, config: Any) -> KimiK25Rules:
    merge = (processor.merge_size, processor.merge_size)
    return KimiK25Rules(3, processor.patch_size, merge, int(config.pos_emb_time), OUTPUT_WIDTH)


def paddleocr_rules(processor: Any, config: Any) -> Any:
    rules = pytest.importorskip("vitpool.families.paddleocr_vl.rules")
    return rules.PaddleOCRVLRules(
        channels=3 * processor.temporal_patch_size,
        patch_size=processor.patch_size,
        merge_size=processor.merge_size,
        output_width=OUTPUT_WIDTH,
    )


QWEN3_VL = ("qwen3_vl.configuration_qwen3_vl", "Qwen3VLVisionConfig")
QWEN3_VIDEO = ("Qwen3VLVideoProcessor", "qwen3_vl.video_processing_qwen3_vl")
QWEN2_VIDEO = ("Qwen2VLVideoProcessor", "qwen2_vl.video_processing_qwen2_vl")

CASES = [
    Case("qwen3_vl", rules=spatial_merge_rules, **qwen(*QWEN3_VL, QWEN3_SETTINGS, *QWEN3_VIDEO)),
    Case(
        "qwen3_5",
        rules=spatial_merge_rules,
        **qwen("qwen3_5.configuration_qwen3_5", "Qwen3_5VisionConfig", QWEN3_SETTINGS, *QWEN3_VIDEO),
    ),
    Case(
        "qwen2_5_vl",
        rules=windowed_rules,
        **qwen("qwen2_5_vl.configuration_qwen2_5_vl", "Qwen2_5_VLVisionConfig", {}, *QWEN2_VIDEO),
    ),
    Case(
        "qwen2_vl",
        rules=spatial_merge_rules,
        **qwen("qwen2_vl.configuration_qwen2_vl", "Qwen2VLVisionConfig", {}, *QWEN2_VIDEO),
    ),
    Case(
        "glm4v",  # GLM-4.1V and GLM-4.5V
        vision_config=("glm4v.configuration_glm4v", "Glm4vVisionConfig"),
        image_processor=Processor("glm4v.image_processing_pil_glm4v", "Glm4vImageProcessorPil"),
        video_processor=Processor(
            "glm4v.video_processing_glm4v",
            "Glm4vVideoProcessor",
            {"do_sample_frames": False},
            needs_torchvision=True,
        ),
        rules=spatial_merge_rules,
    ),
    Case(
        "glm46v",  # GLM-4.6V
        vision_config=("glm4v.configuration_glm4v", "Glm4vVisionConfig"),
        image_processor=Processor("glm46v.image_processing_pil_glm46v", "Glm46VImageProcessorPil"),
        video_processor=Processor(
            "glm46v.video_processing_glm46v",
            "Glm46VVideoProcessor",
            {"do_sample_frames": False},
            needs_torchvision=True,
        ),
        rules=spatial_merge_rules,
    ),
    Case(
        "kimi_k25",
        vision_config=("kimi_k25.configuration_kimi_k25", "Kimi_K25VisionConfig"),
        image_processor=Processor(
            "kimi_k25.image_processing_kimi_k25", "Kimi_K25ImageProcessor", needs_torchvision=True
        ),
        video_processor=Processor(
            "kimi_k25.video_processing_kimi_k25",
            "Kimi_K25VideoProcessor",
            {"do_sample_frames": False},
            needs_torchvision=True,
        ),
        rules=kimi_rules,
        video_frames=6,  # chunks of 4 frames: one clip of 6 frames is two items, t = 4 and t = 2
    ),
    Case(
        "paddleocr_vl",
        vision_config=("paddleocr_vl.configuration_paddleocr_vl", "PaddleOCRVisionConfig"),
        image_processor=Processor(
            "paddleocr_vl.image_processing_pil_paddleocr_vl", "PaddleOCRVLImageProcessorPil"
        ),
        video_processor=None,  # images only: its processor has no video path
        rules=paddleocr_rules,
    ),
]
PADDLEOCR_VL = CASES[-1]
VIDEO_CASES = [case for case in CASES if case.video_processor is not None]


def vision_config(case: Case) -> Any:
    module, name = case.vision_config
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)()


def picture(width: int, height: int, seed: int) -> Any:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return PILImage.fromarray(pixels)


def items_of(item_class: type, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list:
    """The README's rule: one item per row of the grid, with the next t*h*w rows of the pixels."""
    rows = grid_thw.prod(-1).tolist()
    assert sum(rows) == pixel_values.shape[0], "every pixel row belongs to one grid row"
    return [item_class(pixels, grid) for pixels, grid in zip(pixel_values.split(rows), grid_thw)]


def processor_tokens(case: Case, modality: str, grid: list[int], merge_size: int) -> int:
    """The placeholder tokens that the family's HF processor puts in the prompt for one grid row
    (`processing_<family>.py`): the grid's product over merge², except Kimi-K2.5's clips, whose
    frames are pooled into one frame's tokens per chunk."""
    t, h, w = grid
    if case.family == "kimi_k25" and modality == VIDEO:
        return h * w // merge_size**2
    return t * h * w // merge_size**2


def check_items(case: Case, items: list, modality: str, processor: Any, outputs_pixels: torch.Tensor) -> None:
    rules = case.rules(processor, vision_config(case))
    prepared = prepare_items(items, rules)  # the pool's own check, as each caller runs it
    assert torch.equal(torch.cat([item.pixels for item in prepared]), outputs_pixels)
    for item, spec in zip(items, (p.spec for p in prepared)):
        grid = item.grid_thw.tolist()
        assert spec.modality == modality
        assert spec.layout == tuple(grid)
        assert spec.pixel_shape == tuple(item.pixel_values.shape)
        assert spec.num_tokens == processor_tokens(case, modality, grid, processor.merge_size)


@pytest.mark.parametrize("case", CASES, ids=[case.family for case in CASES])
def test_the_processors_sizes_are_the_towers(case):
    """A processor built as the table says cuts the patches the family's tower takes."""
    processor, config = case.image_processor.build(), vision_config(case)
    assert processor.patch_size == config.patch_size
    if case.family == "kimi_k25":
        assert (processor.merge_size, processor.merge_size) == tuple(config.merge_kernel_size)
    else:
        assert processor.merge_size == config.spatial_merge_size
        tower_temporal = getattr(config, "temporal_patch_size", 1)  # PaddleOCR-VL's tower has none
        assert processor.temporal_patch_size == tower_temporal


@pytest.mark.parametrize("case", CASES, ids=[case.family for case in CASES])
def test_image_processor_outputs_are_items(case):
    processor = case.image_processor.build()
    images = [picture(100, 80, seed=0), picture(60, 90, seed=1)]
    out = processor(images=images, return_tensors="pt")
    grid_thw = out["image_grid_thw"]
    assert grid_thw.shape == (2, 3) and grid_thw[:, 0].tolist() == [1, 1]

    # one image: the whole output is the item, as the README's snippet builds it
    single = processor(images=images[0], return_tensors="pt")
    check_items(
        case,
        [Image(single["pixel_values"], single["image_grid_thw"][0])],
        IMAGE,
        processor,
        single["pixel_values"],
    )
    # a batch: one item per row of image_grid_thw
    items = items_of(Image, out["pixel_values"], grid_thw)
    check_items(case, items, IMAGE, processor, out["pixel_values"])
    torch.testing.assert_close(items[0].pixel_values, single["pixel_values"])


@pytest.mark.parametrize("case", VIDEO_CASES, ids=[case.family for case in VIDEO_CASES])
def test_video_processor_outputs_are_items(case):
    processor = case.video_processor.build()
    image_processor = case.image_processor.build()
    for name in ("patch_size", "merge_size"):
        assert getattr(processor, name) == getattr(image_processor, name)
    frames = case.video_frames
    videos = [
        [picture(100, 80, seed=10 + frame) for frame in range(frames)],
        [picture(60, 90, seed=20 + frame) for frame in range(frames)],
    ]
    out = processor(videos=videos, return_tensors="pt")
    grid_thw = out["video_grid_thw"]
    if case.family == "kimi_k25":
        # a clip is cut into chunks of temporal_patch_size frames, one grid row (and item) each
        chunk = processor.temporal_patch_size
        assert torch.as_tensor(out["num_chunks_per_video"]).tolist() == [-(-frames // chunk)] * 2
        assert grid_thw[:, 0].tolist() == [chunk, frames - chunk] * 2
    else:
        assert grid_thw[:, 0].tolist() == [frames // processor.temporal_patch_size] * 2
    items = items_of(Video, out["pixel_values_videos"], grid_thw)
    check_items(case, items, VIDEO, processor, out["pixel_values_videos"])


def test_paddleocr_vl_has_no_video_item():
    processor = PADDLEOCR_VL.image_processor.build()
    rules = paddleocr_rules(processor, vision_config(PADDLEOCR_VL))
    out = processor(images=picture(100, 80, seed=0), return_tensors="pt")
    with pytest.raises(InvalidItemError, match="images only"):
        prepare_items([Video(out["pixel_values"], out["image_grid_thw"][0])], rules)


# The README's snippet (the python block after its marker), from a PIL image to pool.encode.

README = Path(__file__).resolve().parents[2] / "README.md"
SNIPPET_MARKER = "<!-- readme-snippet: processor-to-pool -->"


def readme_snippet() -> str:
    """The fenced python block that follows the marker in README.md."""
    text = README.read_text()
    assert SNIPPET_MARKER in text, f"README.md has no {SNIPPET_MARKER}"
    after = text.split(SNIPPET_MARKER, 1)[1].lstrip("\n")
    assert after.startswith("```python\n"), "the marker must be followed by a ```python block"
    return after.removeprefix("```python\n").split("\n```", 1)[0] + "\n"


class InProcessPool:
    """`EncoderPool`'s launch (as a context manager) and encode, on a GraphEncoder in this process:
    the snippet without a Ray cluster (tests/integration/test_readme_snippet.py runs it with one)."""

    launched: ClassVar[list[dict]] = []

    def __init__(self, encoder: GraphEncoder) -> None:
        self.encoder = encoder

    @classmethod
    def launch(cls, model: Any = None, **kwargs: Any) -> contextlib.AbstractContextManager[InProcessPool]:
        cls.launched.append({"model": model, **kwargs})
        return contextlib.nullcontext(
            cls(GraphEncoder.from_pretrained(model, device="cpu", dtype=torch.float32))
        )

    def encode(self, items: list) -> list:
        return self.encoder.encode(items)


def test_the_readme_snippet_puts_the_processor_outputs_into_an_item(monkeypatch, capsys):
    import vitpool

    # in vitpool's namespace itself, so that looking the pool up imports no Ray
    monkeypatch.setitem(vitpool.__dict__, "EncoderPool", InProcessPool)
    namespace: dict[str, Any] = {}
    exec(compile(readme_snippet(), str(README), "exec"), namespace)  # noqa: S102 (the README's own code)
    out = namespace["out"]
    # the shapes its comments give, and the shipped tower's output for 1200 rows / 4
    assert tuple(out["pixel_values"].shape) == (1200, 1536)
    assert out["image_grid_thw"].tolist() == [[1, 30, 40]]
    assert capsys.readouterr().out.strip().splitlines()[-1] == "(300, 128) 2"
    assert InProcessPool.launched[-1]["model"] is None
