"""Phi-4-multimodal's image path (`Phi4MultimodalImageEmbedding`: its SigLIP tower `img_processor`,
the 2 x 2 pooling, the HD assembly with its `sub_GN` / `glb_GN` separators and the two-layer
projection) run over static buffers. The model has no `get_image_features`: what its LLM receives
for an image is what `embed_tokens_extend.image_embed` writes at the image's placeholder tokens,
and that is what the adapter hands out, one row per placeholder (`rules.py` says which).

Rows are crops [C, S, S] (an item's global crop, then its canvas' crops; a padding row is a zero
crop). Each crop is one attention sequence of (S / P)² patches, run as the batch dimension, with
what depends on the item precomputed on the host (metadata):

- `position_ids` [rows, (S/P)²]: a crop holding image in vr x vc patches looks its positions up at
  the buckets of their fractional coordinates (vr, vc the crop's share of `image_attention_mask`),
  the masked patches at 0, as `Phi4MultimodalVisionEmbeddings` computes them;
- `key_mask` [rows, (S/P)²]: the patches a crop's queries attend to (its image's; the masked
  patches still compute their rows, which the pooling reads at an odd edge, as in the model);
- `token_index` [tokens]: each output row's source in one table of the crops' pooled features,
  `sub_GN` and `glb_GN`; the projection then runs on the gathered rows.

Attention is bidirectional, as SigLIP is and as vLLM runs it. Hugging Face marks the tower's
attention causal (`is_causal = True`): under "sdpa" a call whose crops are all unpadded gets no
mask and SDPA then runs causally, while a call with any padded crop gets a padding mask and runs
bidirectionally, so HF's sdpa result for an image depends on its neighbours in the call. vitpool
always passes the mask (as an additive bias, also for full crops), which SDPA never runs causally;
HF's eager attention ignores `is_causal` and is the reference (tests/unit/test_phi4_multimodal_family.py
measures the sdpa difference).

The tower's features are `hidden_states[feature_layer]` (-2 in the release: the second-to-last
layer's output, no post-layernorm): only the layers before it run; the last layer, post_layernorm
and the pooling head are loaded (a strict load) and never used.

State keys are `Phi4MultimodalImageEmbedding`'s own (`img_processor.*`, `img_projection_up.*`,
`img_projection_down.*`, `global_img_feature_extensor`, `sub_img_feature_extensor`); a full
checkpoint in transformers' layout has them under `model.embed_tokens_extend.image_embed.`.
Microsoft's original release (config "phi4mm", remote code) keeps another layout and config and
is not read.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from vitpool.errors import ConfigError
from vitpool.families.phi4_multimodal.rules import HdLayout, Phi4MultimodalRules
from vitpool.models.adapter_base import AdapterBase, ConfigField, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.protocol import BudgetRange, TensorSpec, zero_metadata
from vitpool.models.tiled import install_kernels
from vitpool.packing import Budget
from vitpool.specs import IMAGE, ItemSpec

FAMILY = "Phi-4-multimodal"
CHECKPOINT_PREFIX = "model.embed_tokens_extend.image_embed."
# The default budgets hold up to this many crops: a 4 x 4 canvas and its global crop (the release's
# dynamic_hd=36 allows up to 37: such images run eager at their own size).
MAX_GRAPH_CROPS = 17
MAX_SAMPLED_SIDE = 3
TOWER_PARTS = (
    "img_processor.embeddings.patch_embedding",
    "img_processor.embeddings.position_embedding",
    "img_processor.encoder.layers",
    "image_token_compression",
    "img_projection_up",
    "img_projection_down",
    "global_img_feature_extensor",
    "sub_img_feature_extensor",
    "layer_idx",
    "crop_size",
)
# Sentinels of an item's token index before it is placed: the separators' rows of the table.
_SUB_SEPARATOR, _GLOBAL_SEPARATOR = -1, -2


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A fresh `Phi4MultimodalImageEmbedding` (tower, separators, projection) from a full
    Phi4MultimodalConfig or a vision config with `text_hidden_size`."""
    from transformers.models.phi4_multimodal.modeling_phi4_multimodal import Phi4MultimodalImageEmbedding

    module = Phi4MultimodalImageEmbedding(Phi4MultimodalAdapter.projector_config(config))
    return module if dtype is None else module.to(dtype)


def crop_positions(
    patches_per_side: int, valid_rows: int, valid_cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A crop's position ids [n²] and patch mask [n²] where its image is the top-left valid_rows x
    valid_cols patches: `Phi4MultimodalVisionEmbeddings`' bucketed fractional coordinates, in its
    float32 arithmetic, masked patches at position 0."""
    n = patches_per_side
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:valid_rows, :valid_cols] = True
    indices = torch.arange(n, dtype=torch.float32)
    buckets = []
    for count in (valid_rows, valid_cols):
        step = 1.0 / torch.tensor(count)  # the model's 1.0 / (patch count): float32
        fractions = torch.clamp(indices * step, max=1.0 - 1e-6)
        buckets.append(torch.bucketize(fractions, boundaries, right=True))
    positions = buckets[0][:, None] * n + buckets[1][None, :]
    return torch.where(mask, positions, 0).reshape(-1), mask.reshape(-1)


class Phi4MultimodalAdapter(AdapterBase):
    """Adapter for `Phi4MultimodalImageEmbedding`: rows are crops, metadata as the opening says."""

    # What a tower-only save's vision config carries besides Hugging Face's fields (the full config
    # holds it, at its top level): the LLM's width, the projection's.
    PROJECTOR_FIELDS = (ConfigField("text_hidden_size", "hidden_size", int),)
    PROJECTOR_SUBJECT = "a Phi-4-multimodal vision config"
    PROJECTOR_ADVICE = (
        "to build its projection; give the full model's config (Phi4MultimodalConfig) or a tower-only save "
        "that carries it (tower_only_config)"
    )
    # A full checkpoint's keys less `model.embed_tokens_extend.image_embed.` (a tower-only save's keys
    # are the module's own already).
    CHECKPOINT_RENAMES = renames((f"^{re.escape(CHECKPOINT_PREFIX)}", ""))
    MAX_SAMPLED_ITEMS = 4

    @classmethod
    def projector_config(cls, config: Any) -> Any:
        """What `Phi4MultimodalImageEmbedding` reads (vision_config, the LLM's hidden_size,
        embd_pdrop), from a full `Phi4MultimodalConfig` or a vision config carrying
        `text_hidden_size`."""
        full = super().projector_config(config)
        return full if full is config else SimpleNamespace(**vars(full), embd_pdrop=0.0)

    def __init__(self, tower: torch.nn.Module) -> None:
        check_tower_parts(FAMILY, tower, TOWER_PARTS)
        vision = tower.img_processor
        config = vision.config
        image_size, patch_size = int(config.image_size), int(config.patch_size)
        if int(tower.crop_size) != image_size or image_size % patch_size:
            raise ConfigError(
                f"{FAMILY}: crop_size {tower.crop_size} and image_size {image_size} must be equal and a "
                f"whole number of {patch_size}-pixel patches (the model cuts image_sizes by crop_size, the "
                "tower takes image_size crops)"
            )
        num_layers = len(vision.encoder.layers)
        feature_layer = int(tower.layer_idx)
        if not -(num_layers + 1) <= feature_layer <= num_layers:
            raise ConfigError(
                f"{FAMILY}: feature_layer {feature_layer} is outside the tower's {num_layers} layers"
            )
        # hidden_states[feature_layer] of the embeddings' and each layer's outputs: this many layers
        self._num_layers_run = feature_layer % (num_layers + 1)
        # the forward always passes an additive bias (so SDPA never takes its causal path); "sdpa"
        # takes it, where a flash or flex implementation the checkpoint may name would not
        config._attn_implementation = "sdpa"
        install_kernels(tower)
        self.tower = tower
        self.item_rules = Phi4MultimodalRules(
            int(config.num_channels), image_size, patch_size, int(tower.img_projection_down.out_features)
        )
        self._patches = self.item_rules.patches_per_side
        self._pooled = self.item_rules.pooled_side
        self._crop_metadata = lru_cache(maxsize=4096)(self._crop_positions)
        self._item_tokens = lru_cache(maxsize=1024)(self._relative_token_index)

    def max_rows(self, num_tokens: int) -> int:
        return self.item_rules.max_crops(num_tokens)

    def budget_range(self, device: torch.device) -> BudgetRange:
        """Budgets in steps of a pooled crop (b² tokens: one crop more), from one unpadded one-crop
        image (2 crops) to MAX_GRAPH_CROPS crops."""
        step = self.item_rules.tokens_per_crop
        return BudgetRange(3 * step, (MAX_GRAPH_CROPS + 1) * step, step)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        patches = self._patches**2
        return {
            "position_ids": TensorSpec((num_rows, patches), torch.long),
            "key_mask": TensorSpec((num_rows, patches), torch.bool),
            "token_index": TensorSpec((budget.num_tokens,), torch.long),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        rows = sum(spec.num_rows for spec in specs)
        tokens = sum(spec.num_tokens for spec in specs)
        if rows > num_rows or tokens > budget.num_tokens or len(specs) > budget.max_items:
            raise ValueError(
                f"{len(specs)} items need {rows} crops and {tokens} tokens; the buffers hold {num_rows} "
                f"crops, {budget.num_tokens} tokens and {budget.max_items} items"
            )
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        # padding crops: a full crop's positions and mask (their rows are read by no token)
        full_positions, full_mask = self._crop_metadata(self._patches, self._patches)
        metadata["position_ids"][:] = full_positions
        metadata["key_mask"][:] = full_mask
        table_rows = num_rows * self._pooled**2
        sub_separator, global_separator = table_rows, table_rows + 1
        metadata["token_index"].fill_(sub_separator)  # padding tokens: any row of the table
        row, token = 0, 0
        for spec in specs:
            hd = self.item_rules.parse_layout(spec.layout)
            for crop, (valid_rows, valid_cols) in enumerate(self._crop_shares(hd), start=row + 1):
                positions, key_mask = self._crop_metadata(valid_rows, valid_cols)
                metadata["position_ids"][crop], metadata["key_mask"][crop] = positions, key_mask
            relative = self._item_tokens(hd)
            placed = relative + row * self._pooled**2
            placed = torch.where(relative == _SUB_SEPARATOR, sub_separator, placed)
            placed = torch.where(relative == _GLOBAL_SEPARATOR, global_separator, placed)
            metadata["token_index"][token : token + len(placed)] = placed
            row, token = row + spec.num_rows, token + len(placed)
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [crops, C, S, S] -> patches [crops, n², D]
        tower = self.tower
        embeddings = tower.img_processor.embeddings
        hidden = embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        hidden = hidden + embeddings.position_embedding(metadata["position_ids"])
        key_mask = metadata["key_mask"]
        # additive bias [crops, 1, 1, n²]: 0 where a key is image, the dtype's lowest where padding
        bias = torch.zeros(key_mask.shape, dtype=hidden.dtype, device=hidden.device)
        bias = bias.masked_fill(~key_mask, torch.finfo(hidden.dtype).min)[:, None, None, :]
        for layer in tower.img_processor.encoder.layers[: self._num_layers_run]:
            hidden = layer(hidden, bias)
        crops, n, width = hidden.shape[0], self._patches, hidden.shape[-1]
        grid = hidden.reshape(crops, n, n, width).permute(0, 3, 1, 2)  # NCHW, as the model pools it
        if getattr(tower, "img_processor_padding", None) is not None:  # an odd side: reflected by one
            grid = tower.img_processor_padding(grid)
        pooled = tower.image_token_compression(grid).permute(0, 2, 3, 1).reshape(-1, width)  # [crops * b², D]
        separators = torch.cat(
            [
                tower.sub_img_feature_extensor.reshape(1, width),
                tower.global_img_feature_extensor.reshape(1, width),
            ]
        )
        features = torch.cat([pooled, separators])[metadata["token_index"]]  # [tokens, D]
        return [tower.img_projection_down(F.gelu(tower.img_projection_up(features)))]

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        specs: list[ItemSpec] = []
        rows_left = min(num_rows, budget.max_sequences)
        tokens_left = budget.num_tokens
        while len(specs) < self.sampled_items(budget):
            fitting = [
                spec
                for spec in (self._sample_spec(rng) for _ in range(8))
                if spec.num_rows <= rows_left and spec.num_tokens <= tokens_left
            ]
            if not fitting:
                smallest = self._smallest_spec()
                if smallest.num_rows > rows_left or smallest.num_tokens > tokens_left:
                    break
                fitting = [smallest]
            spec = fitting[0]
            specs.append(spec)
            rows_left, tokens_left = rows_left - spec.num_rows, tokens_left - spec.num_tokens
        return specs

    def _sample_spec(self, rng: random.Random) -> ItemSpec:
        """A random canvas of up to MAX_SAMPLED_SIDE crops a side, padded at the bottom or the right
        (as the processor pads one of them) or not at all."""
        n, side = self._patches, self.item_rules.crop_size
        rows, cols = rng.randint(1, MAX_SAMPLED_SIDE), rng.randint(1, MAX_SAMPLED_SIDE)
        valid = [rows * n, cols * n]
        padded = rng.choice((None, 0, 1))
        if padded is not None:
            valid[padded] -= rng.randint(0, n - 1)
        pixel_shape = (1 + rows * cols, *self.row_shape)
        return self.item_rules.item_spec(IMAGE, pixel_shape, "float32", (rows * side, cols * side, *valid))

    def _smallest_spec(self) -> ItemSpec:
        """One crop holding one patch of image: the fewest tokens an item gives."""
        side = self.item_rules.crop_size
        return self.item_rules.item_spec(IMAGE, (2, *self.row_shape), "float32", (side, side, 1, 1))

    def _crop_positions(self, valid_rows: int, valid_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        return crop_positions(self._patches, valid_rows, valid_cols)

    def _crop_shares(self, hd: HdLayout) -> list[tuple[int, int]]:
        """Each canvas crop's (valid rows, valid cols) of patches, row by row."""
        n = self._patches
        return [
            (min(n, hd.valid_rows - n * r), min(n, hd.valid_cols - n * c))
            for r in range(hd.crop_rows)
            for c in range(hd.crop_cols)
        ]

    def _relative_token_index(self, hd: HdLayout) -> torch.Tensor:
        """An item's output rows as rows of its crops' pooled features (crop 0: the global crop),
        with the separator sentinels: the canvas' kept rows, each then sub_GN; glb_GN; the global
        crop's rows, each then sub_GN."""
        b = self._pooled
        useful_rows, useful_cols = self.item_rules.useful_size(hd)
        ys, xs = torch.arange(useful_rows), torch.arange(useful_cols)
        crop = 1 + (ys // b)[:, None] * hd.crop_cols + (xs // b)[None, :]
        canvas = crop * b * b + (ys % b)[:, None] * b + (xs % b)[None, :]
        global_crop = torch.arange(b * b).view(b, b)
        with_separators = [
            torch.cat([grid, torch.full((grid.shape[0], 1), _SUB_SEPARATOR)], dim=1).reshape(-1)
            for grid in (canvas, global_crop)
        ]
        return torch.cat([with_separators[0], torch.tensor([_GLOBAL_SEPARATOR]), with_separators[1]])


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = Phi4MultimodalAdapter.tower_only_config
convert_checkpoint = Phi4MultimodalAdapter.convert_checkpoint
