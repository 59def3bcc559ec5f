"""The README's per-family snippets, run: for each `<!-- readme-snippet: family NAME -->` marker, the
```python block after it (a Hugging Face image processor on a PIL image, one vitpool item,
`GraphEncoder.from_pretrained(checkpoint)`, one printed number) is executed against a tiny random
model of the family, saved whole with `save_pretrained` (so the snippet loads it through the
registry, as a user's checkpoint), at the tile and patch sizes the processor emits. What it prints
must be what its comment says, the comment's breakdown must be what the processor emitted, and the
token count must be Hugging Face's own `get_image_features`' for the same item (but DeepSeek-OCR-2's,
see FAMILIES).

Llama 4's and Step-3.7's processors exist only for the torchvision backend: their snippets are
still checked to be there and to compile; running them skips where torchvision is not installed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from family_cases import deepseek_ocr2 as deepseek_ocr2_case
from family_cases import internvl as internvl_case
from family_cases import llama4 as llama4_case
from family_cases import minicpmv4_6 as minicpmv4_6_case
from family_cases import step3p7 as step3p7_case

from vitpool import GraphEncoder

pytest.importorskip("PIL.Image")

README = Path(__file__).resolve().parents[2] / "README.md"
LOCAL = "pixel_values_local"


def family_snippet(family: str) -> str:
    """The fenced python block that follows the family's marker in README.md."""
    marker = f"<!-- readme-snippet: family {family} -->"
    text = README.read_text()
    if marker not in text:
        pytest.fail(f"README.md has no {marker}")
    after = text.split(marker, 1)[1].lstrip("\n")
    if not after.startswith("```python\n"):
        pytest.fail(f"README.md's {marker} must be followed by a ```python block")
    body = after.removeprefix("```python\n")
    if "\n```" not in body:
        pytest.fail(f"README.md's ```python block after {marker} is not closed")
    return body.split("\n```", 1)[0] + "\n"


def print_comment(code: str) -> str:
    """The comment on the snippet's (last) print line: what it says the snippet prints."""
    lines = [line for line in code.splitlines() if line.startswith("print(")]
    assert lines, "the snippet must print its number"
    assert "  # " in lines[-1], f"the print line has no comment saying what it prints: {lines[-1]!r}"
    return lines[-1].split("  # ", 1)[1].strip()


def numbers(pattern: str, comment: str) -> tuple[int, ...]:
    match = re.search(pattern, comment)
    assert match, f"the comment {comment!r} does not say {pattern!r}"
    return tuple(int(group) for group in match.groups())


def leading_number(comment: str) -> str:
    """`# 1792: 7 tiles of 256 tokens` -> "1792"."""
    return str(numbers(r"^(\d+):", comment)[0])


# The tiny models: the processors' real tile and patch sizes, tiny widths, one or two layers.


def internvl_model() -> torch.nn.Module:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    # 448² tiles of 32 x 32 patches: 256 tokens a tile after the pixel shuffle
    vision = dict(internvl_case.TINY_VISION, image_size=448, patch_size=14, num_hidden_layers=1)
    return InternVLForConditionalGeneration(
        InternVLConfig(vision_config=vision, text_config=dict(internvl_case.TINY_TEXT))
    ).eval()


def llama4_model() -> torch.nn.Module:
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    # 336² tiles of 24 x 24 patches: 144 tokens a tile after the pixel shuffle
    vision = dict(llama4_case.TINY_VISION, image_size=336, patch_size=14, num_hidden_layers=1)
    return Llama4ForConditionalGeneration(
        Llama4Config(vision_config=vision, text_config=dict(llama4_case.TINY_TEXT))
    ).eval()


def minicpmv4_6_model() -> torch.nn.Module:
    from transformers import MiniCPMV4_6ForConditionalGeneration

    return MiniCPMV4_6ForConditionalGeneration(minicpmv4_6_case.full_config()).eval()  # 14-pixel patches


def step3p7_model() -> torch.nn.Module:
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    # the release's 728² view (52 x 52 patches, 169 tokens); its crops are the processor's 504² (81
    # tokens), the default, so the config sets no local_image_size, as a user's checkpoint
    vision = dict(
        step3p7_case.TINY_VISION,
        image_size=728,
        patch_size=14,
        max_position_embeddings=52 * 52,
        num_hidden_layers=1,
    )
    return Step3p7ForConditionalGeneration(
        Step3p7Config(vision_config=vision, text_config=dict(step3p7_case.TINY_TEXT))
    ).eval()


def deepseek_ocr2_model() -> torch.nn.Module:
    return deepseek_ocr2_case.hf_model()  # already at the release's 1024² / 768² tiles, 16-pixel patches


# What each comment says, checked against the processor's output (`out`) and the token count.


def internvl_expects(comment: str, namespace: dict, tokens: int) -> str:
    tiles, per_tile = numbers(r"(\d+) tiles of (\d+) tokens", comment)
    assert namespace["out"]["pixel_values"].shape[0] == tiles
    assert tokens == tiles * per_tile
    return leading_number(comment)


def llama4_expects(comment: str, namespace: dict, tokens: int) -> str:
    per_tile, side = numbers(r"(\d+) tokens a (\d+)² tile", comment)
    pixels = namespace["out"]["pixel_values"]
    assert tuple(pixels.shape[1:]) == (3, side, side)
    assert tokens == per_tile * pixels.shape[0]
    return f"{pixels.shape[0]} tiles"


def minicpmv4_6_expects(comment: str, namespace: dict, tokens: int) -> str:
    pattern = r"(\d+) slices of (\d+) x (\d+) patches, (\d+) tokens each"
    slices, height, width, per_slice = numbers(pattern, comment)
    assert namespace["out"]["target_sizes"].tolist() == [[height, width]] * slices
    assert height * width // 16 == per_slice and tokens == slices * per_slice
    return leading_number(comment)


def step3p7_expects(comment: str, namespace: dict, tokens: int) -> str:
    per_crop, per_view = numbers(r"(\d+) tokens a crop, then the view's (\d+)", comment)
    out = namespace["out"]
    crops = out[LOCAL].shape[0] if LOCAL in out else 0
    assert tokens == per_crop * crops + per_view
    return f"{crops} crops"


def deepseek_ocr2_expects(comment: str, namespace: dict, tokens: int) -> str:
    pattern = r"(\d+) crops of (\d+) tokens, the view's (\d+), the separator"
    crops, per_crop, per_view = numbers(pattern, comment)
    assert namespace["out"][LOCAL].shape[0] == crops
    assert tokens == crops * per_crop + per_view + 1
    return leading_number(comment)


def hf_tokens(
    image_features: Callable[[torch.nn.Module, Any], torch.Tensor], inner: bool = False
) -> Callable[[torch.nn.Module, Any], int]:
    """The rows Hugging Face's `get_image_features` hands the LLM for the snippet's item."""

    def tokens(model: torch.nn.Module, item: Any) -> int:
        with torch.no_grad():
            return image_features(model.model if inner else model, item).shape[0]

    return tokens


@dataclass(frozen=True)
class Family:
    name: str
    model: Callable[[], torch.nn.Module]
    expects: Callable[[str, dict, int], str]  # (comment, namespace, tokens) -> the line it must print
    # None: not run here (DeepSeek-OCR-2's SAM on 1024² + 6 x 768² costs seconds on a CPU; whole
    # items are checked against get_image_features in test_family_deepseek_ocr2.py)
    reference_tokens: Callable[[torch.nn.Module, Any], int] | None
    needs_torchvision: bool = False


FAMILIES = [
    Family("internvl", internvl_model, internvl_expects, hf_tokens(internvl_case.image_features)),
    Family(
        "llama4", llama4_model, llama4_expects, hf_tokens(llama4_case.image_features), needs_torchvision=True
    ),
    Family(
        "minicpmv4_6",
        minicpmv4_6_model,
        minicpmv4_6_expects,
        hf_tokens(minicpmv4_6_case.image_features, inner=True),
    ),
    Family(
        "step3p7",
        step3p7_model,
        step3p7_expects,
        hf_tokens(step3p7_case.image_features),
        needs_torchvision=True,
    ),
    Family("deepseek_ocr2", deepseek_ocr2_model, deepseek_ocr2_expects, None),
]
IDS = [family.name for family in FAMILIES]


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_the_snippet_is_there_and_compiles(family):
    code = family_snippet(family.name)
    compile(code, f"{README}:{family.name}", "exec")
    assert "GraphEncoder.from_pretrained(checkpoint)" in code, "the snippet loads the user's checkpoint"
    print_comment(code)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_the_snippet_prints_what_its_comment_says(family, tmp_path, capsys, monkeypatch):
    code = family_snippet(family.name)
    if family.needs_torchvision:
        pytest.importorskip("torchvision", reason=f"the {family.name} snippet's processor needs torchvision")
    if family.name == "minicpmv4_6" and minicpmv4_6_case.TOO_OLD:
        pytest.skip(minicpmv4_6_case.TOO_OLD)
    model = family.model()
    model.save_pretrained(tmp_path)

    encoded: list[Any] = []  # the items the snippet encodes, for the reference
    encode = GraphEncoder.encode

    def recording_encode(self: GraphEncoder, items: Any, *args: Any, **kwargs: Any) -> Any:
        encoded.extend(items)
        return encode(self, items, *args, **kwargs)

    monkeypatch.setattr(GraphEncoder, "encode", recording_encode)
    namespace: dict[str, Any] = {"checkpoint": str(tmp_path)}
    capsys.readouterr()
    exec(compile(code, f"{README}:{family.name}", "exec"), namespace)  # noqa: S102 (the README's own code)
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed, "the snippet printed nothing"

    tokens = namespace["embedding"].tokens.shape[0]
    assert len(encoded) == 1
    if family.reference_tokens is not None:
        reference = family.reference_tokens(model, encoded[0])
        assert tokens == reference, "vitpool's token count is not Hugging Face's get_image_features'"
    assert printed[-1] == family.expects(print_comment(code), namespace, tokens)
