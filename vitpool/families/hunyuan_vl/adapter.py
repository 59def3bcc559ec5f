"""HunYuan-VL (HunyuanOCR): the Hugging Face tower `HunYuanVLVisionTransformer`, its patch merger
included, driven with precomputed metadata.

Everything the LLM receives for an image comes out of the tower's own class: a Conv2d patch
embedding of 16-pixel patches plus a learned square position table (`max_image_size / patch_size`
a side, after one unused cls row) resampled to each image's h x w patches by `F.interpolate`
(bilinear, `align_corners=False`, in fp32); SigLIP-style blocks (LayerNorm, attention with
biases, GELU MLP) attending over each image alone; then `patch_merger`, per image: RMSNorm, a
Conv2d m x m / stride m (a block of patches -> one row of 2d), GELU, a 1x1 Conv2d to 4d, a learned
`image_newline` column appended after every row of blocks, a Linear into the LLM's width, learned
`image_begin` / `image_end` rows around the image, and a final RMSNorm. So an image gives
(h/m) * (w/m + 1) + 2 tokens (`rules.py`), what `HunYuanVLModel.get_image_features` splits its
`pooler_output` by and the processor expands `<image>` to.

Row and item layout: the processor emits Qwen-style output, flattened patches [h*w, C*P*P] in
raster order (its patchify keeps row-major patch order) and a (1, h, w) row of `image_grid_thw`
per image. vitpool keeps both as they are (rows [C*P*P], the item's layout its grid), so
`vitpool.items_from` needs no cutter of its own and the tower's embedding reads the rows as its
forward does (reshaped to [C, P, P]).

What differs for static capture (the tower's forward loops over images on the host, interpolates
per grid, and splits by `grid_thw.tolist()`; the adapter runs its modules itself):

- the position table's resampling becomes 4 (bicubic: 16) taps per patch row, indices and weights
  precomputed per grid (`transformers.vision_utils.get_vision_interpolation_indices_and_weights`,
  raster order), applied to the table in fp32 as `F.interpolate` does it;
- the blocks run the packed attention over `cu_seqlens` (one sequence per image and a trailing one
  for the padding rows) with a static `max_seqlen`, the buffer's rows;
- the merger's per-image reshape and m x m convolution become one gather of every block's rows by
  a [blocks, m²] index (laid out [blocks, d, m, m], as the convolution sees a block), the
  convolutions on all blocks of the batch at once, and its `cat`s of newline, begin and end rows
  become one gather by a [tokens] index into [blocks; newline; begin; end] (the newline row goes
  through the Linear once, not once per row of blocks).

Buffer rows: an image of b blocks takes 4b rows (m = 2) and gives at least b + 3 tokens, so a
budget of n tokens needs at most m² * (n - 3) rows. Padding rows read table row 0 with weight 0 and
form their own attention sequence; padding blocks gather row 0 and padding tokens block 0.
"""

from __future__ import annotations

import random
import re
from collections.abc import Collection, Sequence
from functools import lru_cache

import torch
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from vitpool.errors import ConfigError
from vitpool.families.hunyuan_vl.rules import FEWEST_EXTRA_TOKENS, HunYuanVLRules, image_tokens
from vitpool.kernels.attention import install_packed_attention
from vitpool.models.adapter_base import AdapterBase
from vitpool.models.compat import check_tower_parts
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import Grid, item_cu_seqlens, item_grids
from vitpool.packing import Budget
from vitpool.specs import IMAGE, ItemSpec

# What `HunYuanVLAdapter.forward` uses of transformers' tower.
TOWER_PARTS = (
    "embeddings.patch_embedding",
    "embeddings.position_embedding",
    "embeddings.position_edge",
    "layers",
    "patch_merger.before_rms",
    "patch_merger.proj_conv",
    "patch_merger.proj_act",
    "patch_merger.proj_out",
    "patch_merger.mlp",
    "patch_merger.image_newline",
    "patch_merger.image_begin",
    "patch_merger.image_end",
    "patch_merger.after_rms",
)
# The table resamplings `get_vision_interpolation_indices_and_weights` reproduces, by their taps.
INTERPOLATION_TAPS = {"bilinear": 4, "bicubic": 16}
# A token's code in a grid's token layout where it is no block: rows after the batch's blocks.
NEWLINE, BEGIN, END = -1, -2, -3
Tensors = dict[str, torch.Tensor]

# A full checkpoint's tower (the record's prefixes): transformers' state_dict (`model.vision_tower.`),
# or Tencent's release layout (`vit.`, also what `save_pretrained` writes back through
# conversion_mapping.py's "hunyuan_vl" renames; `model.vit.`, which those renames read too); a
# tower-only save has the module's own keys.
_RENAMES = tuple(
    (re.compile(pattern), target)
    for pattern, target in (
        (r"^(model\.vision_tower|model\.vit|vit)\.", ""),
        (r"\.input_layernorm\.", ".layer_norm1."),
        (r"\.post_attention_layernorm\.", ".layer_norm2."),
        (r"\.mlp\.dense_h_to_4h\.", ".mlp.fc1."),
        (r"\.mlp\.dense_4h_to_h\.", ".mlp.fc2."),
        (r"^perceive\.proj\.0\.", "patch_merger.proj_conv."),
        (r"^perceive\.proj\.2\.", "patch_merger.proj_out."),
        (r"^perceive\.", "patch_merger."),
    )
)


def position_edge(family: str, tower: torch.nn.Module, modes: Collection[str]) -> int:
    """The side of the tower's position table (a cls row, then edge x edge positions), which the
    adapter resamples in one of `modes` (its `interpolate_mode`).

    Raises:
        ConfigError: another interpolate_mode, or a table of another number of rows.
    """
    mode = tower.config.interpolate_mode
    if mode not in modes:
        raise ConfigError(
            f"{family}: interpolate_mode {mode!r} is not run; vitpool resamples the position table "
            f"{' or '.join(modes)}"
        )
    embeddings = tower.embeddings
    edge = int(embeddings.position_edge)
    if embeddings.position_embedding.num_embeddings != edge**2 + 1:
        raise ConfigError(
            f"{family}: the position table has {embeddings.position_embedding.num_embeddings} rows; "
            f"the tower reads a cls row and {edge} x {edge} positions"
        )
    return edge


class HunYuanVLAdapter(AdapterBase):
    """Adapter for `HunYuanVLVisionTransformer` (vision model_type "hunyuan_vl_vision"): patch rows
    in, the merger's tokens (blocks, newlines, begin and end) out."""

    @classmethod
    def convert_checkpoint(
        cls, state: dict[str, torch.Tensor], config: object = None
    ) -> dict[str, torch.Tensor]:
        """The tower's state from a checkpoint's tensors in any layout above: each rename applies
        in turn, not the first that matches alone (the prefix goes, then the release's names become
        transformers'); the tower's own keys map to themselves, other keys pass unchanged (a strict
        load names them). `config` is not needed."""
        converted = {}
        for key, tensor in state.items():
            for pattern, target in _RENAMES:
                key = pattern.sub(target, key)
            converted[key] = tensor
        return converted

    def __init__(self, tower: torch.nn.Module) -> None:
        check_tower_parts("HunYuan-VL", tower, TOWER_PARTS)
        config = tower.config
        self.edge = position_edge("HunYuan-VL", tower, INTERPOLATION_TAPS)
        self.tower = tower
        self.channels, self.patch_size = int(config.num_channels), int(config.patch_size)
        self.merge_size = int(tower.patch_merger.spatial_merge_size)
        self.merge_unit = self.merge_size**2
        self.item_rules = HunYuanVLRules(
            self.channels * self.patch_size**2, self.merge_size, int(tower.patch_merger.mlp.out_features)
        )
        self.interpolate_mode = mode = config.interpolate_mode
        self.taps = INTERPOLATION_TAPS[mode]
        self._per_grid = lru_cache(maxsize=1024)(self._grid_tensors)
        install_packed_attention(tower)

    def max_rows(self, num_tokens: int) -> int:
        # every image gives FEWEST_EXTRA_TOKENS or more tokens beyond its blocks (module docstring)
        return self.merge_unit * max(num_tokens - FEWEST_EXTRA_TOKENS, 1)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "interp_indices": TensorSpec((num_rows, self.taps), torch.long),
            "interp_weights": TensorSpec((num_rows, self.taps), torch.float32),
            # one sequence per image, the padding's, the leading 0
            "cu_seqlens": TensorSpec((budget.max_items + 2,), torch.int32),
            "merge_index": TensorSpec((num_rows // self.merge_unit, self.merge_unit), torch.long),
            "token_index": TensorSpec((budget.num_tokens,), torch.long),
        }

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> Tensors:
        grids = item_grids(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        metadata["cu_seqlens"] = item_cu_seqlens(grids, num_rows, budget.max_items)
        # the merger's extra rows follow the buffer's blocks: newline, begin, end
        first_extra = num_rows // self.merge_unit
        row = token = 0
        for grid in grids:
            indices, weights, merge_index, layout = self._per_grid(grid)
            row_end, token_end = row + indices.shape[0], token + layout.shape[0]
            block = row // self.merge_unit
            metadata["interp_indices"][row:row_end] = indices
            metadata["interp_weights"][row:row_end] = weights
            metadata["merge_index"][block : block + merge_index.shape[0]] = merge_index + row
            metadata["token_index"][token:token_end] = torch.where(
                layout >= 0, layout + block, first_extra - 1 - layout
            )
            row, token = row_end, token_end
        return metadata

    def merged_blocks(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tower on the buffer's rows, up to the merger's convolutions: one row per block of
        m x m patches (HunYuan V4 VL's adapter runs the same tower and merger this far)."""
        tower, merger = self.tower, self.tower.patch_merger
        embeddings = tower.embeddings
        num_rows = pixels.shape[0]
        conv = embeddings.patch_embedding
        patches = pixels.reshape(num_rows, self.channels, self.patch_size, self.patch_size).to(
            conv.weight.dtype
        )
        hidden = conv(patches).flatten(1)  # [rows, d]
        # F.interpolate on the table in fp32, as taps: the table's rows past its cls row
        table = embeddings.position_embedding.weight[1:]
        indices, weights = metadata["interp_indices"], metadata["interp_weights"]
        positions = sum(
            torch.nn.functional.embedding(indices[:, tap], table).float() * weights[:, tap, None]
            for tap in range(self.taps)
        )
        hidden = (hidden + positions.to(hidden.dtype)).unsqueeze(0)  # the blocks take a batch of one
        cu_seqlens = metadata["cu_seqlens"]
        for layer in tower.layers:
            # static: a Python int from the buffer's shape, so the packed attention never reads
            # cu_seqlens back
            hidden = layer(hidden, attention_mask=None, cu_seqlens=cu_seqlens, max_seqlen=num_rows)
        normed = merger.before_rms(hidden[0])
        merge_index = metadata["merge_index"]
        m = self.merge_size
        # [blocks, m², d] -> [blocks, d, m, m]: each block as the m x m / stride m convolution reads it
        blocks = normed[merge_index].transpose(1, 2).reshape(merge_index.shape[0], -1, m, m)
        return merger.proj_out(merger.proj_act(merger.proj_conv(blocks))).flatten(1)

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        merger = self.tower.patch_merger
        merged = self.merged_blocks(pixels, metadata)  # [blocks, 4d]
        dtype = merged.dtype
        projected = merger.mlp(torch.cat([merged, merger.image_newline.to(dtype)[None]]))
        extra = [merger.image_begin.to(dtype)[None], merger.image_end.to(dtype)[None]]
        return [merger.after_rms(torch.cat([projected, *extra])[metadata["token_index"]])]

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        """Random images that together fit `num_rows` rows, the budget's tokens and its items: some
        fill what is left, most take a part of it; wide ones, tall ones, and ones wider or taller
        than the position table (its resampling then stretches)."""
        m, rules = self.merge_size, self.item_rules
        specs: list[ItemSpec] = []
        rows_left, tokens_left = num_rows, budget.num_tokens
        while len(specs) < self.sampled_items(budget):
            # blocks of the largest image that fits: one row of blocks spends the fewest extra tokens
            most_blocks = min(rows_left // self.merge_unit, tokens_left - FEWEST_EXTRA_TOKENS)
            if most_blocks < 1:
                break
            num_blocks = most_blocks if rng.random() < 0.2 else rng.randint(1, max(1, most_blocks // 2))
            height_blocks = rng.randint(1, num_blocks)
            width_blocks = max(1, num_blocks // height_blocks)
            while image_tokens(height_blocks * m, width_blocks * m, m) > tokens_left:
                height_blocks -= 1  # every row of blocks adds a newline token: one row always fits
            h, w = height_blocks * m, width_blocks * m
            spec = rules.item_spec(IMAGE, (h * w, *rules.row_shape), "float32", (1, h, w))
            specs.append(spec)
            rows_left -= h * w
            tokens_left -= spec.num_tokens
        return specs

    def _grid_tensors(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One image's table taps (indices, weights) [h*w, taps] in raster order; its blocks' rows
        [blocks, m²] (block (bh, bw) takes rows (bh*m + i) * w + bw*m + j, i and j as the kernel's
        positions); and its tokens' layout [tokens]: BEGIN, each row of blocks (block numbers) and
        NEWLINE, END."""
        _, h, w = grid
        m = self.merge_size
        indices, weights = get_vision_interpolation_indices_and_weights(
            torch.tensor([grid], dtype=torch.long),
            self.edge,
            mode=self.interpolate_mode,
            align_corners=False,
            spatial_merge_size=1,
        )
        merge_index = torch.arange(h * w).view(h // m, m, w // m, m).transpose(1, 2).reshape(-1, m * m)
        block_rows = torch.arange((h // m) * (w // m)).view(h // m, w // m)
        newlines = torch.full((h // m, 1), NEWLINE)
        layout = torch.cat(
            [torch.tensor([BEGIN]), torch.cat([block_rows, newlines], 1).flatten(), torch.tensor([END])]
        )
        return indices, weights.to(torch.float32), merge_index, layout


# The loader's hook and its long-standing name (`vitpool.models.family.adapter_checkpoint`).
convert_checkpoint = HunYuanVLAdapter.convert_checkpoint
