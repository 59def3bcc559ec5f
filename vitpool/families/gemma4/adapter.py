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

import copy
import random
from collections.abc import Sequence
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import torch

from vitpool.errors import ConfigError
from vitpool.families.gemma4.rules import Gemma4Rules
from vitpool.kernels.attention import install_packed_attention
from vitpool.models.compat import check_tower_parts
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import Grid, item_cu_seqlens, item_grids
from vitpool.packing import Budget
from vitpool.specs import IMAGE, ItemSpec

# The full checkpoints whose vision tower and embed_vision this family runs (DiffusionGemma has the
# same tower type with its own model around it).
FULL_MODEL_TYPE = "gemma4"
# What a tower-only save's vision config carries besides the tower's fields: embed_vision's output width.
PROJECTOR_FIELDS = ("text_hidden_size",)
# What `Gemma4Adapter.forward` uses of transformers' tower and embedder.
TOWER_PARTS = (
    "vision_tower.patch_embedder",
    "vision_tower.encoder.rotary_emb",
    "vision_tower.encoder.layers",
    "vision_tower.pooler.root_hidden_size",
    "embed_vision.embedding_pre_projection_norm",
    "embed_vision.embedding_projection",
)
# Vestiges of Gemma 3n's embedder that some releases carry and no Gemma 4 module reads (vLLM's
# Gemma 4 loader skips them too).
VESTIGIAL_PREFIX = "embed_vision.embedding."
PADDING_POSITION = -1
# Sampled check batches stay small so that checking a budget costs little host time.
MAX_SAMPLED_ITEMS = 8
Tensors = dict[str, torch.Tensor]


class Gemma4Encoder(torch.nn.Module):
    """The vision tower and `embed_vision`, as `Gemma4Model` holds them; state keys
    `vision_tower.*` and `embed_vision.*` (a full checkpoint has them under `model.`)."""

    def __init__(self, vision_tower: torch.nn.Module, embed_vision: torch.nn.Module) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.embed_vision = embed_vision
        self.config = vision_tower.config


def tower_only_config(full_config: Any) -> Any:
    """The vision config of a full `Gemma4Config` with PROJECTOR_FIELDS added: the config
    `build_encoder` takes, and what a tower-only save of `Gemma4Encoder` writes as config.json.

    Raises:
        ValueError: a full config of another model with a Gemma 4 vision tower (DiffusionGemma),
            whose model around the tower vitpool does not run.
    """
    model_type = getattr(full_config, "model_type", None)
    if model_type != FULL_MODEL_TYPE:
        raise ValueError(
            f"vitpool's {FULL_MODEL_TYPE} family runs Gemma 4's vision tower with its embed_vision; a "
            f"{model_type!r} checkpoint is another model around that tower, which vitpool does not run"
        )
    config = copy.deepcopy(full_config.vision_config)
    config.text_hidden_size = int(full_config.text_config.hidden_size)
    return config


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Gemma4Encoder:
    """Fresh tower and embedder from a full `Gemma4Config` or a vision config with PROJECTOR_FIELDS.

    Raises:
        ValueError: a vision config without PROJECTOR_FIELDS (a plain tower save).
    """
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

    if getattr(config, "text_config", None) is not None:
        config = tower_only_config(config)
    if getattr(config, "text_hidden_size", None) is None:
        raise ValueError(
            "Gemma 4's embed_vision needs text_hidden_size (the LLM's width) besides the vision config: give "
            "the full model's config (Gemma4Config) or a tower-only save written with tower_only_config; got "
            f"a {type(config).__name__} (model_type {getattr(config, 'model_type', None)!r})"
        )
    text = SimpleNamespace(hidden_size=int(config.text_hidden_size))
    if dtype is None:
        return Gemma4Encoder(Gemma4VisionModel(config), Gemma4MultimodalEmbedder(config, text))
    tower = Gemma4VisionModel._from_config(config, dtype=dtype)
    return Gemma4Encoder(tower, Gemma4MultimodalEmbedder(config, text).to(dtype))


def convert_checkpoint(state: dict[str, torch.Tensor], config: Any = None) -> dict[str, torch.Tensor]:
    """`Gemma4Encoder`'s state from a checkpoint's tensors: `model.vision_tower.*` and
    `model.embed_vision.*` (transformers' and the releases' layout) lose `model.`; the encoder's own
    keys map to themselves; vestigial `embed_vision.embedding.*` tensors are dropped; other keys
    pass unchanged (a strict load names them). `config` is not needed."""
    converted = {}
    for key, tensor in state.items():
        name = key.removeprefix("model.")
        if not name.startswith(VESTIGIAL_PREFIX):
            converted[name] = tensor
    return converted


class Gemma4Adapter:
    """Adapter for `Gemma4Encoder`: an image's real patch rows in, `embed_vision`'s tokens out."""

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
        self.row_shape = self.item_rules.row_shape
        self.output_row_shapes = self.item_rules.output_row_shapes
        self.merge_unit = self.item_rules.merge_unit
        self._per_grid = lru_cache(maxsize=1024)(self._grid_tensors)
        install_packed_attention(tower.vision_tower)

    def max_rows(self, num_tokens: int) -> int:
        return num_tokens * self.merge_unit

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

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        """Random images that together fit `num_rows` rows, the budget's tokens and its items, no
        side past the position table: some fill what is left, most take a part of it."""
        rules, k = self.item_rules, self.pooling_kernel_size
        most_side_blocks = rules.max_side // k
        specs: list[ItemSpec] = []
        tokens_left = min(budget.num_tokens, num_rows // self.merge_unit)
        while len(specs) < min(MAX_SAMPLED_ITEMS, budget.max_items) and tokens_left >= 1:
            num_blocks = tokens_left if rng.random() < 0.2 else rng.randint(1, max(1, tokens_left // 2))
            height_blocks = rng.randint(1, min(num_blocks, most_side_blocks))
            width_blocks = min(max(1, num_blocks // height_blocks), most_side_blocks)
            h, w = height_blocks * k, width_blocks * k
            specs.append(rules.item_spec(IMAGE, (h * w, rules.row_width), "float32", (1, h, w)))
            tokens_left -= height_blocks * width_blocks
        return specs

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
