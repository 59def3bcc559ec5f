"""A test-only model family: a fixed-tile toy tower with 4-D pixels and no grid.

It shows that a family unlike Qwen3-VL is an adapter, item rules and one registry line: nothing
in `graphs/`, `pool/`, the transport or the codec knows it. Pixels are tiles [tiles, 3, S, S]
(`Image(pixels)`, no `grid_thw`); each tile becomes `tokens_per_tile` output tokens; besides
the tokens the tower returns one extra output per token shaped [heads, head_dim], unlike the
tokens, so that output layouts of any row shape are exercised.

Importing this module registers the family under `MODEL_TYPE` (torch, no transformers).

A checkpoint of this family is a directory whose config.json names the type; every other field
is optional (defaults of `ToyTilesConfig`), and without weights the tower's weights are random
but the same in every process (seeded by the config's `seed`):

    write_checkpoint(directory)                      # {"model_type": "vitpool_toy_tiles"}
    os.environ["VITPOOL_FAMILY_MODULES"] = "toy_family"   # before ray.init, for a pool's actors
    # and put tests/ on PYTHONPATH where the encoder runs, so that `toy_family` imports there
    GraphEncoder.from_pretrained(directory, budgets=[8, 16, 32], device="cpu")
    EncoderPool.launch(model=str(directory), ...)
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vitpool.models.registry import Family, register_family
from vitpool.models.tiled import TiledAdapter
from vitpool.rules.tiles import TileRules

MODEL_TYPE = "vitpool_toy_tiles"

MAX_GRAPH_TILES = 16  # the default budgets hold up to this many tiles; larger batches run eager


@dataclass(frozen=True)
class ToyTilesConfig:
    channels: int = 3
    tile_size: int = 8  # pixels per tile side
    patch_size: int = 2  # pixels per patch side: (tile_size / patch_size)^2 patches per tile
    hidden_size: int = 32
    num_heads: int = 2
    tokens_per_tile: int = 4  # the patches of a tile are pooled into this many output tokens
    out_hidden_size: int = 24
    seed: int = 0  # random weights are drawn from it, the same in every process
    model_type: str = MODEL_TYPE

    @property
    def num_patches(self) -> int:
        return (self.tile_size // self.patch_size) ** 2


def read_config(directory: Path) -> ToyTilesConfig:
    raw = json.loads((Path(directory) / "config.json").read_text())
    known = {field.name for field in dataclasses.fields(ToyTilesConfig)}
    return ToyTilesConfig(**{key: value for key, value in raw.items() if key in known})


def write_checkpoint(directory: Path, **fields: Any) -> Path:
    """A checkpoint directory of this family: config.json only (random weights)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE, **fields}))
    return directory


class ToyTilesTower(torch.nn.Module):
    """Patch embedding per tile, one attention block within each tile, pooling to a few tokens
    per tile, a linear layer to the output width. tiles [n, C, S, S] -> (tokens [n*k, out],
    features [n*k, heads, head_dim])."""

    def __init__(self, config: ToyTilesConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.patch_embed = torch.nn.Conv2d(
            config.channels, hidden, config.patch_size, stride=config.patch_size
        )
        self.position = torch.nn.Parameter(torch.empty(config.num_patches, hidden))
        self.norm = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, config.out_hidden_size)
        _seeded_init(self, config.seed)

    def forward(self, tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.config
        num_tiles, patches, heads = tiles.shape[0], config.num_patches, config.num_heads
        x = self.patch_embed(tiles).flatten(2).transpose(1, 2) + self.position  # [n, patches, hidden]
        qkv = self.qkv(self.norm(x)).reshape(num_tiles, patches, 3, heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # within each tile
        x = x + self.proj(attended.transpose(1, 2).reshape(num_tiles, patches, -1))
        k = config.tokens_per_tile
        pooled = x.reshape(num_tiles, k, patches // k, -1).mean(dim=2)  # [n, k, hidden]
        tokens = self.out(pooled).reshape(num_tiles * k, -1)
        return tokens, pooled.reshape(num_tiles * k, heads, -1)


def _seeded_init(tower: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in tower.named_parameters():
            values = torch.randn(parameter.shape, generator=generator, device="cpu")
            if name.startswith("norm.weight"):
                values = 1 + 0.1 * values
            elif parameter.ndim >= 2:
                values = values / math.sqrt(parameter[0].numel())
            else:
                values = 0.1 * values
            parameter.copy_(values)


class ToyTilesAdapter(TiledAdapter):
    """The toy tower through the adapter protocol (`vitpool.models.tiled`): no metadata (attention
    stays within a tile by the tile dimension), padding rows are zero tiles whose tokens nobody
    reads; default budgets of whole tiles, up to MAX_GRAPH_TILES."""

    max_graph_tiles = MAX_GRAPH_TILES

    def __init__(self, tower: ToyTilesTower) -> None:
        config = tower.config
        self.tower = tower
        head_dim = config.hidden_size // config.num_heads
        self.item_rules = TileRules(
            config.channels,
            config.tile_size,
            config.tokens_per_tile,
            ((config.out_hidden_size,), (config.num_heads, head_dim)),
        )
        self.tokens_per_tile = config.tokens_per_tile

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return list(self.tower(pixels))


def _build_tower(config: ToyTilesConfig, dtype: torch.dtype) -> torch.nn.Module:
    return ToyTilesTower(config).to(dtype)


register_family(MODEL_TYPE, Family(_build_tower, ToyTilesAdapter, read_config))
