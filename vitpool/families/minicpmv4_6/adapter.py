"""MiniCPM-V 4.6 (`MiniCPMV4_6VisionModel`, a SigLIP-style NaViT with a window merger inside) and
its `MiniCPMV4_6Merger`, run over static buffers with the glue written here.

The model: a Conv2d patch embedding plus a learned square position table looked up at the
nearest bucket of each patch's fractional (row, column) in its slice; `insert_layer_id + 1`
pre-LN blocks at full resolution, one attention sequence per slice; the `vit_merger` (attention
inside each 2 x 2 window of patches, then an MLP merging the window into one row, plus the
window's mean); the remaining blocks at a quarter of the rows, again one sequence per slice;
`post_layernorm`; then, outside the tower in Hugging Face, the Merger's 2 x 2 merge and MLP into
the LLM's width. `MiniCPMV4_6Encoder` holds the tower and the Merger, so the adapter hands out
exactly what `MiniCPMV4_6Model.get_image_features` gives the LLM (its `pooler_output`, one tensor
per slice, concatenated). Only the default "16x" mode; "4x" (no `vit_merger`) is refused.

Why not Hugging Face's forward: it derives `cu_seqlens` from `target_sizes`, formats
`target_sizes` into an f-string on every call (a host read, which invalidated capture),
and its Merger loops over slices in Python with data-dependent slicing. Given a precomputed
`cu_seqlens` it would also apply it after the merge, where the rows are a quarter as many. So the
adapter drives the submodules itself, the same in transformers 5.17 and 5.24 (whose `vit_merger`
forwards differ):

- embeddings: `patch_embedding` over the [rows, C, P, P] buffer (one patch per row, the fused
  patch GEMM on a GPU) plus `position_embedding[position_ids]`;
- blocks: `layer(hidden, None, cu_seqlens=..., max_seqlen=...)` through vitpool's packed attention
  hook, with `cu_seqlens` over the rows and `cu_seqlens_merged` (= `cu_seqlens` / 4) after the
  merge; `max_seqlen` is the buffer's rows (a quarter after the merge), a Python int;
- window merge: a gather by `window_index` puts each 2 x 2 window's four patches on consecutive
  rows (slice by slice, windows in raster order), so window attention is one dense SDPA over
  [rows/4, heads, 4, head_dim] and the merge is a reshape to [rows/4, 4 * d];
- Merger: a gather by `merge_index` [tokens, 4] of the merged rows in the Merger's order (its
  `view(h/4, 2, w/4, 2)` and permute), reshaped to [tokens, 4 * d], then `merger.mlp[0]`.

Padding rows (a multiple of 16, at the end) read position 0, stay in place in window order, form
one trailing sequence in both `cu_seqlens`, and their tokens gather their own merged rows.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from transformers.vision_utils import get_vision_nearest_position_ids

from vitpool.errors import ConfigError
from vitpool.families.minicpmv4_6.rules import PATCHES_PER_TOKEN, MiniCPMV4_6Rules, parse_target_sizes
from vitpool.kernels.attention import install_packed_attention
from vitpool.models.adapter_base import AdapterBase, renames, sample_block_parts
from vitpool.models.compat import check_tower_parts, require_transformers
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.packing import Budget
from vitpool.specs import IMAGE, ItemSpec

FAMILY = "MiniCPM-V 4.6"
MAX_SAMPLED_SLICES = 3
# What a tower-only save's vision config carries besides Hugging Face's fields, for the Merger: the
# LLM's width, and these (with the full config's defaults, for a save without them).
TEXT_HIDDEN_SIZE = "text_hidden_size"
MERGER_DEFAULTS = {"downsample_mode": "16x", "merge_kernel_size": (2, 2), "merger_times": 1}
# The parts the forward reads (checked when the adapter is built).
TOWER_PARTS = (
    "vision_tower.embeddings.patch_embedding",
    "vision_tower.embeddings.position_embedding",
    "vision_tower.embeddings.num_patches_per_side",
    "vision_tower.encoder.layers",
    "vision_tower.post_layernorm",
    "vision_tower.config.insert_layer_id",
    "vision_tower.vit_merger.layer_norm1",
    *(
        f"vision_tower.vit_merger.self_attn.{name}"
        for name in ("q_proj", "k_proj", "v_proj", "out_proj", "num_heads", "head_dim", "scaling")
    ),
    *(f"vision_tower.vit_merger.{name}" for name in ("pre_norm", "linear_1", "act", "linear_2")),
    "merger.mlp",
    "merger.merge_kernel_size",
)


class MiniCPMV4_6Encoder(torch.nn.Module):
    """The tower and its Merger; state keys `vision_tower.*` and `merger.*`, as a full checkpoint
    in transformers' layout has them under `model.`."""

    def __init__(self, vision_tower: torch.nn.Module, merger: torch.nn.Module) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.merger = merger
        self.config = vision_tower.config


def check_supported(vision_config: Any, settings: dict[str, Any]) -> None:
    """ConfigError for what the static forward does not run: another downsample mode, merge or
    window kernel than 2 x 2, more than one merge round, or a merger layer outside the tower."""
    problems = []
    if settings["downsample_mode"] != "16x":
        problems.append(f'downsample_mode {settings["downsample_mode"]!r} (only "16x" is supported)')
    for name, value in (
        ("merge_kernel_size", settings["merge_kernel_size"]),
        ("window_kernel_size", vision_config.window_kernel_size),
    ):
        if tuple(value) != (2, 2):
            problems.append(f"{name} {tuple(value)} (only (2, 2) is supported)")
    if settings["merger_times"] != 1:
        problems.append(f"merger_times {settings['merger_times']} (only 1 is supported)")
    if not 0 <= vision_config.insert_layer_id < vision_config.num_hidden_layers:
        problems.append(
            f"insert_layer_id {vision_config.insert_layer_id} outside the tower's "
            f"{vision_config.num_hidden_layers} layers (the window merger would never run)"
        )
    if problems:
        raise ConfigError(f"{FAMILY}: vitpool does not run this model: {'; '.join(problems)}")


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> MiniCPMV4_6Encoder:
    """Fresh tower and Merger from a full MiniCPMV4_6Config or a vision config written by
    `MiniCPMV4_6Adapter.tower_only_config`.

    Raises:
        ValueError: the config lacks the LLM's width; ConfigError: an unsupported setting.
    """
    from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import MiniCPMV4_6Merger, MiniCPMV4_6VisionModel

    full = MiniCPMV4_6Adapter.projector_config(config)
    check_supported(full.vision_config, vars(full))
    vision_tower, merger = tower_and_projector(MiniCPMV4_6VisionModel, MiniCPMV4_6Merger, full, dtype)
    return MiniCPMV4_6Encoder(vision_tower, merger)


# A full checkpoint in transformers' layout holds the tower and Merger under `model.`; a tower-only
# save holds the encoder's own keys.
CHECKPOINT_PREFIXES = ("model.vision_tower.", "model.merger.", "vision_tower.", "merger.")


# Before 5.19 Hugging Face's window merger assumed every slice of an image has one size, so its
# `get_image_features`, this family's reference, gave wrong output (or a shape error) for most images;
# vitpool's tests compare with it, so the family is tested, and served, from 5.19 on.
MINIMUM_TRANSFORMERS = "5.19.0"
MINIMUM_TRANSFORMERS_WHY = "its window merger took slices of unlike sizes from 5.19 on"


class MiniCPMV4_6Adapter(AdapterBase):
    """Adapter for `MiniCPMV4_6Encoder` (MiniCPMV4_6VisionModel + MiniCPMV4_6Merger)."""

    # Named in `merger_settings`' error (MiniCPM-V 4.7's adapter names its own).
    FAMILY = FAMILY
    FULL_CONFIG_CLASS = "MiniCPMV4_6Config"
    VISION_MODEL_TYPE = "minicpmv4_6_vision"
    # The full checkpoint's `model.` goes; the other keys pass unchanged, so a strict load names them.
    CHECKPOINT_RENAMES = renames((r"^model\.(?=vision_tower\.|merger\.)", ""))

    @classmethod
    def merger_settings(cls, config: Any) -> tuple[Any, dict[str, Any]]:
        """The vision config and what the Merger reads (`text_hidden_size` and MERGER_DEFAULTS'
        names), from a full config or a vision config (VISION_MODEL_TYPE) written by
        `tower_only_config`.

        Raises:
            ValueError: neither (the Merger's output width is the LLM's, which a plain vision
                config lacks).
        """
        vision_config = getattr(config, "vision_config", None)
        text_config = getattr(config, "text_config", None)
        if vision_config is not None and text_config is not None:
            settings = {name: getattr(config, name) for name in MERGER_DEFAULTS}
            return vision_config, {TEXT_HIDDEN_SIZE: int(text_config.hidden_size), **settings}
        is_tower_only = getattr(config, "model_type", None) == cls.VISION_MODEL_TYPE
        if is_tower_only and getattr(config, TEXT_HIDDEN_SIZE, None):
            settings = {name: getattr(config, name, default) for name, default in MERGER_DEFAULTS.items()}
            return config, {TEXT_HIDDEN_SIZE: int(getattr(config, TEXT_HIDDEN_SIZE)), **settings}
        raise ValueError(
            f"{cls.FAMILY}'s Merger needs the LLM's hidden size: give the full model's config "
            f"({cls.FULL_CONFIG_CLASS}) or a vision config ({cls.VISION_MODEL_TYPE}) with "
            f"{TEXT_HIDDEN_SIZE!r}, as tower_only_config writes it; "
            f"got a {type(config).__name__} (model_type {getattr(config, 'model_type', None)!r})"
        )

    @classmethod
    def projector_config(cls, config: Any) -> Any:
        """What the Merger reads (`merge_kernel_size`, `merger_times`, `vision_config.hidden_size`,
        `text_config.hidden_size`) and its `downsample_mode`, from `merger_settings`."""
        vision_config, settings = cls.merger_settings(config)
        return SimpleNamespace(
            vision_config=vision_config,
            text_config=SimpleNamespace(hidden_size=settings[TEXT_HIDDEN_SIZE]),
            downsample_mode=settings["downsample_mode"],
            merge_kernel_size=tuple(settings["merge_kernel_size"]),
            merger_times=settings["merger_times"],
        )

    @classmethod
    def tower_only_config(cls, full_config: Any) -> Any:
        """The vision config of a full config with what the Merger needs added (`text_hidden_size`,
        `downsample_mode`, `merge_kernel_size`, `merger_times`): what a tower-only save of
        `MiniCPMV4_6Encoder` writes as its config.json."""
        vision_config, settings = cls.merger_settings(full_config)
        config = copy.deepcopy(vision_config)
        for name, value in settings.items():
            setattr(config, name, list(value) if isinstance(value, tuple) else value)
        return config

    def __init__(self, tower: MiniCPMV4_6Encoder) -> None:
        require_transformers(FAMILY, MINIMUM_TRANSFORMERS, MINIMUM_TRANSFORMERS_WHY)
        check_tower_parts(FAMILY, tower, TOWER_PARTS)
        vision_tower = tower.vision_tower
        config = vision_tower.config
        settings = {
            "downsample_mode": "16x",
            "merge_kernel_size": tower.merger.merge_kernel_size,
            "merger_times": len(tower.merger.mlp),
        }
        check_supported(config, settings)
        self.tower = tower
        self.item_rules = MiniCPMV4_6Rules(
            int(config.num_channels), int(config.patch_size), int(tower.merger.mlp[0].linear_2.out_features)
        )
        self._insert_layer_id = int(config.insert_layer_id)
        self._num_patches_per_side = int(vision_tower.embeddings.num_patches_per_side)
        self._per_slice = lru_cache(maxsize=1024)(self._slice_metadata)
        install_packed_attention(vision_tower)

    def max_rows(self, num_tokens: int) -> int:
        return num_tokens * PATCHES_PER_TOKEN

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "position_ids": TensorSpec((num_rows,), torch.long),
            # one sequence per slice, the padding's, the leading 0: over the rows, then the merged rows
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
            "cu_seqlens_merged": TensorSpec((budget.max_sequences + 2,), torch.int32),
            "window_index": TensorSpec((num_rows,), torch.long),
            "merge_index": TensorSpec((num_rows // PATCHES_PER_TOKEN, 4), torch.long),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        slices = [size for spec in specs for size in parse_target_sizes(spec.layout)]
        rows = sum(h * w for h, w in slices)
        tokens = rows // PATCHES_PER_TOKEN
        if (
            num_rows % PATCHES_PER_TOKEN
            or rows > num_rows
            or len(slices) > budget.max_sequences
            or tokens > budget.num_tokens
            or len(specs) > budget.max_items
        ):
            raise ValueError(
                f"{len(specs)} items need {rows} rows, {len(slices)} sequences and {tokens} tokens; "
                f"the buffers hold {num_rows} rows (a multiple of {PATCHES_PER_TOKEN}), "
                f"{budget.max_sequences} sequences, {budget.num_tokens} tokens and {budget.max_items} items"
            )
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        # Padding: position 0, in place in window order, its tokens gather their own merged rows.
        metadata["window_index"].copy_(torch.arange(num_rows))
        merged_rows = torch.arange(num_rows // 4).view(-1, 4)
        metadata["merge_index"].copy_(merged_rows)
        boundaries = [0]
        for h, w in slices:
            row, end = boundaries[-1], boundaries[-1] + h * w
            positions, window_index, merge_index = self._per_slice(h, w)
            metadata["position_ids"][row:end] = positions
            metadata["window_index"][row:end] = window_index + row
            token, token_end = row // PATCHES_PER_TOKEN, end // PATCHES_PER_TOKEN
            metadata["merge_index"][token:token_end] = merge_index + row // 4
            boundaries.append(end)
        # unused entries repeat the end: the padding rows are one trailing sequence
        cu_seqlens = metadata["cu_seqlens"]
        cu_seqlens.fill_(num_rows)
        cu_seqlens[: len(boundaries)] = torch.tensor(boundaries, dtype=torch.int32)
        metadata["cu_seqlens_merged"].copy_(cu_seqlens // 4)  # every slice and the padding: multiples of 16
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        vision_tower = self.tower.vision_tower
        num_rows = pixels.shape[0]  # static: Python ints from the buffer's shape
        embeddings = vision_tower.embeddings
        hidden = embeddings.patch_embedding(pixels).flatten(1)  # [rows, d]
        hidden = (hidden + embeddings.position_embedding(metadata["position_ids"])).unsqueeze(0)
        layers = vision_tower.encoder.layers
        for layer in layers[: self._insert_layer_id + 1]:
            hidden = layer(hidden, None, cu_seqlens=metadata["cu_seqlens"], max_seqlen=num_rows)
        hidden = self._window_merge(hidden[0], metadata["window_index"]).unsqueeze(0)  # [1, rows/4, d]
        for layer in layers[self._insert_layer_id + 1 :]:
            hidden = layer(hidden, None, cu_seqlens=metadata["cu_seqlens_merged"], max_seqlen=num_rows // 4)
        hidden = vision_tower.post_layernorm(hidden[0])
        merge_index = metadata["merge_index"]
        merged = hidden[merge_index].reshape(merge_index.shape[0], -1)  # [tokens, 4 * d]
        return [self.tower.merger.mlp[0](merged)]

    def _window_merge(self, hidden: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        """`vit_merger` over [rows, d] hidden states: attention inside each 2 x 2 window, then each
        window merged into one row -> [rows/4, d] (windows in `window_index` order)."""
        merger = self.tower.vision_tower.vit_merger
        attention = merger.self_attn
        ordered = hidden[window_index]  # each window's four patches on consecutive rows
        normed = merger.layer_norm1(ordered)
        num_windows, heads, head_dim = ordered.shape[0] // 4, attention.num_heads, attention.head_dim
        q, k, v = (
            projection(normed).view(num_windows, 4, heads, head_dim).transpose(1, 2)
            for projection in (attention.q_proj, attention.k_proj, attention.v_proj)
        )
        attended = F.scaled_dot_product_attention(q, k, v, scale=attention.scaling)  # [windows, heads, 4, hd]
        ordered = ordered + attention.out_proj(attended.transpose(1, 2).reshape(ordered.shape))
        windows = ordered.view(num_windows, 4, -1)
        merged = merger.linear_2(merger.act(merger.linear_1(merger.pre_norm(windows.flatten(1)))))
        return merged + windows.mean(dim=1)

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        rules = self.item_rules
        specs: list[ItemSpec] = []
        # a block: 4 x 4 patches, one token
        blocks = min(num_rows // PATCHES_PER_TOKEN, budget.num_tokens)
        for slices in sample_block_parts(
            rng, blocks, budget.max_sequences, self.sampled_items(budget), MAX_SAMPLED_SLICES
        ):
            sizes = [(4 * height, 4 * width) for height, width in slices]
            rows = sum(h * w for h, w in sizes)
            specs.append(rules.item_spec(IMAGE, (rows, *rules.row_shape), "float32", sizes))
        return specs

    def _slice_metadata(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A slice's position ids [h*w], its window order [h*w] (2 x 2 windows in raster order, each
        in raster order, as `get_vision_window_index` gives it for even grids) and its Merger
        gather [h*w/16, 4] into its merged rows (raster over (h/2, w/2))."""
        positions = get_vision_nearest_position_ids(torch.tensor([[h, w]]), self._num_patches_per_side)
        window_index = torch.arange(h * w).view(h // 2, 2, w // 2, 2).permute(0, 2, 1, 3).reshape(-1)
        half_h, half_w = h // 2, w // 2
        merge_index = torch.arange(half_h * half_w).view(half_h // 2, 2, half_w // 2, 2).permute(0, 2, 1, 3)
        return positions.long(), window_index, merge_index.reshape(-1, 4)


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = MiniCPMV4_6Adapter.tower_only_config
convert_checkpoint = MiniCPMV4_6Adapter.convert_checkpoint
