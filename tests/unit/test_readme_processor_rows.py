"""The README's model table, tried offline as a user would: each row's image processor is built from
the row's own backticked constructor call (the arguments a checkpoint sets, as the row states them),
run on random PIL images of different sizes, and its `pixel_values` must have the shape the row
states (numbers exactly; names such as `views`, `tiles` or `h·w` are counts, the same name the same
count; `N·14` a multiple of 14). A row that states a grid (a row `(1, h, w)` of `image_grid_thw`)
must get one whose t·h·w is the pixel rows. "for crops add `...`" builds the row's call with those
arguments too, and "called with `...`" passes them to the call.

Rows whose processor exists only for the torchvision backend are listed in TORCHVISION_ONLY with
the reason; the list must match the table, so a new row is either run here or listed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import transformers
from test_readme_families import README

pytest.importorskip("PIL.Image")

TABLE_HEADER = "| family (vision `model_type`) | image processor (PIL backend) |"
SAME_AS = re.compile(r"^the same as ([^¹²³⁴⁵⁶⁷⁸⁹(;,]+)")
CONSTRUCTOR = re.compile(r"^([A-Z]\w*ImageProcessor\w*)(\(.*\))?$", re.DOTALL)
# "`pixel_values` `[h·w, 1536]`", "`out["image_pixel_values"][i, :1 + r·c]` `[1 + r·c, 3, 448, 448]`",
# or a bare "`[n, 3, S, S]`" (the processor's `pixel_values`)
KEYED_SHAPE = re.compile(r'`(?:out\[")?([a-z_]+)[^`]*`\s*`(\[[^`\]]*\])`')
BARE_SHAPE = re.compile(r"`(\[[^`\]]*\])`")
GRID = re.compile(r"a row `\(1, h, w\)` of `(\w+)`")
IMAGE_SIZES = [(480, 1400), (300, 200)]  # (height, width): a wide one (crops, tiles) and a small one

TORCHVISION_ONLY = {
    "Kimi-K2.5": "Kimi_K25ImageProcessor has no PIL class in transformers 5.24",
    "MiniMax-M3-VL": "MiniMaxM3VLImageProcessor has no PIL class in transformers 5.24",
    "LFM2-VL": "Lfm2VlImageProcessor has no PIL class in transformers 5.24",
    "Llama 4 Scout / Maverick": "Llama4ImageProcessor has no PIL class in transformers 5.24",
    "Molmo 2": "Molmo2ImageProcessor has no PIL class in transformers 5.24",
    "MiniCPM-OCR": "MiniCPMOcrImageProcessor has no PIL class in transformers 5.24",
    "Phi-4-multimodal": "Phi4MultimodalImageProcessor has no PIL class in transformers 5.24",
    "Step-3.7": "Step3p7ImageProcessor has no PIL class in transformers 5.24",
}


@dataclass(frozen=True)
class Row:
    family: str  # the first cell up to its `model_type` note: "Gemma 3"
    processor: str  # the image processor cell, "the same as ..." resolved
    output: str  # the `Image(pixels, grid)` cell, "the same ..." resolved


def table_rows() -> list[Row]:
    """The model table's rows, each cell that refers to another row's replaced by that row's.

    Raises:
        AssertionError: README.md has no model table, or a row refers to a family not above it.
    """
    text = README.read_text()
    assert TABLE_HEADER in text, "README.md has no model table"
    lines = text.split(TABLE_HEADER, 1)[1].splitlines()[2:]  # past the header's divider
    rows: list[Row] = []
    for line in lines:
        if not line.startswith("| "):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        family = cells[0].split(" (", 1)[0]
        processor, output = cells[1], cells[2]
        same = SAME_AS.match(processor)
        if same:
            processor = row_named(rows, same.group(1)).processor
        if output.startswith("the same"):
            referred = SAME_AS.match(output)
            output = row_named(rows, referred.group(1)).output if referred else rows[-1].output
        rows.append(Row(family, processor, output))
    return rows


def row_named(rows: list[Row], family: str) -> Row:
    """The row above whose first cell names `family` ("Qwen3-VL" names "Qwen3-VL, Qwen3-VL-MoE")."""
    family = family.strip()
    matches = [row for row in rows if family in re.split(r", | / ", row.family)]
    assert matches, f"a README row refers to {family!r}, which no row above it names"
    return matches[0]


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def constructor(row: Row) -> str:
    """The row's processor as it writes it: `Name(...)`, or a bare `Name` taken as `Name()`."""
    for span in backticked(row.processor):
        match = CONSTRUCTOR.match(span)
        if match:
            return span if match.group(2) else f"{span}()"
    pytest.fail(f"the {row.family} row names no image processor constructor: {row.processor!r}")


def phrase_arguments(row: Row, phrase: str) -> str | None:
    """The backticked keyword arguments after `phrase` in the processor cell: "for crops add `...`"."""
    match = re.search(re.escape(phrase) + r" `([^`]+)`", row.processor)
    return match.group(1) if match else None


def build(call: str) -> Any:
    """The processor `call` builds, its class looked up in transformers as a user imports it."""
    name = call.split("(", 1)[0]
    return eval(call, {name: getattr(transformers, name)})  # the README's own call, as a user would type it


def random_images(seed: int) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [
        PILImage.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        for height, width in IMAGE_SIZES
    ]


def stated_shape(row: Row) -> tuple[str, list[str]]:
    """(output key, dims) of the first shape the row's output cell states."""
    keyed = KEYED_SHAPE.search(row.output)
    bare = BARE_SHAPE.search(row.output)
    assert bare, f"the {row.family} row states no pixel shape: {row.output!r}"
    if keyed and keyed.start(2) - 1 == bare.start():
        key, dims = keyed.group(1), keyed.group(2)
    else:
        key, dims = "pixel_values", bare.group(1)
    return key, [dim.strip() for dim in dims.strip("[]").split(",")]


def factors(dim: str) -> tuple[int, str]:
    """`3·16·16` -> (768, ""); `N·14` -> (14, "N"); `h·w` -> (1, "h·w")."""
    numeric = [int(part) for part in dim.split("·") if part.strip().isdigit()]
    names = "·".join(part.strip() for part in dim.split("·") if not part.strip().isdigit())
    return math.prod(numeric), names


def assert_shape(family: str, shape: tuple[int, ...], dims: list[str]) -> None:
    assert len(shape) >= len(dims), f"{family}: {shape} has fewer dims than the row's {dims}"
    counts: dict[str, int] = {}
    for size, dim in zip(shape[len(shape) - len(dims) :], dims, strict=True):
        product, name = factors(dim)
        if not name:
            assert size == product, f"{family}: {shape}'s trailing dims are not the row's {dims}"
            continue
        assert size > 0 and size % product == 0, f"{family}: {size} is not {dim} in {dims}"
        assert counts.setdefault(dim, size) == size, f"{family}: {dim} differs within {shape} ({dims})"


def check_output(row: Row, out: Any) -> None:
    key, dims = stated_shape(row)
    assert key in out, f"{row.family}: the output has no {key!r}, only {sorted(out)}"
    assert_shape(row.family, tuple(out[key].shape), dims)
    grid = GRID.search(row.output)
    if grid:
        grids = out[grid.group(1)]
        assert grids.shape == (1, 3) and int(grids[0, 0]) == 1, f"{row.family}: grid {grids.tolist()}"
        assert out[key].shape[0] == int(grids.prod()), f"{row.family}: rows are not the grid's t·h·w"


ROWS = table_rows()
RUN_HERE = [row for row in ROWS if row.family not in TORCHVISION_ONLY]


def test_every_row_is_run_or_listed_as_torchvision_only():
    families = [row.family for row in ROWS]
    assert len(families) == len(set(families)), "two README rows name the same family"
    assert set(TORCHVISION_ONLY) <= set(families), "TORCHVISION_ONLY names a row the README lacks"
    for row in ROWS:
        name = constructor(row).split("(", 1)[0]
        assert hasattr(transformers, name), f"transformers has no {name} (the {row.family} row)"
        if row.family in TORCHVISION_ONLY:
            assert "torchvision" in row.processor, f"the {row.family} row must say it needs torchvision"
            assert not name.endswith("Pil"), f"{name} is a PIL class: run the {row.family} row"
        else:
            assert name.endswith("Pil"), f"{name} needs torchvision: list the {row.family} row"


@pytest.mark.parametrize("row", RUN_HERE, ids=[row.family for row in RUN_HERE])
def test_the_row_processor_gives_the_row_shape(row):
    calls = [constructor(row)]
    extra = phrase_arguments(row, "for crops add")
    if extra:
        calls.append(calls[0][:-1] + (", " if not calls[0].endswith("()") else "") + extra + ")")
    call_arguments = phrase_arguments(row, "called with")
    call_kwargs = eval(f"dict({call_arguments})", {}) if call_arguments else {}
    for seed, call in enumerate(calls):
        processor = build(call)
        for index, image in enumerate(random_images(seed)):
            batch = [[image]] if "return_row_col_info" in call_kwargs else [image]  # a sample's images
            out = processor(images=batch, return_tensors="pt", **call_kwargs)  # one image a call
            check_output(row, out)
            if seed == 1 and index == 0:  # the crop arguments on the wide image (ratio 2.9): crops
                assert out["pixel_values"].shape[0] > 1, f"{call} made no crops of a wide image"
