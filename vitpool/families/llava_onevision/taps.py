"""What LLaVA-OneVision's model does between its projector and its LLM, as a static gather: each
output token is a weighted sum of TAPS rows of a table (an item's projected tile features, row-major
within each tile, then the newline embedding), so the graph runs one gather whatever the items.

Written here per item, on the host, as Hugging Face's `LlavaOnevisionModel` computes it:

- an image of one tile (`pack_image_features`, no crops): the base tile's side² features, a newline;
- an image of a grid: the base tile's features, then the crops' feature grid (crop (i, j)'s patch
  (r, c) at row i * side + r, column j * side + c) cut to the rows and columns the unpadding keeps,
  pooled where the rules say, each row followed by a newline;
- a video (`get_video_features`, `apply_pooling`): each frame's side x side features pooled to
  ceil(side / 2)², frame after frame, then one newline.

A copied feature is one tap of weight 1 (the other three: weight 0 on the same row). A pooled one
is `F.interpolate(mode="bilinear", align_corners=False)` to an output size, as PyTorch computes it:
along each axis the source position scale * (i + 0.5) - 0.5 in float32 (scale = in / out), clamped
at 0, between its floor and the next position (the last one at the edge), weights the distance.
"""

from __future__ import annotations

import torch

from vitpool.families.llava_onevision.rules import LlavaOnevisionRules
from vitpool.specs import VIDEO

TAPS = 4  # bilinear: two source rows x two source columns
NEWLINE = -1  # an item's tap on the newline embedding (the table's last row once laid out)
Taps = tuple[torch.Tensor, torch.Tensor]  # taps [tokens, TAPS] (long), weights [tokens, TAPS] (float32)


def linear_taps(in_size: int, out_size: int) -> Taps:
    """Along one axis, `in_size` positions resized bilinearly to `out_size`: each output's two
    source positions [out, 2] and their weights [out, 2]."""
    scale = torch.tensor(in_size, dtype=torch.float32) / out_size
    source = (scale * (torch.arange(out_size, dtype=torch.float32) + 0.5) - 0.5).clamp(min=0)
    first = source.floor().long().clamp(max=in_size - 1)
    weight = (source - first).clamp(0, 1)
    second = first + (first < in_size - 1).long()
    return torch.stack([first, second], dim=1), torch.stack([1 - weight, weight], dim=1)


def bilinear_taps(
    rows: int, cols: int, out_rows: int, out_cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rows x cols grid resized bilinearly to out_rows x out_cols: per output (row-major) the
    source rows [out, TAPS] and columns [out, TAPS] of its taps, and their weights [out, TAPS]."""
    row_taps, row_weights = linear_taps(rows, out_rows)
    col_taps, col_weights = linear_taps(cols, out_cols)
    # output (r, c), tap (i, j): source (row_taps[r, i], col_taps[c, j]), weight row_w[r, i] * col_w[c, j]
    source_rows = row_taps[:, None, :, None].expand(out_rows, out_cols, 2, 2).reshape(-1, TAPS)
    source_cols = col_taps[None, :, None, :].expand(out_rows, out_cols, 2, 2).reshape(-1, TAPS)
    weights = (row_weights[:, None, :, None] * col_weights[None, :, None, :]).reshape(-1, TAPS)
    return source_rows, source_cols, weights


def copy_weights(num_tokens: int) -> torch.Tensor:
    """The weights of tokens that copy one row each: 1 on the first tap, 0 on the idle ones."""
    weights = torch.zeros(num_tokens, TAPS)
    weights[:, 0] = 1.0
    return weights


def copy_taps(indices: torch.Tensor) -> Taps:
    """Tokens that copy one row each: taps all on that row, `copy_weights`."""
    return indices[:, None].repeat(1, TAPS), copy_weights(indices.shape[0])


def item_taps(rules: LlavaOnevisionRules, modality: str, num_tiles: int, layout: tuple[int, ...]) -> Taps:
    """One item's taps (rows of its own tiles' features from 0, NEWLINE for the newline embedding)
    and weights, in the order the LLM receives its tokens (`rules.item_spec`'s count of them)."""
    side = rules.side
    if modality == VIDEO:
        rows, cols, weights = bilinear_taps(side, side, rules.frame_side, rules.frame_side)
        frames = torch.arange(num_tiles)[:, None, None] * side**2
        taps = (frames + (rows * side + cols)[None]).reshape(-1, TAPS)
        parts = [(taps, weights.repeat(num_tiles, 1)), copy_taps(torch.tensor([NEWLINE]))]
    elif num_tiles == 1:  # the base tile alone, and its newline
        parts = [copy_taps(torch.arange(side**2)), copy_taps(torch.tensor([NEWLINE]))]
    else:
        parts = [copy_taps(torch.arange(side**2)), crop_taps(rules, layout)]
    return torch.cat([taps for taps, _ in parts]), torch.cat([weights for _, weights in parts])


def crop_taps(rules: LlavaOnevisionRules, size: tuple[int, ...]) -> Taps:
    """The crops' tokens of an image of `size` (H, W): its kept features, row by row (pooled where
    the rules say), each row followed by a newline; the crops' tiles follow the base tile."""
    side = rules.side
    grid = rules.packed_grid(*size)
    if grid.is_pooled:
        rows, cols, weights = bilinear_taps(grid.kept_rows, grid.kept_cols, grid.out_rows, grid.out_cols)
    else:
        kept = torch.meshgrid(torch.arange(grid.kept_rows), torch.arange(grid.kept_cols), indexing="ij")
        rows, cols = (axis.reshape(-1, 1).repeat(1, TAPS) for axis in kept)
        weights = copy_weights(rows.shape[0])
    # a position of the crops' feature grid -> its row of the table: tile 1 + its crop, then its patch
    rows, cols = rows + grid.first_row, cols + grid.first_col
    crops = (rows // side) * grid.grid_cols + cols // side
    taps = (1 + crops) * side**2 + (rows % side) * side + cols % side
    shape = (grid.out_rows, grid.out_cols, TAPS)
    taps = torch.cat([taps.reshape(shape), torch.full((grid.out_rows, 1, TAPS), NEWLINE)], dim=1)
    newline_weights = copy_weights(grid.out_rows).reshape(grid.out_rows, 1, TAPS)
    weights = torch.cat([weights.reshape(shape), newline_weights], dim=1)
    return taps.reshape(-1, TAPS), weights.reshape(-1, TAPS)
