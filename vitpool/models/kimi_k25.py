"""Kimi-K2.5 / K2.6 (MoonViT, `Kimi_K25VisionModel`) and its `mm_projector`.

The tower takes 4-D patches [rows, 3, P, P] with a (t, h, w) grid per item: a learned position
table resampled bicubically to each grid, a sinusoidal time embedding per frame of a clip (none
for a single frame), 2D axial rotary positions, attention over a whole clip at once (one sequence
per item), and a pooling of kh x kw patches averaged over the clip's frames. The projector
(`Kimi_K25MultimodalProjection`, outside the tower class in Hugging Face) turns each pooled
token into the LLM's width: `KimiK25Encoder` holds both, so the adapter hands out exactly what
`Kimi_K25Model.get_image_features` gives the LLM.

Every grid-dependent tensor is precomputed on the host (`interp_indices`, `interp_weights`,
`frame_index`, `position_ids`, `cu_seqlens`, a static `max_seqlen`). `tower_hidden_states` is the
one place that runs Hugging Face's tower, up to its final LayerNorm: the tower's own temporal
pooling changed its helper's contract in transformers 5.24 (a gather index before, a scatter
index, weights and a count since) and cannot be static across items of different t anyway, so
the adapter pools the last hidden state itself with a [tokens, max_frames, kh*kw] index and
per-frame weights 1/t (0 for slots past an item's frames).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import torch
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

from vitpool.models.attention import install_packed_attention
from vitpool.models.compat import check_tower_parts
from vitpool.models.kimi_k25_rules import EXTRA_ROWS, KimiK25Rules
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import item_cu_seqlens, item_grids
from vitpool.packing import Budget
from vitpool.specs import IMAGE, VIDEO, ItemSpec

Grid = tuple[int, int, int]
MAX_SAMPLED_ITEMS = 8
# What a tower-only save's vision config carries besides Hugging Face's fields, for the projector.
PROJECTOR_FIELDS = ("text_hidden_size", "projection_hidden_size", "projection_layer_norm_eps")


class KimiK25Encoder(torch.nn.Module):
    """The tower and its projector; state keys `vision_tower.*` and `mm_projector.*` (a full
    checkpoint has them under `model.`)."""

    def __init__(self, vision_tower: torch.nn.Module, mm_projector: torch.nn.Module) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.mm_projector = mm_projector
        self.config = vision_tower.config


def projector_config(config: Any) -> Any:
    """What `Kimi_K25MultimodalProjection` reads, from a full `Kimi_K25Config` or from a vision
    config carrying PROJECTOR_FIELDS (a tower-only save)."""
    if getattr(config, "text_config", None) is not None:
        return config
    missing = [name for name in PROJECTOR_FIELDS if getattr(config, name, None) is None]
    if missing:
        raise ValueError(
            f"a Kimi-K2.5 vision config needs {missing} to build its mm_projector; "
            "give the full model's config (Kimi_K25Config) or a tower-only save that carries them"
        )
    return SimpleNamespace(
        vision_config=config,
        text_config=SimpleNamespace(hidden_size=config.text_hidden_size),
        projection_hidden_size=config.projection_hidden_size,
        projection_layer_norm_eps=config.projection_layer_norm_eps,
    )


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> KimiK25Encoder:
    """Fresh tower and projector from a full Kimi_K25Config or a vision config with PROJECTOR_FIELDS."""
    from transformers.models.kimi_k25.modeling_kimi_k25 import (
        Kimi_K25MultimodalProjection,
        Kimi_K25VisionModel,
    )

    tower, projector = tower_and_projector(
        Kimi_K25VisionModel, Kimi_K25MultimodalProjection, projector_config(config), dtype
    )
    return KimiK25Encoder(tower, projector)


def tower_only_config(full_config: Any) -> Any:
    """The vision config of a full Kimi_K25Config with PROJECTOR_FIELDS added: what a tower-only
    save of `KimiK25Encoder` writes as its config.json."""
    import copy

    config = copy.deepcopy(full_config.vision_config)
    config.text_hidden_size = full_config.text_config.hidden_size
    config.projection_hidden_size = full_config.projection_hidden_size
    config.projection_layer_norm_eps = full_config.projection_layer_norm_eps
    return config


# What `tower_hidden_states` uses of transformers' Kimi_K25VisionModel (checked when an adapter is built).
TOWER_PARTS = ("patch_embed", "patch_embed.pos_emb", "rotary_emb", "layers", "final_layernorm")


def tower_hidden_states(
    vision: torch.nn.Module, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]
) -> torch.Tensor:
    """`Kimi_K25VisionModel.forward` up to its final LayerNorm [rows, hidden], with every
    grid-dependent tensor taken from `metadata`; the tower's temporal pooling is left out.

    The compatibility seam with transformers' Kimi-K2.5 tower: what a release changes in it
    breaks here (the patch embedding's keywords, the rotary module, the blocks' keywords).
    """
    hidden = vision.patch_embed(
        pixels,
        grid_thw=None,  # every grid-derived tensor is given
        interp_indices=metadata["interp_indices"],
        interp_weights=metadata["interp_weights"],
        frame_index=metadata["frame_index"],
    )
    position_embeddings = vision.rotary_emb(hidden, metadata["position_ids"])
    for block in vision.layers:
        hidden = block(
            hidden,
            cu_seqlens=metadata["cu_seqlens"],
            max_seqlen=pixels.shape[0],  # static: a Python int from the buffer's shape
            position_embeddings=position_embeddings,
        )
    return vision.final_layernorm(hidden)


class KimiK25Adapter:
    """Adapter for `KimiK25Encoder` (Kimi_K25VisionModel + mm_projector)."""

    def __init__(self, tower: KimiK25Encoder, row_factor: int = 1) -> None:
        vision = tower.vision_tower
        config = vision.config
        self.tower = tower
        kh, kw = config.merge_kernel_size
        self.merge_kernel = (int(kh), int(kw))
        self.merge_unit = kh * kw
        self.max_frames = int(config.pos_emb_time)
        self.item_rules = KimiK25Rules(
            3, int(config.patch_size), self.merge_kernel, self.max_frames,
            int(tower.mm_projector.out_proj.out_features), row_factor,
        )
        self.row_shape = self.item_rules.row_shape
        self.output_row_shapes = self.item_rules.output_row_shapes
        pos_emb = vision.patch_embed.pos_emb
        if config.pos_emb_height != config.pos_emb_width:
            raise ValueError("Kimi-K2.5's position table must be square (pos_emb_height == pos_emb_width)")
        self._num_grid_per_side: int = pos_emb.num_grid_per_side
        self._interpolation_mode: str = pos_emb.interpolation_mode
        self._align_corners: bool = pos_emb.interpolation_align_corners
        self._per_grid = lru_cache(maxsize=1024)(self._grid_metadata)
        check_tower_parts("Kimi-K2.5", vision, TOWER_PARTS)
        install_packed_attention(vision)

    def max_rows(self, num_tokens: int) -> int:
        return num_tokens * self.merge_unit * self.item_rules.row_factor

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        taps = 16 if self._interpolation_mode == "bicubic" else 4
        return {
            "interp_indices": TensorSpec((num_rows, taps), torch.long),
            "interp_weights": TensorSpec((num_rows, taps), torch.float32),
            "frame_index": TensorSpec((num_rows,), torch.long),
            "position_ids": TensorSpec((num_rows, 2), torch.long),
            # one sequence per item (a clip attends across its frames), the padding's, the leading 0
            "cu_seqlens": TensorSpec((budget.max_items + 2,), torch.int32),
            "pool_index": TensorSpec((budget.num_tokens, self.max_frames, self.merge_unit), torch.long),
            "pool_weights": TensorSpec((budget.num_tokens, self.max_frames), torch.float32),
        }

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> dict[str, torch.Tensor]:
        grids = item_grids(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        # Padding rows: table row 0 with weight 0, frame 0 (no time term), rotary (0, 0), and one
        # trailing sequence; padding tokens pool row 0 with weight 0.
        metadata["cu_seqlens"] = item_cu_seqlens(grids, num_rows, budget.max_items)
        row = token = 0
        for grid in grids:
            indices, weights, frames, positions, pool_index, pool_weights = self._per_grid(grid)
            end, token_end = row + indices.shape[0], token + pool_index.shape[0]
            metadata["interp_indices"][row:end] = indices
            metadata["interp_weights"][row:end] = weights
            metadata["frame_index"][row:end] = frames
            metadata["position_ids"][row:end] = positions
            metadata["pool_index"][token:token_end] = pool_index + row
            metadata["pool_weights"][token:token_end] = pool_weights
            row, token = end, token_end
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        hidden = tower_hidden_states(self.tower.vision_tower, pixels, metadata)
        # [tokens, frames, kh*kw, D] weighted over frames: the tower's mean over each clip's frames
        weights = metadata["pool_weights"].to(hidden.dtype)[:, :, None, None]
        pooled = (hidden[metadata["pool_index"]] * weights).sum(dim=1)
        return [self.tower.mm_projector(pooled).squeeze(1)]

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        rules, unit = self.item_rules, self.merge_unit
        kh, kw = self.merge_kernel
        specs: list[ItemSpec] = []
        rows_left, tokens_left = num_rows, budget.num_tokens
        extra_left = budget.limit(EXTRA_ROWS) or 0
        while tokens_left >= 1 and len(specs) < min(MAX_SAMPLED_ITEMS, budget.max_items):
            max_blocks = min(tokens_left, rows_left // unit)
            if max_blocks < 1:
                break
            num_blocks = max_blocks if rng.random() < 0.2 else rng.randint(1, max(1, max_blocks // 2))
            height_blocks = rng.randint(1, num_blocks)
            width_blocks = max(1, num_blocks // height_blocks)
            h, w = height_blocks * kh, width_blocks * kw
            max_t = min(self.max_frames, rows_left // (h * w), 1 + extra_left // (h * w))
            t = rng.randint(2, max_t) if max_t >= 2 and rng.random() < 0.3 else 1
            spec = rules.item_spec(VIDEO if t > 1 else IMAGE, (t * h * w, *rules.row_shape), "float32", (t, h, w))
            specs.append(spec)
            rows_left -= spec.num_rows
            tokens_left -= spec.num_tokens
            extra_left -= spec.need(EXTRA_ROWS)
        return specs

    def _grid_metadata(self, grid: Grid) -> tuple[torch.Tensor, ...]:
        t, h, w = grid
        grid_thw = torch.tensor([grid], dtype=torch.long)
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, self._num_grid_per_side, mode=self._interpolation_mode, align_corners=self._align_corners,
        )
        # frame f of a clip reads time-table row f + 1; a single frame reads the zero row 0
        frames = (torch.arange(t) + int(t > 1)).repeat_interleave(h * w)
        positions = get_vision_position_ids(grid_thw, spatial_merge_size=1)
        kh, kw = self.merge_kernel
        base = torch.arange(t * h * w).view(t, h // kh, kh, w // kw, kw)
        base = base.permute(1, 3, 0, 2, 4).reshape((h // kh) * (w // kw), t, kh * kw)
        pool_index = torch.zeros(base.shape[0], self.max_frames, kh * kw, dtype=torch.long)
        pool_index[:, :t] = base
        pool_weights = torch.zeros(base.shape[0], self.max_frames)
        pool_weights[:, :t] = 1.0 / t
        return indices, weights.to(torch.float32), frames, positions, pool_index, pool_weights


# A full checkpoint (Moonshot's release, and what `save_pretrained` writes back) keeps the original
# key layout; transformers renames it on load (`conversion_mapping.py`, "kimi_k25"), splitting the
# fused `wqkv` and permuting q/k rows from interleaved to split-half rotary layout.
_RENAMES = (
    (re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.norm0\."), r"vision_tower.layers.\1.norm1."),
    (re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.norm1\."), r"vision_tower.layers.\1.norm2."),
    (re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc0\."), r"vision_tower.layers.\1.mlp.fc1."),
    (re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc1\."), r"vision_tower.layers.\1.mlp.fc2."),
    (re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.wo\."), r"vision_tower.layers.\1.attn.proj."),
    (re.compile(r"^vision_tower\.encoder\.final_layernorm\."), "vision_tower.final_layernorm."),
    (re.compile(r"^vision_tower\.encoder\.patch_embed\."), "vision_tower.patch_embed."),
    (re.compile(r"^vision_tower\.patch_embed\.pos_emb\.weight$"), "vision_tower.patch_embed.pos_emb.position_embeddings"),
    (re.compile(r"^mm_projector\.proj\.0\."), "mm_projector.in_proj."),
    (re.compile(r"^mm_projector\.proj\.2\."), "mm_projector.out_proj."),
    (re.compile(r"^model\.(vision_tower|mm_projector)\."), r"\1."),  # transformers' own layout
)
_WQKV = re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.wqkv\.(weight|bias)$")
# Keys of a full checkpoint that belong to the tower or the projector, in either layout.
CHECKPOINT_PREFIXES = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


def encoder_state(checkpoint: dict[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """`KimiK25Encoder`'s state from a full checkpoint's tower and projector tensors (keys under
    CHECKPOINT_PREFIXES; other keys are ignored), as transformers converts them on load."""
    state: dict[str, torch.Tensor] = {}
    for key, tensor in checkpoint.items():
        if not key.startswith(CHECKPOINT_PREFIXES):
            continue
        if match := _WQKV.match(key):
            layer, kind = match.groups()
            q, k, v = tensor.chunk(3, dim=0)
            prefix = f"vision_tower.layers.{layer}.attn."
            state[prefix + f"q_proj.{kind}"] = _permute_for_rope(q, num_heads)
            state[prefix + f"k_proj.{kind}"] = _permute_for_rope(k, num_heads)
            state[prefix + f"v_proj.{kind}"] = v
            continue
        name = key
        for pattern, target in _RENAMES:
            name, count = pattern.subn(target, name)
            if count:
                break
        state[name] = tensor
    return state


def convert_checkpoint(checkpoint: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The loader's hook (`CheckpointLayout.convert`): `encoder_state` with the tower's head count
    from its vision config."""
    return encoder_state(checkpoint, int(config.num_attention_heads))


def _permute_for_rope(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head from interleaved (x0, y0, x1, y1, ...) to split-half rotary order."""
    rows = tensor.shape[0]
    half = rows // num_heads // 2
    permuted = tensor.reshape(num_heads, half, 2, *tensor.shape[1:]).transpose(1, 2)
    return permuted.reshape(rows, *tensor.shape[1:]).contiguous()
