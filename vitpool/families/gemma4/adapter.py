"""Gemma 4: the Hugging Face vision tower (`Gemma4VisionModel`) and the model's `embed_vision`
(`Gemma4MultimodalEmbedder`), run together in one graph: what `Gemma4Model.get_image_features`
hands the LLM.

Hugging Face's path, per image: the processor's patch rows [n, 3*P*P] (values in [0, 1]) are
scaled to [-1, 1] and projected (`patch_embedder.input_proj`), plus a learned position embedding,
the sum of table rows `x` and `y` (the patch's column and row); blocks of RMSNorm, attention with
normed queries, keys and values (scale 1) and a 2D axial rotary embedding of (x, y), and a gated
GELU MLP; then the pooler averages each k x k block of patches in fp32, scales by
sqrt(hidden_size), optionally standardizes (`std_bias`, `std_scale`), and `embed_vision`
RMS-normalises (no scale) and projects each token into the LLM's width.

The padded layout, and why vitpool drops it. The processor pads every image to a fixed
`max_soft_tokens * k²` patch rows (630 for 70 tokens, 2520 for 280), the padding rows at position
(-1, -1), and the model runs the padded batch. Nothing of a real row's output depends on them:
the padding rows' position embeddings are zeroed; the encoder's bidirectional mask hides them as
keys (`attention_mask=~padding_positions`), so a real row attends only to its own image's real
rows; the pooler zeroes their hidden states before pooling and puts them in block 0 with weight
1/k², adding exact zeros; and the slots no real patch reaches are dropped (`pooler_mask`). The
math is each image's real patches attending over themselves, pooled by blocks: vitpool packs
only those rows, one attention sequence per image (`cu_seqlens`), and skips up to 2520 rows of
dead compute per image. Checked against the padded model in the tests.

What differs for static capture (the rows are the real patches, one per row: `rules.py`):

- positions [rows, 2] (x, y) are precomputed per grid, the padding rows of a budget at (-1, -1)
  as the processor marks them (so the embedder zeroes theirs, as Hugging Face's does), and they
  form one trailing attention sequence;
- the layers run the packed attention over `cu_seqlens` with a static `max_seqlen` (the
  buffer's rows) instead of a dense padded mask;
- the pooler's one-hot matrix over the padded slots becomes a gather of each block's k² rows by a
  [tokens, k²] index (blocks row-major, as the pooler numbers them), averaged in fp32, then cast,
  scaled and standardized as `Gemma4VisionPooler` and `Gemma4VisionModel` do. Padding tokens
  gather row 0.

Refused: `pooling_kernel_size` 1, where Hugging Face's pooler skips pooling and hands back its
padding mask as the mask of valid tokens (`hidden_states[pooler_mask]` keeps the padding rows,
not the image's): there is no reference to match. Key-value heads fewer than heads (no release
has them; the packed attention takes equal heads).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from vitpool.errors import ConfigError
from vitpool.families.gemma4.rules import Gemma4Rules
from vitpool.kernels.attention import install_packed_attention
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, AdapterBase, is_full_config, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import Grid, item_cu_seqlens, item_grids
from vitpool.packing import Budget
from vitpool.specs import ItemSpec

# What `Gemma4Adapter.forward` uses of transformers' tower and embedder.
TOWER_PARTS = (
    "vision_tower.patch_embedder",
    "vision_tower.encoder.rotary_emb",
    "vision_tower.encoder.layers",
    "vision_tower.pooler.root_hidden_size",
    "embed_vision.embedding_pre_projection_norm",
    "embed_vision.embedding_projection",
)
PADDING_POSITION = -1
Tensors = dict[str, torch.Tensor]


class Gemma4Encoder(torch.nn.Module):
    """The vision tower and `embed_vision`, as `Gemma4Model` holds them; state keys
    `vision_tower.*` and `embed_vision.*` (a full checkpoint has them under `model.`)."""

    def __init__(self, vision_tower: torch.nn.Module, embed_vision: torch.nn.Module) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.embed_vision = embed_vision
        self.config = vision_tower.config


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Gemma4Encoder:
    """Fresh tower and embedder from a full `Gemma4Config` or a vision config with the LLM's width
    (`Gemma4Adapter.tower_only_config`).

    Raises:
        ValueError: a vision config without it (a plain tower save).
    """
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

    if is_full_config(config):
        config = Gemma4Adapter.tower_only_config(config)
    text = Gemma4Adapter.projector_config(config).text_config
    if dtype is None:
        return Gemma4Encoder(Gemma4VisionModel(config), Gemma4MultimodalEmbedder(config, text))
    tower = Gemma4VisionModel._from_config(config, dtype=dtype)
    return Gemma4Encoder(tower, Gemma4MultimodalEmbedder(config, text).to(dtype))


class Gemma4Adapter(AdapterBase):
    """Adapter for `Gemma4Encoder`: an image's real patch rows in, `embed_vision`'s tokens out."""

    # What a tower-only save's vision config carries besides the tower's fields: embed_vision's width.
    PROJECTOR_FIELDS = (dataclasses.replace(TEXT_HIDDEN_SIZE, cast=int),)
    PROJECTOR_SUBJECT = "Gemma 4's embed_vision"
    PROJECTOR_ADVICE = (
        "(the LLM's width) besides the vision config: give the full model's config (Gemma4Config) or a "
        "tower-only save written with tower_only_config"
    )
    # DiffusionGemma has the same tower type with its own model around it.
    FULL_MODEL_TYPES = ("gemma4",)
    OTHER_MODEL = (
        "vitpool's gemma4 family runs Gemma 4's vision tower with its embed_vision; a {model_type} "
        "checkpoint is another model around that tower, which vitpool does not run"
    )
    # transformers' and the releases' layout lose `model.`; vestiges of Gemma 3n's embedder that some
    # releases carry and no Gemma 4 module reads are dropped (vLLM's Gemma 4 loader skips them too).
    CHECKPOINT_RENAMES = renames((r"^model\.", ""))
    CHECKPOINT_IGNORED = (re.compile(r"^(?:model\.)?embed_vision\.embedding\."),)

    def __init__(self, tower: Gemma4Encoder) -> None:
        check_tower_parts("Gemma 4", tower, TOWER_PARTS)
        config = tower.vision_tower.config
        k = int(config.pooling_kernel_size)
        if k < 2:
            raise ConfigError(
                f"Gemma 4: pooling_kernel_size {k} is not run: Hugging Face's pooler then keeps its padding "
                "rows instead of the image's (it returns the padding mask as the mask of valid tokens), so "
                "there is no reference to match"
            )
        if int(config.num_key_value_heads) != int(config.num_attention_heads):
            raise ConfigError(
                f"Gemma 4: {config.num_key_value_heads} key-value heads for {config.num_attention_heads} "
                "heads is not run; vitpool's packed attention takes as many key-value heads as heads (as "
                "every release has)"
            )
        self.tower = tower
        self.pooling_kernel_size = k
        self.standardize = bool(config.standardize)
        self.item_rules = Gemma4Rules(
            int(tower.vision_tower.patch_embedder.input_proj.in_features),
            k,
            int(config.position_embedding_size),
            int(tower.embed_vision.embedding_projection.out_features),
        )
        self.merge_unit = self.item_rules.merge_unit
        self.max_sampled_side_blocks = self.item_rules.max_side // k  # no side past the position table
        self._per_grid = lru_cache(maxsize=1024)(self._grid_tensors)
        install_packed_attention(tower.vision_tower)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "position_ids": TensorSpec((num_rows, 2), torch.long),  # (x, y) of each patch; padding (-1, -1)
            # one sequence per image, the padding's, the leading 0
            "cu_seqlens": TensorSpec((budget.max_items + 2,), torch.int32),
            "pool_index": TensorSpec((budget.num_tokens, self.merge_unit), torch.long),
        }

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> Tensors:
        grids = item_grids(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        metadata["position_ids"].fill_(PADDING_POSITION)
        metadata["cu_seqlens"] = item_cu_seqlens(grids, num_rows, budget.max_items)
        row = token = 0
        for grid in grids:
            positions, pool_index = self._per_grid(grid)
            metadata["position_ids"][row : row + positions.shape[0]] = positions
            metadata["pool_index"][token : token + pool_index.shape[0]] = pool_index + row
            row += positions.shape[0]
            token += pool_index.shape[0]
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [rows, 3*P*P], one patch per row
        vision = self.tower.vision_tower
        positions = metadata["position_ids"][None]  # [1, rows, 2]: the tower's modules take a batch of one
        padding = (positions == PADDING_POSITION).all(dim=-1)
        hidden = vision.patch_embedder(pixels[None], positions, padding)  # [1, rows, d]
        position_embeddings = vision.encoder.rotary_emb(hidden, positions)
        cu_seqlens, num_rows = metadata["cu_seqlens"], pixels.shape[0]
        for layer in vision.encoder.layers:
            hidden = layer(
                hidden,
                position_embeddings=position_embeddings,
                attention_mask=None,
                position_ids=positions,
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens,
                max_length_q=num_rows,
                max_length_k=num_rows,  # static: Python ints from the buffer's shape
            )
        hidden = hidden[0]
        # the pooler: each block's mean in fp32, back to the working dtype, then scaled in fp32
        pooled = hidden.float()[metadata["pool_index"]].mean(dim=1).to(hidden.dtype)
        features = pooled.float() * vision.pooler.root_hidden_size
        if self.standardize:
            features = (features - vision.std_bias.float()) * vision.std_scale.float()
        return [self.tower.embed_vision(inputs_embeds=features.to(hidden.dtype))]

    def _grid_tensors(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's positions [h*w, 2] as the processor gives them ((x, y), patches row-major)
        and its pooler's gather index [tokens, k²] (token (by, bx), row-major as the pooler numbers
        blocks, takes rows (by*k + i) * w + bx*k + j)."""
        _, h, w = grid
        k = self.pooling_kernel_size
        rows, columns = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions = torch.stack([columns.flatten(), rows.flatten()], dim=-1)
        pool_index = torch.arange(h * w).view(h // k, k, w // k, k).transpose(1, 2).reshape(-1, k * k)
        return positions, pool_index


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = Gemma4Adapter.tower_only_config
convert_checkpoint = Gemma4Adapter.convert_checkpoint
