"""Qwen4-Exp's tower (`Qwen4ExpVisionModel`), run by Qwen3.5's adapter.

What was compared (transformers 5.24, the generated `modeling_qwen4_exp.py` against
`modeling_qwen3_5.py` and `modeling_qwen3_vl.py`, class by class): the vision rotary embedding,
MLP, patch embedding, patch merger, attention, block, `apply_rotary_pos_emb_vision` and the
tower's `__init__` and `forward` are Qwen3.5's line for line, and Qwen3.5's are Qwen3-VL's less
the deepstack mergers and their outputs. The vision config has Qwen3.5's fields and defaults under
its own `model_type`. `Qwen4ExpModel.get_image_features` / `get_video_features` are Qwen3.5's: the
tower on all items' rows and grids, the merger's tokens split per item; a video runs as its
(t, h, w) grid, one attention sequence per temporal patch. What Qwen4-Exp changes is in its LLM
(hyper-connections, sparse attention, per-layer n-gram embeddings), which vitpool does not run.

So the static forward is Qwen3.5's (`Qwen3_5Adapter`): on the host, once per grid (cached), the
position table's interpolation indices and weights and the rotary position ids, and per batch the
cu_seqlens, all copied into the static buffers; in the graph, the patch embedding, the table
gather, the rotary tables, the blocks with packed attention and the merger. This module is the
family's seam with transformers: it builds the tower (naming the transformers to install where the
model is missing) and refuses a tower with deepstack mergers, whose features Qwen3.5's adapter
would drop without a word.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from vitpool.errors import ConfigError
from vitpool.families.qwen3_5.adapter import Qwen3_5Adapter
from vitpool.models.compat import incompatible, installed_transformers
from vitpool.models.family import read_hf_config

FAMILY = "Qwen4-Exp"
TRANSFORMERS_MODULE = "transformers.models.qwen4_exp"
# The release whose code was read and tested here; an earlier one may have the model too
CHECKED_TRANSFORMERS = "5.24.0"


def missing_transformers_model() -> str | None:
    """Why this transformers cannot build Qwen4-Exp's tower (None: it can): it has no
    `transformers.models.qwen4_exp`."""
    if importlib.util.find_spec(TRANSFORMERS_MODULE) is not None:
        return None
    return (
        f"{FAMILY} needs a transformers with its model ({TRANSFORMERS_MODULE}; {CHECKED_TRANSFORMERS} has "
        f"it); transformers {installed_transformers()} is installed: "
        f"pip install 'transformers>={CHECKED_TRANSFORMERS}'"
    )


def _require_model() -> None:
    missing = missing_transformers_model()
    if missing:
        raise ConfigError(missing)


def read_tower_config(directory: Path) -> Any:
    """A tower-only save's config (`Qwen4ExpVisionConfig`), through AutoConfig.

    Raises:
        ConfigError: the installed transformers has no Qwen4-Exp (AutoConfig would only say that
            it does not know the model type).
    """
    _require_model()
    return read_hf_config(directory)


def build_tower(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """A fresh `Qwen4ExpVisionModel` of this vision config, in `dtype`.

    Raises:
        ConfigError: the installed transformers has no Qwen4-Exp.
    """
    _require_model()
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel

    return Qwen4ExpVisionModel._from_config(config, dtype=dtype)


class Qwen4ExpAdapter(Qwen3_5Adapter):
    """Adapter for `Qwen4ExpVisionModel`: one output per item, the merger's tokens."""

    def __init__(self, tower: torch.nn.Module) -> None:
        # Qwen3.5's forward returns the merger's tokens alone: deepstack mergers in a later
        # release's tower would be computed and lost, so such a tower is refused here
        if getattr(tower.config, "deepstack_visual_indexes", None) or hasattr(tower, "deepstack_merger_list"):
            raise incompatible(
                FAMILY, f"{type(tower).__name__} has deepstack mergers, whose features this adapter drops"
            )
        super().__init__(tower)
