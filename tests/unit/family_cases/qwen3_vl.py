"""Qwen3-VL under the adapter conformance suite and the tests that load a tower-only checkpoint: the
tiny tower shipped with vitpool (`GraphEncoder.from_pretrained(None)`), Hugging Face's own tower
(SDPA, one item at a time: the tokens, then the deepstack features) as the reference, and the bad
items of its grid rules."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from conftest import ROW_WIDTH, reference_outputs

from family_cases.common import item_for
from vitpool import GraphEncoder, Image

TANH_GELU_MLP = True


def reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    tower = copy.deepcopy(encoder.adapter.tower)
    tower.config._attn_implementation = "sdpa"  # Hugging Face's own path, one item at a time

    def outputs(item: Any) -> list[torch.Tensor]:
        tokens, deepstack = reference_outputs(tower, item)
        return [tokens, *deepstack]

    return outputs


def save_tower(directory: Path) -> Path:
    """The shipped tiny tower's checkpoint, copied into `directory`."""
    from vitpool.models.loading import SHIPPED_CHECKPOINT

    shutil.copytree(SHIPPED_CHECKPOINT, directory, dirs_exist_ok=True)
    return directory


CASE_FIELDS = {
    "make_encoder": lambda budgets: GraphEncoder.from_pretrained(
        None, budgets=budgets, device="cpu", dtype=torch.float32
    ),
    "reference": reference,
    "item_for": item_for,
    "bad_items": (
        (Image(torch.randn(16, 1000), (1, 4, 4)), "1000 features per row"),
        (Image(torch.randn(1, 16, ROW_WIDTH), (1, 4, 4)), "must be 2-D"),
        (Image(torch.randn(16, ROW_WIDTH)), "three integers"),
    ),
    "budgets": (16, 32, 64),
}
