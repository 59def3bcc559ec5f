"""PaddleOCR-VL (`PaddleOCRVisionModel`, a SigLIP-style NaViT) and its `PaddleOCRProjector`.

The tower takes 4-D patches [rows, 3, P, P] with a (1, h, w) grid per image: a Conv2d patch
embedding, a learned square position table resampled bilinearly to each grid, 2D axial rotary
positions (row, column), attention over each image alone (one sequence per image) and a final
LayerNorm. The projector (outside the tower class in Hugging Face) LayerNorms every row, merges
2 x 2 patches into one row of 4*d and runs a GELU MLP into the LLM's width. `PaddleOCREncoder`
holds both, so the adapter hands out exactly what `PaddleOCRVLModel.get_image_features` gives the
LLM (its `pooler_output`, split per image).

What differs for static capture:

- Every grid-dependent tensor is precomputed on the host and passed to the tower's forward as
  the keywords Hugging Face's helpers pop (`interp_indices`, `interp_weights`, `position_ids`,
  `cu_seqlens`, `max_seqlen`), with `grid_thw=None`. `max_seqlen` is the buffer's row count, a
  Python int, so the packed attention never reads `cu_seqlens` back.
- Hugging Face's embeddings take 5-D pixels (`get_image_features` adds a batch dimension); the
  adapter adds it to its [rows, 3, P, P] buffer.
- The projector splits its input per image on the host (`grid.prod().tolist()`) and reshapes each
  image by its own (h, w). The adapter runs its layers itself: `pre_norm` over all rows (per-row,
  so padding rows change nothing), then a gather by a precomputed [tokens, merge²] index into the
  rows in the projector's order (row-major 2 x 2 blocks, within a block row-major), reshaped to
  [tokens, merge² * d], then `linear_1`, `act`, `linear_2`.

Padding rows read table row 0 with weight 0 and rotary position (0, 0), and form one trailing
attention sequence of their own; padding tokens gather row 0. What the adapter shares with
Kimi-K2.5's (the position table's and rotary metadata, the fill, the sampler) is
`vitpool.models.patch_adapter`'s.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from vitpool.families.paddleocr_vl.rules import PaddleOCRVLRules
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, renames
from vitpool.models.patch_adapter import PatchRowAdapter
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import TensorSpec
from vitpool.packing import Budget
from vitpool.rules.patch_rows import Grid


class PaddleOCREncoder(torch.nn.Module):
    """The tower and its projector; state keys `visual.vision_model.*` and `projector.*` (a full
    checkpoint has them under `model.`, or as `visual.*` and `mlp_AR.*` in the release layout)."""

    def __init__(self, visual: torch.nn.Module, projector: torch.nn.Module) -> None:
        super().__init__()
        self.visual = visual
        self.projector = projector
        self.config = visual.config


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> PaddleOCREncoder:
    """Fresh tower and projector from a full PaddleOCRVLConfig or a vision config with
    `text_hidden_size` (`PaddleOCRVLAdapter.tower_only_config`)."""
    from transformers.models.paddleocr_vl.modeling_paddleocr_vl import (
        PaddleOCRProjector,
        PaddleOCRVisionModel,
    )

    # PaddleOCRProjector reads vision_config.{spatial_merge_size, hidden_size} and text_config.hidden_size
    full = PaddleOCRVLAdapter.projector_config(config)
    visual, projector = tower_and_projector(PaddleOCRVisionModel, PaddleOCRProjector, full, dtype)
    return PaddleOCREncoder(visual, projector)


# A full checkpoint's tower and projector: transformers' layout (`model.visual.`, `model.projector.`,
# its state_dict), PaddlePaddle's release layout (`visual.`, `mlp_AR.`; what `save_pretrained` writes
# back too, through conversion_mapping.py's "paddleocr_vl" renames), or the encoder's own keys.
CHECKPOINT_PREFIXES = ("model.visual.", "visual.", "model.projector.", "mlp_AR.", "projector.")


class PaddleOCRVLAdapter(PatchRowAdapter):
    """Adapter for `PaddleOCREncoder` (PaddleOCRVisionModel + PaddleOCRProjector)."""

    # What a tower-only save's vision config carries besides Hugging Face's fields: the LLM's width.
    PROJECTOR_FIELDS = (dataclasses.replace(TEXT_HIDDEN_SIZE, cast=int),)
    PROJECTOR_SUBJECT = "PaddleOCR-VL's projector"
    PROJECTOR_ADVICE = (
        "(the LLM's hidden size): give the full model's config (PaddleOCRVLConfig) or a vision config "
        "(paddleocr_vl_vision) with it, as tower_only_config writes it"
    )
    # The layouts above -> the encoder's keys (which map to themselves).
    CHECKPOINT_RENAMES = renames(
        (r"^model\.visual\.", "visual."), (r"^(model\.projector|mlp_AR)\.", "projector.")
    )
    # What PaddleOCRVLModel drops on load (`_keys_to_ignore_on_load_unexpected`): the release's packed
    # position table and SigLIP's unused pooling head.
    CHECKPOINT_IGNORED = (re.compile(r"packing_position_embedding"), re.compile(r"vision_model\.head"))

    ROW_INDEX_NAMES = ("merge_index",)

    def __init__(self, tower: PaddleOCREncoder) -> None:
        config = tower.visual.config
        self.merge_size = int(config.spatial_merge_size)
        item_rules = PaddleOCRVLRules(
            int(config.num_channels),
            int(config.patch_size),
            self.merge_size,
            int(tower.projector.linear_2.out_features),
        )
        embeddings = tower.visual.vision_model.embeddings
        if embeddings.num_grid_per_side**2 != embeddings.num_positions:
            raise ValueError(
                "PaddleOCR-VL's position table must be square ((image_size / patch_size)² positions)"
            )
        super().__init__(tower, tower.visual, item_rules, embeddings)

    def own_metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {"merge_index": TensorSpec((budget.num_tokens, self.merge_unit), torch.long)}

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        metadata = dict(metadata)
        merge_index = metadata.pop("merge_index")
        output = self.tower.visual(
            pixels.unsqueeze(0),  # HF's embeddings take [1, rows, C, P, P], as get_image_features gives them
            grid_thw=None,  # every grid-derived tensor is given in `metadata`
            max_seqlen=pixels.shape[0],  # static: a Python int from the buffer's shape
            **metadata,
        )
        hidden = output.last_hidden_state  # [rows, d]
        projector = self.tower.projector
        normed = projector.pre_norm(hidden)
        merged = normed[merge_index].reshape(merge_index.shape[0], -1)  # [tokens, merge² * d]
        return [projector.linear_2(projector.act(projector.linear_1(merged)))]

    def grid_metadata(self, grid: Grid) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        # The projector's reshape(h/m, m, w/m, m).transpose: token (bh, bw) takes rows
        # (bh*m + i) * w + bw*m + j for i, j in row-major order.
        _, h, w = grid
        m = self.merge_size
        merge_index = torch.arange(h * w).view(h // m, m, w // m, m).transpose(1, 2).reshape(-1, m * m)
        return {}, {"merge_index": merge_index}


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = PaddleOCRVLAdapter.tower_only_config
convert_checkpoint = PaddleOCRVLAdapter.convert_checkpoint
