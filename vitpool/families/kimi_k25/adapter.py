"""Kimi-K2.5 / K2.6 (MoonViT, `Kimi_K25VisionModel`) and its `mm_projector`.

The tower takes 4-D patches [rows, 3, P, P] with a (t, h, w) grid per item: a learned position
table resampled bicubically to each grid, a sinusoidal time embedding per frame of a clip (none
for a single frame), 2D axial rotary positions, attention over a whole clip at once (one sequence
per item), and a pooling of kh x kw patches averaged over the clip's frames. The projector
(`Kimi_K25MultimodalProjection`, outside the tower class in Hugging Face) turns each pooled
token into the LLM's width: `KimiK25Encoder` holds both, so the adapter hands out exactly what
`Kimi_K25Model.get_image_features` gives the LLM.

Every grid-dependent tensor is precomputed on the host (`interp_indices`, `interp_weights`,
`frame_index`, `position_ids`, `cu_seqlens`, a static `max_seqlen`; what it shares with
PaddleOCR-VL is `vitpool.models.patch_adapter`'s). `tower_hidden_states` is the one place that
runs Hugging Face's tower, up to its final LayerNorm: the tower's own temporal pooling changed its
helper's contract in transformers 5.24 (a gather index before, a scatter index, weights and a
count since) and cannot be static across items of different t anyway, so the adapter pools the
last hidden state itself with a [tokens, slots, kh*kw] index and per-frame weights 1/t (0 for
slots past an item's frames).

A clip of t frames takes t times an image's rows for the same tokens, so the adapter has two
paths over the one tower (`KimiK25Adapter.paths`, routed by the item rules: see
`vitpool.families.kimi_k25.rules`), each with buffers, budgets and graphs of its own: images (and
single frames) in buffers of kh*kw rows per token that pool one slot, and clips of 2 to
`pos_emb_time` frames in buffers of `clip_frames` * kh*kw rows per token that pool `pos_emb_time`
slots. A clip of fewer frames than the buffers hold fills its own rows and slots; the rest is
padding (rows of a trailing attention sequence, slots of weight 0), so its result is exact.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from vitpool.families.kimi_k25.rules import CLIP, EXTRA_ROWS, KimiK25Rules
from vitpool.models.adapter_base import (
    TEXT_HIDDEN_SIZE,
    ConfigField,
    PlainPathAdapter,
    renamed_key,
)
from vitpool.models.compat import check_tower_parts
from vitpool.models.patch_adapter import PatchRowAdapter
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import TensorSpec
from vitpool.packing import Budget
from vitpool.rules.patch_rows import Grid
from vitpool.specs import ItemSpec


class KimiK25Encoder(torch.nn.Module):
    """The tower and its projector; state keys `vision_tower.*` and `mm_projector.*` (a full
    checkpoint has them under `model.`)."""

    def __init__(self, vision_tower: torch.nn.Module, mm_projector: torch.nn.Module) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.mm_projector = mm_projector
        self.config = vision_tower.config


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> KimiK25Encoder:
    """Fresh tower and projector from a full Kimi_K25Config or a vision config with the adapter's
    PROJECTOR_FIELDS."""
    from transformers.models.kimi_k25.modeling_kimi_k25 import (
        Kimi_K25MultimodalProjection,
        Kimi_K25VisionModel,
    )

    tower, projector = tower_and_projector(
        Kimi_K25VisionModel, Kimi_K25MultimodalProjection, KimiK25Adapter.projector_config(config), dtype
    )
    return KimiK25Encoder(tower, projector)


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


class KimiK25PathAdapter(PatchRowAdapter):
    """One path of `KimiK25Adapter`: images ("", kh*kw rows per token) or clips (CLIP,
    `clip_frames` * kh*kw rows per token), through the one shared tower."""

    ROW_INDEX_NAMES = ("pool_index",)

    def __init__(self, tower: KimiK25Encoder, item_rules: KimiK25Rules, path: str) -> None:
        vision = tower.vision_tower
        self.max_frames = item_rules.max_frames
        frames = (2, self.max_frames) if path == CLIP else (1, 1)
        super().__init__(
            tower, vision, item_rules, vision.patch_embed.pos_emb, item_rules.row_factor(path), frames
        )

    def own_metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "frame_index": TensorSpec((num_rows,), torch.long),
            "pool_index": TensorSpec(
                (budget.num_tokens, self._pool_slots(budget), self.merge_unit), torch.long
            ),
            "pool_weights": TensorSpec((budget.num_tokens, self._pool_slots(budget)), torch.float32),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        # Padding rows: frame 0 (no time term); padding tokens pool row 0 with weight 0.
        slots = self._pool_slots(budget)
        if any(spec.layout[0] > slots for spec in specs):
            raise ValueError(
                f"a clip of {max(spec.layout[0] for spec in specs)} frames in a budget that holds no extra "
                f"rows ({budget}); clips run on the path {CLIP!r}"
            )
        return super().build_metadata(specs, num_rows, budget)

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        hidden = tower_hidden_states(self.tower.vision_tower, pixels, metadata)
        # [tokens, frames, kh*kw, D] weighted over frames: the tower's mean over each clip's frames
        weights = metadata["pool_weights"].to(hidden.dtype)[:, :, None, None]
        pooled = (hidden[metadata["pool_index"]] * weights).sum(dim=1)
        return [self.tower.mm_projector(pooled).squeeze(1)]

    def grid_metadata(self, grid: Grid) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        t, h, w = grid
        # frame f of a clip reads time-table row f + 1; a single frame reads the zero row 0
        frames = (torch.arange(t) + int(t > 1)).repeat_interleave(h * w)
        kh, kw = self.merge_kernel
        # token (bh, bw) pools patch (i, j) of its kh x kw block in every frame: [tokens, t, kh*kw]
        pool_index = torch.arange(t * h * w).view(t, h // kh, kh, w // kw, kw)
        pool_index = pool_index.permute(1, 3, 0, 2, 4).reshape((h // kh) * (w // kw), t, kh * kw)
        pool_weights = torch.full(pool_index.shape[:2], 1.0 / t)
        return {"frame_index": frames}, {"pool_index": pool_index, "pool_weights": pool_weights}

    def _pool_slots(self, budget: Budget) -> int:
        """Frames a token pools over: every frame a clip may have where the budget holds clips
        (extra rows), else 1, so that image batches gather one frame, not `max_frames`."""
        return self.max_frames if budget.limit(EXTRA_ROWS) else 1


class KimiK25Adapter(PlainPathAdapter):
    """Adapter for `KimiK25Encoder` (Kimi_K25VisionModel + mm_projector): two paths over the one
    tower, images and videos of one frame on "" and clips on CLIP (`vitpool.families.kimi_k25.rules`).

    Args:
        tower: the encoder module; both paths run it (no copy of its weights).
        clip_frames: rows of a clip budget's buffers per (kh*kw * token): the most frames a clip of
            as many tokens as the budget may have. None: the model's `pos_emb_time` (4 for
            Kimi-K2.5: its video processor's chunks). 1: no clip path; clips run eager, alone.

    Raises:
        ValueError: a position table that is not square, or `clip_frames` outside 1..pos_emb_time.
        TypeError: `clip_frames` not an integer.
        ConfigError: the installed transformers' tower lacks a part the adapter runs.

    The protocol's per-path methods (`max_rows`, `metadata_specs`, ...) are the image path's, for
    code that sees one path; `GraphEncoder` runs each path's own (`paths`).
    """

    # What a tower-only save's vision config carries besides Hugging Face's fields, for the projector.
    PROJECTOR_FIELDS = (
        TEXT_HIDDEN_SIZE,
        ConfigField("projection_hidden_size", "projection_hidden_size"),
        ConfigField("projection_layer_norm_eps", "projection_layer_norm_eps"),
    )
    PROJECTOR_SUBJECT = "a Kimi-K2.5 vision config"
    PROJECTOR_ADVICE = (
        "to build its mm_projector; give the full model's config (Kimi_K25Config) or a tower-only save that "
        "carries them"
    )

    def __init__(self, tower: KimiK25Encoder, clip_frames: int | None = None) -> None:
        vision = tower.vision_tower
        config = vision.config
        if config.pos_emb_height != config.pos_emb_width:
            raise ValueError("Kimi-K2.5's position table must be square (pos_emb_height == pos_emb_width)")
        check_tower_parts("Kimi-K2.5", vision, TOWER_PARTS)
        kh, kw = config.merge_kernel_size
        max_frames = int(config.pos_emb_time)
        self.tower = tower
        self.item_rules = KimiK25Rules(
            3,
            int(config.patch_size),
            (int(kh), int(kw)),
            max_frames,
            int(tower.mm_projector.out_proj.out_features),
            max_frames if clip_frames is None else clip_frames,
        )
        self.paths = {
            path: KimiK25PathAdapter(tower, self.item_rules, path) for path in self.item_rules.paths
        }

    @classmethod
    def convert_checkpoint(
        cls, checkpoint: dict[str, torch.Tensor], config: Any = None
    ) -> dict[str, torch.Tensor]:
        """The loader's hook (`CheckpointLayout.convert`): `encoder_state` with the tower's head
        count from its vision config."""
        return encoder_state(checkpoint, int(config.num_attention_heads))


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
    (
        re.compile(r"^vision_tower\.patch_embed\.pos_emb\.weight$"),
        "vision_tower.patch_embed.pos_emb.position_embeddings",
    ),
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
        state[renamed_key(key, _RENAMES)] = tensor
    return state


def _permute_for_rope(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head from interleaved (x0, y0, x1, y1, ...) to split-half rotary order."""
    rows = tensor.shape[0]
    half = rows // num_heads // 2
    permuted = tensor.reshape(num_heads, half, 2, *tensor.shape[1:]).transpose(1, 2)
    return permuted.reshape(rows, *tensor.shape[1:]).contiguous()


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = KimiK25Adapter.tower_only_config
convert_checkpoint = KimiK25Adapter.convert_checkpoint
