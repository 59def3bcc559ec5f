"""Step-3.7 (`Step3p7VisionModel`) and its `multi_modal_projector`: two paths through one tower.

`Step3p7ImageProcessor` cuts an image into a global view (`pixel_values`, one 728² tile) and,
for a large image, local crops (`pixel_values_local`, tiles cut by a sliding window and resized to
its `patch_size`, 504 pixels by default). The model runs both through the same tower at their own
resolution: patches, learned positions interpolated to the tile's grid, 2-D rotary positions, the
layers, then two stride-2 convolutions (a 4 x 4 reduction: 169 tokens a global view, 81 a 504²
crop) and the projector into the LLM's width. `get_image_features` hands the LLM an image's crops
first, then its global view. In vitpool each input is a path (`vitpool.rules.paths`): its own
tiles, budgets and graphs; an item's two parts are joined in that order.

The tower takes a square tile of any side S of at least one patch: the patch convolution reads
floor(S / 14) patches a side (pixels past the last whole patch are not read), the positions are
interpolated (bilinear) to that grid, and each stride-2 convolution rounds up, so a tile gives
ceil(floor(S / 14) / 4)² tokens. The crop size is the processor's setting: vitpool reads it where
the checkpoint sets it (`Step3p7Adapter.crop_size`) and captures the crop path's graphs for that
size; square crops of another side of at least one patch run eagerly at their own size, with the
same tokens as the model's (`vitpool.models.tiled`). (The processor counts (S // 56)² placeholder
tokens a crop, so the full model accepts only crops with S mod 56 under 14 and S of 56 or more,
504 among them.)

Every tile of a path has one size, so a batch of tiles needs no metadata; the tower's own
forward builds its rotary positions from a tensor made on the host at every call, which a
captured graph cannot hold, so `Step3p7Encoder` keeps each path's positions as buffers (and those
of another crop side, run eagerly, as they are first asked for) and `tile_features` runs the
tower's parts with them (the family's one seam).

State keys `vision_model.*` and `multi_modal_projector.*`; a full checkpoint in transformers'
layout has them under `model.`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, ConfigField
from vitpool.models.compat import check_tower_parts
from vitpool.models.tiled import (
    GLOBAL_VIEW,
    LOCAL_CROPS,
    CropSize,
    PathTiles,
    TablesBySize,
    ViewAndCropsAdapter,
    install_kernels,
)
from vitpool.rules.tiles import SquareTiles

GLOBAL, LOCAL = GLOBAL_VIEW, LOCAL_CROPS
# Step3p7ImageProcessor's default `patch_size`: the side of a local crop in pixels. It is the
# processor's setting, not the model's (`Step3p7Adapter.crop_size`).
LOCAL_IMAGE_SIZE = 504
DOWNSAMPLE = 4  # two stride-2 convolutions, each rounding up

# Default budgets: up to 8 global views (8 images) and 16 crops per batch; more run eager at
# their own size. 16 crops are 20736 patch rows, compute-bound already: a graph gains little
# there, and budgets up to 36 (a 3024² image's) nearly doubled capture and check
# (benchmarks/HISTORY.md, "Every family against HF eager and HF compiled, capture and memory
# (issue 28, last runs)").
MAX_GRAPH_TILES = {GLOBAL: 8, LOCAL: 16}
TOWER_PARTS = ("embeddings", "pre_layernorm", "rotary_emb", "layers", "downsampler1", "downsampler2")


class Step3p7Encoder(torch.nn.Module):
    """The tower, the projector and each path's rotary positions (buffers, so they move with
    the module to the encoder's device).

    Args:
        vision_model: `Step3p7VisionModel`; its `image_size` is the global view's side.
        projector: `Step3p7Model.multi_modal_projector`.
        local_image_size: the side of a local crop in pixels (the processor's `patch_size`), or that
            and where it was set (`Step3p7Adapter.crop_size`), named when crops of another size
            run eagerly.

    Raises:
        ValueError: tiles smaller than one patch.
    """

    def __init__(
        self, vision_model: torch.nn.Module, projector: torch.nn.Module, local_image_size: int | CropSize
    ) -> None:
        super().__init__()
        self.vision_model = vision_model
        self.multi_modal_projector = projector
        self.config = vision_model.config
        self.crop = CropSize.of(local_image_size)
        self.tile_sizes = {GLOBAL: int(self.config.image_size), LOCAL: self.crop.pixels}
        self.patch_size = int(self.config.patch_size)
        self.grid_sides: dict[str, int] = {}  # patches a side of a path's tile
        for path, size in self.tile_sizes.items():
            if size < self.patch_size:
                raise ValueError(
                    f"Step-3.7 {path} tiles of {size} pixels are smaller than one "
                    f"{self.patch_size}-pixel patch"
                )
            # as the patch convolution: pixels past the last whole patch are not read
            self.grid_sides[path] = size // self.patch_size
            self.register_buffer(
                f"{path}_positions", patch_positions(self.grid_sides[path]), persistent=False
            )
        self._other_positions = TablesBySize()

    def positions(self, path: str, side: int) -> torch.Tensor:
        """[side * side, 2] (row, column) of each patch of a `path` tile `side` patches a side: the
        path's buffer for its own tiles, else (crops of another size, run eagerly) made once a side."""
        own = getattr(self, f"{path}_positions")
        if side == self.grid_sides[path]:
            return own
        return self._other_positions.get(side, own.device, lambda: patch_positions(side))


def patch_positions(side: int) -> torch.Tensor:
    """[side * side, 2] (row, column) of each patch of a tile `side` patches a side, as the
    tower's forward makes them."""
    from transformers.vision_utils import get_vision_position_ids

    return get_vision_position_ids(torch.tensor([[1, side, side]]), spatial_merge_size=1)


def projector_of(config: Any, dtype: torch.dtype | None) -> torch.nn.Linear:
    """`Step3p7Model.multi_modal_projector` from a tower-only config: a Linear from the
    downsampled width to the LLM's."""
    width = int(config.hidden_size) * 4
    projector = torch.nn.Linear(width, int(config.text_hidden_size), bias=bool(config.projector_bias))
    return projector if dtype is None else projector.to(dtype)


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Step3p7Encoder:
    """Fresh tower and projector from a tower-only config (`Step3p7Adapter.tower_only_config`), for
    crops of `Step3p7Adapter.crop_size(config)`.

    Raises:
        ValueError: the config lacks a field the projector needs.
        CheckpointError: a crop size that is no positive whole number of pixels.
    """
    from transformers.models.step3p7.modeling_step3p7 import Step3p7VisionModel

    Step3p7Adapter.projector_config(config)  # refuses a config without what the projector reads
    vision = (
        Step3p7VisionModel(config) if dtype is None else Step3p7VisionModel._from_config(config, dtype=dtype)
    )
    return Step3p7Encoder(vision, projector_of(config, dtype), Step3p7Adapter.crop_size(config))


# The release's key layout (what transformers 5.24's save_pretrained writes too) -> the module's,
# as transformers' conversion mapping for step3p7 / step3p5_vision loads it.
RELEASE_RENAMES = (
    (r"^vit_large_projector\.", "multi_modal_projector."),
    (r"^vision_model\.conv1\.weight$", "vision_model.embeddings.patch_embedding.weight"),
    (r"^vision_model\.positional_embedding$", "vision_model.embeddings.position_embedding.weight"),
    (r"^vision_model\.transformer\.resblocks\.", "vision_model.layers."),
    (r"^vision_model\.ln_pre\.", "vision_model.pre_layernorm."),
    (r"^vision_model\.vit_downsampler([12])\.", r"vision_model.downsampler\1."),
    (r"\.ls_([12])\.gamma$", r".lambda_\1"),
    (r"\.mlp\.c_fc\.", ".mlp.fc1."),
    (r"\.mlp\.c_proj\.", ".mlp.fc2."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ln_1\.", ".layernorm_before."),
    (r"\.ln_2\.", ".layernorm_after."),
)
FUSED_QKV = re.compile(r"^(.*\.self_attn\.)in_proj_(weight|bias)$")


def release_state(checkpoint: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """`Step3p7Adapter.convert_checkpoint`: a full checkpoint in transformers' layout (keys under
    `model.`) or the release's (`vision_model.conv1`, fused `in_proj` attention,
    `vit_large_projector`), or a tower-only save (the module's own keys) -> the module's state.

    The release fuses q, k and v and orders each head's rotary halves interleaved; transformers'
    attention takes them apart and rotates by halves, so q and k rows are permuted as its loader
    does (`PermuteForRope`)."""
    state: dict[str, torch.Tensor] = {}
    for key, tensor in checkpoint.items():
        key = key.removeprefix("model.")
        for pattern, replacement in RELEASE_RENAMES:
            key = re.sub(pattern, replacement, key)
        fused = FUSED_QKV.match(key)
        if fused is None:
            state[key] = tensor
            continue
        prefix, kind = fused.groups()
        query, key_rows, value = tensor.chunk(3, dim=0)
        heads = int(config.num_attention_heads)
        state[f"{prefix}q_proj.{kind}"] = _halves_from_pairs(query, heads)
        state[f"{prefix}k_proj.{kind}"] = _halves_from_pairs(key_rows, heads)
        state[f"{prefix}v_proj.{kind}"] = value
    return state


def _halves_from_pairs(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Per head, rows ordered (pair, 2) -> (2, half): interleaved rotary pairs into halves."""
    half = rows.shape[0] // heads // 2
    shaped = rows.reshape(heads, half, 2, *rows.shape[1:])
    return shaped.transpose(1, 2).reshape(rows.shape).contiguous()


def tile_features(encoder: Step3p7Encoder, path: str, pixels: torch.Tensor) -> torch.Tensor:
    """`Step3p7VisionModel.forward` on tiles [n, C, S, S] of `path` (S its own size, or, run
    eagerly, another crop side), with the positions from buffers: [n, ceil(floor(S / patch) / 4)²,
    4 * hidden], as the model's `last_hidden_state`."""
    vision = encoder.vision_model
    side = pixels.shape[-1] // encoder.patch_size
    hidden = vision.embeddings(pixels, interpolate_pos_encoding=True)
    hidden = vision.pre_layernorm(hidden)
    position_embeddings = vision.rotary_emb(hidden, encoder.positions(path, side))
    for layer in vision.layers:
        hidden = layer(hidden, position_embeddings=position_embeddings)
    tiles, _, channels = hidden.shape
    hidden = hidden.permute(0, 2, 1).reshape(tiles, channels, side, side)
    hidden = vision.downsampler2(vision.downsampler1(hidden))
    return hidden.flatten(2).permute(0, 2, 1)


class Step3p7PathAdapter(PathTiles):
    """One path's tiles through the tower and the projector."""

    def __init__(self, encoder: Step3p7Encoder, path: str, output_width: int) -> None:
        sides = SquareTiles(encoder.patch_size, DOWNSAMPLE)  # the tokens of a tile of any side
        size = encoder.tile_sizes[path]
        crops = path == LOCAL  # crops of another side run eagerly; a global view of another side is refused
        super().__init__(
            encoder,
            path,
            int(encoder.config.num_channels),
            size,
            sides.tokens(size),
            output_width,
            MAX_GRAPH_TILES[path],
            encoder.crop if crops else None,
            sides if crops else None,
        )

    def forward_tiles(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        tokens = self.tower.multi_modal_projector(tile_features(self.tower, self.path, pixels))
        return [tokens.reshape(-1, tokens.shape[-1])]


class Step3p7Adapter(ViewAndCropsAdapter):
    """Adapter for `Step3p7Encoder`: two paths, local crops joined before the global view."""

    # What a tower-only save's vision config carries besides the tower's fields, for the projector.
    PROJECTOR_FIELDS = (TEXT_HIDDEN_SIZE, ConfigField("projector_bias", "projector_bias", bool))
    PROJECTOR_SUBJECT = "a Step-3.7 vision config"
    PROJECTOR_ADVICE = (
        "to build its multi_modal_projector; give the full model's checkpoint (Step3p7Config) or a "
        "tower-only save that carries them"
    )
    # The crops' side: Step3p7ImageProcessor's `patch_size`, LOCAL_IMAGE_SIZE unless the checkpoint sets it.
    CROP_SETTING = ("Step3p7ImageProcessor", "patch_size", LOCAL_IMAGE_SIZE)
    convert_checkpoint = staticmethod(release_state)

    def __init__(self, tower: Step3p7Encoder) -> None:
        check_tower_parts("Step-3.7", tower.vision_model, TOWER_PARTS)
        install_kernels(tower)
        width = int(tower.multi_modal_projector.out_features)
        super().__init__(
            tower, Step3p7PathAdapter(tower, LOCAL, width), Step3p7PathAdapter(tower, GLOBAL, width)
        )


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = Step3p7Adapter.tower_only_config
convert_checkpoint = Step3p7Adapter.convert_checkpoint
