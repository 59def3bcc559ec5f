"""HunYuan V4 VL: the Hugging Face tower `HYV4VLVisionModel`, its patch merger included, driven with
precomputed metadata.

The tower is HunYuan-VL's (`vitpool.families.hunyuan_vl.adapter`) with three changes:

- the learned position table (a cls row, then `max_image_size / patch_size` a side) is resampled by
  `F.interpolate(scale_factor=((h + 0.1) / edge, (w + 0.1) / edge))`, not to `size=(h, w)`: the
  same output size, a slightly shifted sampling grid, which the shared
  `transformers.vision_utils.get_vision_interpolation_indices_and_weights` (integer sizes) does not
  express. The taps here come from `F.interpolate` itself, run on an identity table once per axis
  and grid (bilinear and bicubic are separable), so they follow torch's arithmetic exactly;
- the merger (per frame: RMSNorm, a Conv2d m x m / stride m, GELU, a 1x1 Conv2d straight into the
  LLM's width) has no Linear, no final RMSNorm and no begin or end tokens; its learned
  `image_newline` (already in the LLM's width) follows every row of blocks;
- videos: every frame is its own attention sequence and is merged on its own, frame after frame,
  t * (h/m) * (w/m + 1) tokens (`rules.py`).

What runs in the graph: the patch embedding, the table's taps (a weighted sum of gathered table rows
in fp32, as `F.interpolate` on the fp32 table), the blocks' packed attention over `cu_seqlens` with
a static `max_seqlen`, and the merger as one gather of every block's m² rows by a [blocks, m²] index
(laid out [blocks, d, m, m], as the convolution sees a block), the convolutions over all blocks of
the batch at once, and one gather of [blocks; newline] by a [tokens] index. On the host, once per
grid (cached): the taps, the block index and the token layout.

Buffer rows: a frame of b blocks takes m² b rows and gives at least b + 1 tokens, so a budget of n
tokens needs at most m² (n - 1) rows (one frame, one row of blocks). Padding rows read table row 0
with weight 0 and form their own attention sequence; padding blocks gather row 0, padding tokens
block 0.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import lru_cache

import torch

from vitpool.errors import ConfigError
from vitpool.families.hunyuan_vl.adapter import HunYuanVLAdapter, position_edge
from vitpool.families.hy_v4_vl.rules import HYV4VLRules, frame_tokens
from vitpool.models.compat import check_tower_parts
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import Grid, SpatialMergeAdapter, frame_cu_seqlens, grids_of
from vitpool.packing import Budget
from vitpool.specs import IMAGE, VIDEO, ItemSpec

# What `HYV4VLAdapter.forward` uses of transformers' tower.
TOWER_PARTS = (
    "embeddings.patch_embedding",
    "embeddings.position_embedding",
    "embeddings.position_edge",
    "layers",
    "patch_merger.before_rms",
    "patch_merger.proj_conv",
    "patch_merger.proj_act",
    "patch_merger.proj_out",
    "patch_merger.image_newline",
)
# The table resamplings run, by their taps on one axis (2-D taps: their square).
AXIS_TAPS = {"bilinear": 2, "bicubic": 4}
# The sampling grid's shift: the tower resamples an axis of n patches by a scale of (n + 0.1) / edge.
SCALE_SHIFT = 0.1
# A token's code in a grid's token layout where it is no block: the row after the batch's blocks.
NEWLINE = -1
Tensors = dict[str, torch.Tensor]
# The release names the merger's RMSNorm `perceive.norm` (HunYuan-VL's renames cover the rest).
_NORM_RENAME = re.compile(r"^patch_merger\.norm\.")


def axis_taps(size: int, edge: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The table rows [size, taps] and weights [size, taps] that `F.interpolate(mode,
    scale_factor=(size + 0.1) / edge, align_corners=False)` reads for each of `size` outputs along one
    axis of `edge` rows: read off torch's own resampling of an identity table, so the borders
    (clamped taps, summed) and the rounding are torch's. Unused taps have weight 0."""
    identity = torch.eye(edge, dtype=torch.float32)[None, :, :, None]  # [1, channel = row, edge, 1]
    resampled = torch.nn.functional.interpolate(
        identity, scale_factor=((size + SCALE_SHIFT) / edge, 1.0), mode=mode, align_corners=False
    )
    if resampled.shape[2] != size:
        raise ConfigError(
            f"HunYuan V4 VL: resampling {edge} table rows gave {resampled.shape[2]}, not {size}"
        )
    matrix = resampled[0, :, :, 0].T  # [size, edge]: output i's weight of each table row
    indices = matrix.abs().topk(AXIS_TAPS[mode], dim=1).indices  # bicubic weights can be negative
    return indices, matrix.gather(1, indices)


class HYV4VLAdapter(SpatialMergeAdapter):
    """Adapter for `HYV4VLVisionModel` (vision model_type "hy_v4_vl_vision"): patch rows of images and
    videos in, the merger's tokens (blocks and newlines, frame after frame) out."""

    FULL_MODEL_TYPES = ("hy_v4_vl",)

    @classmethod
    def convert_checkpoint(
        cls, state: dict[str, torch.Tensor], config: object = None
    ) -> dict[str, torch.Tensor]:
        """The tower's state from transformers' keys (`model.vision_tower.`), the release's (`vit.`,
        what `save_pretrained` writes back) or a tower-only save's: HunYuan-VL's renames, then the
        release's name of the merger's RMSNorm. `config` is not needed."""
        converted = HunYuanVLAdapter.convert_checkpoint(state)
        return {_NORM_RENAME.sub("patch_merger.before_rms.", key): value for key, value in converted.items()}

    def __init__(self, tower: torch.nn.Module) -> None:
        check_tower_parts("HunYuan V4 VL", tower, TOWER_PARTS)
        config = tower.config
        self.edge = position_edge("HunYuan V4 VL", tower, AXIS_TAPS)
        self.channels, self.patch_size = int(config.num_channels), int(config.patch_size)
        merge = int(tower.patch_merger.spatial_merge_size)
        width = int(tower.patch_merger.image_newline.shape[0])
        rules = HYV4VLRules(self.channels * self.patch_size**2, merge, ((width,),))
        super().__init__(tower, rules)  # installs vitpool's packed attention in the tower
        self.interpolate_mode = mode = config.interpolate_mode
        self.taps = AXIS_TAPS[mode] ** 2
        self._per_grid = lru_cache(maxsize=1024)(self._grid_tensors)

    def max_rows(self, num_tokens: int) -> int:
        # every frame gives one newline token or more beyond its blocks (module docstring)
        return self.merge_unit * max(num_tokens - 1, 1)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "interp_indices": TensorSpec((num_rows, self.taps), torch.long),
            "interp_weights": TensorSpec((num_rows, self.taps), torch.float32),
            # one sequence per frame, the padding's, the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
            "merge_index": TensorSpec((num_rows // self.merge_unit, self.merge_unit), torch.long),
            "token_index": TensorSpec((budget.num_tokens,), torch.long),
        }

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> Tensors:
        grids = grids_of(specs, num_rows, budget)
        tokens = sum(spec.num_tokens for spec in specs)
        if tokens > budget.num_tokens or len(specs) > budget.max_items:
            raise ValueError(
                f"{len(specs)} items give {tokens} tokens; the buffers hold {budget.num_tokens} tokens and "
                f"{budget.max_items} items"
            )
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        metadata["cu_seqlens"] = frame_cu_seqlens(grids, num_rows, budget.max_sequences)
        newline = num_rows // self.merge_unit  # the row after the buffer's blocks
        row = token = 0
        for grid in grids:
            indices, weights, merge_index, layout = self._per_grid(grid)
            row_end, token_end = row + indices.shape[0], token + layout.shape[0]
            block = row // self.merge_unit
            metadata["interp_indices"][row:row_end] = indices
            metadata["interp_weights"][row:row_end] = weights
            metadata["merge_index"][block : block + merge_index.shape[0]] = merge_index + row
            metadata["token_index"][token:token_end] = torch.where(layout >= 0, layout + block, newline)
            row, token = row_end, token_end
        return metadata

    # the tower and the merger's convolutions are HunYuan-VL's; its projection of them is not
    merged_blocks = HunYuanVLAdapter.merged_blocks

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        merged = self.merged_blocks(pixels, metadata)  # [blocks, width]
        newline = self.tower.patch_merger.image_newline.to(merged.dtype)[None]
        rows = torch.cat([merged, newline])
        return [rows[metadata["token_index"]]]

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        """Random images and two-frame videos that together fit `num_rows` rows and the budget's
        tokens, sequences and items: some fill what is left, most take a part of it; wide ones, tall
        ones, and ones wider or taller than the position table (its resampling then stretches)."""
        m, rules = self.merge_size, self.item_rules
        specs: list[ItemSpec] = []
        rows_left, tokens_left, sequences_left = num_rows, budget.num_tokens, budget.max_sequences
        while len(specs) < self.sampled_items(budget) and sequences_left > 0:
            frames = 2 if sequences_left >= 2 and rng.random() < 0.3 else 1
            # blocks a frame of the largest item that fits: one row of blocks spends the fewest tokens
            most_blocks = min(rows_left // (self.merge_unit * frames), tokens_left // frames - 1)
            if most_blocks < 1 and frames == 2:  # a clip no longer fits: an image may
                frames, most_blocks = 1, min(rows_left // self.merge_unit, tokens_left - 1)
            if most_blocks < 1:
                break
            num_blocks = most_blocks if rng.random() < 0.2 else rng.randint(1, max(1, most_blocks // 2))
            height_blocks = rng.randint(1, num_blocks)
            width_blocks = max(1, num_blocks // height_blocks)
            while frames * frame_tokens(height_blocks * m, width_blocks * m, m) > tokens_left:
                height_blocks -= 1  # every row of blocks adds a newline token: one row always fits
            grid = (frames, height_blocks * m, width_blocks * m)
            item_rows = grid[0] * grid[1] * grid[2]
            modality = VIDEO if frames > 1 else IMAGE
            spec = rules.item_spec(modality, (item_rows, *rules.row_shape), "float32", grid)
            specs.append(spec)
            rows_left -= item_rows
            tokens_left -= spec.num_tokens
            sequences_left -= frames
        return specs

    def _grid_tensors(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One item's table taps (indices, weights) [t*h*w, taps], each frame's in raster order; its
        blocks' rows [blocks, m²] (block (bh, bw) of frame f takes rows f*h*w + (bh*m + i) * w + bw*m
        + j, i and j as the kernel's positions); and its tokens' layout [tokens]: per frame, each row
        of blocks (block numbers) and NEWLINE."""
        t, h, w = grid
        m, edge = self.merge_size, self.edge
        rows_h, weights_h = axis_taps(h, edge, self.interpolate_mode)
        rows_w, weights_w = axis_taps(w, edge, self.interpolate_mode)
        n = rows_h.shape[1]
        # separable: tap (a, b) of patch (i, j) reads table row rows_h[i, a] * edge + rows_w[j, b]
        indices = (rows_h[:, None, :, None] * edge + rows_w[None, :, None, :]).reshape(h * w, n * n)
        weights = (weights_h[:, None, :, None] * weights_w[None, :, None, :]).reshape(h * w, n * n)
        frame_blocks = (h // m) * (w // m)
        merge_index = torch.arange(h * w).view(h // m, m, w // m, m).transpose(1, 2).reshape(-1, m * m)
        block_rows = torch.arange(frame_blocks).view(h // m, w // m)
        frame_layout = torch.cat([block_rows, torch.full((h // m, 1), NEWLINE)], 1).flatten()
        frames = torch.arange(t)
        merge_index = (merge_index[None] + (frames * h * w)[:, None, None]).reshape(-1, m * m)
        numbered = frame_layout[None] + (frames * frame_blocks)[:, None]
        layout = torch.where(frame_layout >= 0, numbered, NEWLINE)
        return indices.repeat(t, 1), weights.repeat(t, 1), merge_index, layout.flatten()


# The loader's hook and its long-standing name (`vitpool.models.family.adapter_checkpoint`).
convert_checkpoint = HYV4VLAdapter.convert_checkpoint
