"""VideoLLaMA 3 (`VideoLlama3VisionModel`, a SigLIP-style NaViT) and its `VideoLlama3Projector`.

The tower takes flattened patches [rows, C*P*P] with a (t, h, w) grid and a merge size per item: a
Conv2d patch embedding, 2D axial rotary positions laid out block-major over each item's merge
blocks (Qwen2.5-VL's, `get_vision_position_ids` with per-item merge sizes), attention over each
frame alone (one sequence per temporal patch), a final LayerNorm, and `pixel_unshuffle`: each
frame resampled bilinearly from h x w patches to (h/m) x (w/m) tokens. The projector (outside the
tower class in Hugging Face) is a GELU MLP into the LLM's width. `VideoLlama3Encoder` holds both,
so the adapter hands out exactly what `VideoLlama3Model.get_image_features` (and
`get_video_features`, the same call) gives the LLM.

What runs where:

- In the graph: the patch embedding, rotary angles, every block (packed attention), the final
  LayerNorm, the bilinear resampling as a gather of at most 2 x 2 rows of each merge block with
  their weights (a [tokens, taps] index and weight buffer; bilinear downsampling by an integer m
  reads only inside the block), and the projector.
- On the host, once per grid and cached: the rotary positions, `cu_seqlens` (frames, then the
  padding rows as one trailing sequence) and the resampling taps (found by running
  `torch.nn.functional.interpolate` on a one-hot m x m block, so they are Hugging Face's own).
- Not here: the video processor's token compression (`video_compression_mask`, from frame
  differences, computed by the processor on the host); the model drops the masked tokens after
  `get_video_features`, so vitpool returns every token and the caller applies the mask.

Hugging Face's forward cannot be captured as it is: `pixel_unshuffle` splits on
`grid_thw.prod().tolist()` and loops over items. `tower_hidden_states` runs its modules instead,
the one compatibility seam with transformers' tower. Items of merge size 1 (images, by default)
and merged items (videos) run on two paths with buffers of 1 and 4 rows per token
(`vitpool.families.video_llama_3.rules`); padding rows take rotary position (0, 0) and padding
tokens gather row 0 with weight 0.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from vitpool.families.video_llama_3.rules import MERGED, VideoLlama3Rules
from vitpool.kernels.attention import install_packed_attention
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, AdapterBase, PlainPathAdapter
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import frame_cu_seqlens, grids_of
from vitpool.packing import Budget
from vitpool.rules.patch_rows import sample_grids
from vitpool.specs import IMAGE, ItemSpec

Layout = tuple[int, int, int, int]  # (t, h, w, merge size)
TAPS = 4  # bilinear downsampling by an integer factor reads at most 2 x 2 rows of a block


class VideoLlama3Encoder(torch.nn.Module):
    """The tower and its projector; state keys `vision_model.*` and `projector.*` (a full
    checkpoint has them under `model.`)."""

    def __init__(self, vision_model: torch.nn.Module, projector: torch.nn.Module) -> None:
        super().__init__()
        self.vision_model = vision_model
        self.projector = projector
        self.config = vision_model.config


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> VideoLlama3Encoder:
    """Fresh tower and projector from a full VideoLlama3Config or a vision config with
    `text_hidden_size` (`VideoLlama3Adapter.tower_only_config`)."""
    from transformers.models.video_llama_3.modeling_video_llama_3 import (
        VideoLlama3Projector,
        VideoLlama3VisionModel,
    )

    full = VideoLlama3Adapter.projector_config(config)
    return VideoLlama3Encoder(*tower_and_projector(VideoLlama3VisionModel, VideoLlama3Projector, full, dtype))


# What `tower_hidden_states` uses of transformers' VideoLlama3VisionModel (checked when an adapter is built).
TOWER_PARTS = ("embeddings", "rotary_pos_emb", "encoder", "post_layernorm")


def tower_hidden_states(
    vision: torch.nn.Module, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]
) -> torch.Tensor:
    """`VideoLlama3VisionModel.forward` up to its final LayerNorm [rows, hidden], every
    grid-dependent tensor taken from `metadata`; `pixel_unshuffle` left out."""
    hidden = vision.embeddings(pixels.type(vision.dtype))
    position_embeddings = vision.rotary_pos_emb(hidden, metadata["position_ids"])
    output = vision.encoder(
        hidden,
        cu_seqlens=metadata["cu_seqlens"],
        max_seqlen=pixels.shape[0],  # static: a Python int from the buffer's shape
        position_embeddings=position_embeddings,
    )
    return vision.post_layernorm(output[0])


@lru_cache(maxsize=16)
def block_taps(merge: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The rows of an m x m block (row-major) that `pixel_unshuffle`'s bilinear resampling to one
    token reads, and their weights: the interpolation of each one-hot block."""
    basis = torch.eye(merge * merge).view(merge * merge, 1, merge, merge)
    weights = torch.nn.functional.interpolate(basis, size=(1, 1), mode="bilinear").flatten()
    rows = torch.nonzero(weights).flatten().tolist()
    return tuple(rows), tuple(weights[rows].tolist())


class VideoLlama3PathAdapter(AdapterBase):
    """One path of `VideoLlama3Adapter`: merge size 1 ("", a row per token, no resampling) or
    merged items (MERGED, 4 rows per token), through the one shared tower."""

    def __init__(self, tower: VideoLlama3Encoder, item_rules: VideoLlama3Rules, path: str) -> None:
        self.tower = tower
        self.item_rules = item_rules
        self.path = path
        self.row_factor = item_rules.row_factor(path)
        self._per_grid = lru_cache(maxsize=1024)(self._grid_tensors)

    def max_rows(self, num_tokens: int) -> int:
        return num_tokens * self.row_factor

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        specs = {
            "position_ids": TensorSpec((num_rows, 2), torch.long),
            # one sequence per frame, the padding's, the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
        }
        if self.path == MERGED:
            specs["merge_index"] = TensorSpec((budget.num_tokens, TAPS), torch.long)
            specs["merge_weights"] = TensorSpec((budget.num_tokens, TAPS), torch.float32)
        return specs

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        layouts: list[Layout] = [tuple(spec.layout) for spec in specs]  # type: ignore[misc]
        if any((merge > 1) != (self.path == MERGED) for *_, merge in layouts):
            raise ValueError(f"items of merge sizes {[lay[3] for lay in layouts]} on the path {self.path!r}")
        grids = grids_of(specs, num_rows, budget)
        tokens = sum(spec.num_tokens for spec in specs)
        if tokens > budget.num_tokens:
            raise ValueError(f"{len(specs)} items give {tokens} tokens; the budget holds {budget.num_tokens}")
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        metadata["cu_seqlens"] = frame_cu_seqlens(grids, num_rows, budget.max_sequences)
        row = token = 0
        for layout, spec in zip(layouts, specs):
            positions, index, weights = self._per_grid(layout)
            metadata["position_ids"][row : row + len(positions)] = positions
            if self.path == MERGED:
                metadata["merge_index"][token : token + spec.num_tokens] = index + row
                metadata["merge_weights"][token : token + spec.num_tokens] = weights
            row, token = row + len(positions), token + spec.num_tokens
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        hidden = tower_hidden_states(self.tower.vision_model, pixels, metadata)
        if self.path == MERGED:
            # pixel_unshuffle's bilinear resampling: [tokens, taps, d] weighted over the taps
            weights = metadata["merge_weights"].to(hidden.dtype)[:, :, None]
            hidden = (hidden[metadata["merge_index"]] * weights).sum(dim=1)
        return [self.tower.projector(hidden)]

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        merge = 2 if self.path == MERGED else 1
        grids = sample_grids(
            rng,
            (merge, merge),
            num_rows,
            budget.num_tokens,
            min(self.sampled_items(budget), budget.max_sequences),
        )
        rules = self.item_rules
        return [
            rules.item_spec(IMAGE, (t * h * w, *rules.row_shape), "float32", (t, h, w, merge))
            for t, h, w in grids
        ]

    def _grid_tensors(self, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from transformers.vision_utils import get_vision_position_ids

        t, h, w, merge = layout
        positions = get_vision_position_ids(torch.tensor([[t, h, w]]), merge)
        num_tokens = t * h * w // merge**2
        rows, taps = block_taps(merge)
        index = torch.zeros(num_tokens, TAPS, dtype=torch.long)
        weights = torch.zeros(num_tokens, TAPS)
        # token k is merge block k (the processor's block-major rows); its taps lie inside the block
        index[:, : len(rows)] = torch.arange(num_tokens)[:, None] * merge**2 + torch.tensor(rows)
        weights[:, : len(taps)] = torch.tensor(taps)
        return positions, index, weights


class VideoLlama3Adapter(PlainPathAdapter):
    """Adapter for `VideoLlama3Encoder` (VideoLlama3VisionModel + VideoLlama3Projector): two paths
    over the one tower, items of merge size 1 on "" and merged items on MERGED
    (`vitpool.families.video_llama_3.rules`).

    Raises:
        ConfigError: the installed transformers' tower lacks a part the adapter runs.

    The protocol's per-path methods (`max_rows`, `metadata_specs`, ...) are the "" path's, for
    code that sees one path; `GraphEncoder` runs each path's own (`paths`).
    """

    # What a tower-only save's vision config carries besides Hugging Face's fields: the LLM's width.
    PROJECTOR_FIELDS = (TEXT_HIDDEN_SIZE,)
    PROJECTOR_SUBJECT = "VideoLLaMA 3's projector"
    PROJECTOR_ADVICE = (
        "(the LLM's hidden size): give the full model's config (VideoLlama3Config) or a vision config "
        "(video_llama_3_vision) with it, as tower_only_config writes it"
    )
    FULL_MODEL_TYPES = ("video_llama_3",)
    # transformers' layout (`model.vision_model.`, `model.projector.`) -> the encoder's keys
    CHECKPOINT_RENAMES = ((re.compile(r"^model\.(vision_model|projector)\."), r"\1."),)

    def __init__(self, tower: VideoLlama3Encoder) -> None:
        vision = tower.vision_model
        check_tower_parts("VideoLLaMA 3", vision, TOWER_PARTS)
        config = vision.config
        self.tower = tower
        self.item_rules = VideoLlama3Rules(
            int(config.num_channels) * int(config.patch_size) ** 2,
            int(tower.projector.readout[-1].out_features),
        )
        install_packed_attention(vision)
        self.paths = {
            path: VideoLlama3PathAdapter(tower, self.item_rules, path) for path in self.item_rules.paths
        }


# The loader's hooks by their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = VideoLlama3Adapter.tower_only_config
convert_checkpoint = VideoLlama3Adapter.convert_checkpoint
