"""Llama 3.2 Vision (`MllamaVisionModel`) and its `multi_modal_projector`.

An image is 1 to `max_num_tiles` (4) tiles of 560² and its aspect ratio id (`MllamaRules`). The
tower runs each image as all `max_num_tiles` tiles: the processor's padding tiles are zero pixels,
masked for one another by `aspect_ratio_mask` but attended to by the real tokens (Hugging Face's
mask masks only padding against padding), so they change the real tokens and are run here too.
Its local and global transformers attend across the image's tiles (patches and a class token a
tile, padded to a multiple of 8); the last state and the intermediate layers' states are joined
(7680 wide), and `multi_modal_projector` takes them to the LLM's width: the cross-attention states
the LLM reads, `tokens_per_tile` rows a tile.

In the graph: the gather of each image slot's tiles from the batch's rows (zero tiles for the
padding ones), the whole vision model over [slots, 1, max_num_tiles, ...], the gather of the real
tiles' rows and the projector. On the host (`build_metadata`): per slot the row of each tile, its
aspect ratio id and mask, per input row its tile's slot, and the split attention's orders,
boundaries and source index (`split_attention`: the model's masked attention as two unmasked
calls on CUDA in half precision; `split_attention = False` on an adapter before its encoder
captures keeps Hugging Face's masked SDPA). A budget's compute is its image slots times
`max_num_tiles` tiles (`MllamaRules.budgets` sizes them).

State keys `vision_model.*` and `multi_modal_projector.*`; a full checkpoint's, under `model.` (as
transformers 5 saves it) or not (the release's files), map to them.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence
from typing import Any

import torch

from vitpool.families.mllama import split_attention
from vitpool.families.mllama.rules import MllamaRules
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, AdapterBase, renames
from vitpool.models.protocol import BudgetRange
from vitpool.models.tiled import install_kernels
from vitpool.packing import Budget
from vitpool.specs import IMAGE, ItemSpec, TensorSpec

# Four images of four tiles: the default budgets' largest; larger batches run eager.
MAX_GRAPH_TILES = 16


class MllamaEncoder(torch.nn.Module):
    """The tower and the projector."""

    def __init__(self, vision_model: torch.nn.Module, projector: torch.nn.Module) -> None:
        super().__init__()
        self.vision_model = vision_model
        self.multi_modal_projector = projector
        self.config = vision_model.config


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> MllamaEncoder:
    """Fresh tower and projector from a full MllamaConfig or a vision config with text_hidden_size."""
    from transformers.models.mllama.modeling_mllama import MllamaVisionModel

    full = MllamaAdapter.projector_config(config)
    vision_config = full.vision_config
    tower = MllamaVisionModel._from_config(vision_config, **({} if dtype is None else {"dtype": dtype}))
    projector = torch.nn.Linear(
        int(vision_config.vision_output_dim), int(full.text_config.hidden_size), bias=True
    )
    return MllamaEncoder(tower, projector if dtype is None else projector.to(dtype))


class MllamaAdapter(AdapterBase):
    """Adapter for `MllamaEncoder`: rows are the images' real tiles, laid into image slots of
    `max_num_tiles` tiles by metadata (see the module's opening)."""

    MAX_SAMPLED_ITEMS = 6  # images are large: a few make a batch
    PROJECTOR_FIELDS = (TEXT_HIDDEN_SIZE,)
    PROJECTOR_SUBJECT = "a Llama 3.2 Vision (mllama) vision config"
    PROJECTOR_ADVICE = (
        "to build its multi_modal_projector; give the full model's config (MllamaConfig) or a tower-only "
        "save that carries it"
    )
    CHECKPOINT_RENAMES = renames(
        (r"^model\.vision_model\.", "vision_model."),
        (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
    )

    def __init__(self, tower: MllamaEncoder) -> None:
        config = tower.config
        side = int(config.image_size) // int(config.patch_size)
        install_kernels(tower)
        # exact attention without the model's dense mask (`split_attention`); None: it does not apply
        self.split = split_attention.install_split_attention(tower.vision_model)
        self.split_attention = split_attention.SPLIT_ATTENTION  # off: Hugging Face's masked SDPA
        self.tower = tower
        self.max_num_tiles = int(config.max_num_tiles)
        self.tokens_per_tile = side * side + 1
        self.item_rules = MllamaRules(
            int(config.num_channels),
            int(config.image_size),
            self.tokens_per_tile,
            self.max_num_tiles,
            tuple((int(h), int(w)) for h, w in config.supported_aspect_ratios),
            ((int(tower.multi_modal_projector.out_features),),),
        )

    def max_rows(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_tile)

    def budget_range(self, device: torch.device) -> BudgetRange:
        """Whole tiles: a budget between two tile counts would only add padding."""
        step = self.tokens_per_tile
        return BudgetRange(step, MAX_GRAPH_TILES * step, step)

    def image_slots(self, num_rows: int, budget: Budget) -> int:
        """The images a batch of `num_rows` tiles within `budget` runs (each `max_num_tiles` tiles)."""
        return max(1, min(budget.max_sequences, budget.max_items, num_rows))

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        slots, tiles = self.image_slots(num_rows, budget), self.max_num_tiles
        # the split's indices whether it is on or not: the switch then needs no other buffers
        split = {} if self.split is None else self.split.layout.metadata_specs(slots)
        return {
            "tile_rows": TensorSpec((slots, tiles), torch.int64),  # num_rows: a zero tile
            "aspect_ratio_ids": TensorSpec((slots,), torch.int64),
            "aspect_ratio_mask": TensorSpec((slots, tiles), torch.int64),
            "output_tiles": TensorSpec((num_rows,), torch.int64),  # slot * max_num_tiles + tile
            **split,
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        slots, tiles = self.image_slots(num_rows, budget), self.max_num_tiles
        needed = sum(spec.num_rows for spec in specs)
        if needed > num_rows or len(specs) > slots:
            raise ValueError(
                f"{len(specs)} images of {needed} tiles; the buffers hold {slots} images and {num_rows} tiles"
            )
        tile_rows = torch.full((slots, tiles), num_rows, dtype=torch.int64)
        # an unused slot runs a one-tile zero image: finite, and read by nobody
        ratio_ids = torch.full((slots,), self.item_rules.aspect_ratio_id((1, 1)), dtype=torch.int64)
        mask = torch.zeros((slots, tiles), dtype=torch.int64)
        mask[:, 0] = 1
        output_tiles = torch.zeros((num_rows,), dtype=torch.int64)
        start = 0
        for slot, spec in enumerate(specs):
            count = spec.num_rows
            tile_rows[slot, :count] = torch.arange(start, start + count)
            ratio_ids[slot] = self.item_rules.aspect_ratio_id((spec.layout[0], spec.layout[1]))
            mask[slot, :count] = 1
            output_tiles[start : start + count] = torch.arange(count) + slot * tiles
            start += count
        return {
            "tile_rows": tile_rows,
            "aspect_ratio_ids": ratio_ids,
            "aspect_ratio_mask": mask,
            "output_tiles": output_tiles,
            **({} if self.split is None else self.split.layout.build(mask)),
        }

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [rows, C, S, S] -> image slots [slots, 1 image, max_num_tiles, C, S, S]
        padded = torch.cat([pixels, pixels.new_zeros((1, *pixels.shape[1:]))])
        slots = padded[metadata["tile_rows"]].unsqueeze(1)
        running = (
            contextlib.nullcontext()
            if self.split is None
            else self.split.running(metadata if self.split_attention else None)
        )
        with running:
            states = self.tower.vision_model(
                pixel_values=slots,
                aspect_ratio_ids=metadata["aspect_ratio_ids"].unsqueeze(1),
                aspect_ratio_mask=metadata["aspect_ratio_mask"].unsqueeze(1),
            ).last_hidden_state  # [slots, 1, max_num_tiles, tokens_per_tile, vision_output_dim]
        states = states.reshape(-1, *states.shape[-2:])[metadata["output_tiles"]]  # [rows, tokens, D]
        return [
            self.tower.multi_modal_projector(states).reshape(
                -1, self.tower.multi_modal_projector.out_features
            )
        ]

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        rules = self.item_rules
        specs: list[ItemSpec] = []
        tiles_left = min(num_rows, budget.num_tokens // self.tokens_per_tile)
        images = min(self.image_slots(num_rows, budget), self.sampled_items(budget))
        while len(specs) < images:
            fitting = [canvas for canvas in rules.aspect_ratios if canvas[0] * canvas[1] <= tiles_left]
            if not fitting:
                break
            # Sometimes the largest that fits, usually any, so that padding tiles and rows are exercised.
            largest = max(canvas[0] * canvas[1] for canvas in fitting)
            choices = [c for c in fitting if c[0] * c[1] == largest] if rng.random() < 0.2 else fitting
            canvas = rng.choice(choices)
            count = canvas[0] * canvas[1]
            specs.append(rules.item_spec(IMAGE, (count, *self.row_shape), "float32", canvas))
            tiles_left -= count
        return specs


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = MllamaAdapter.tower_only_config
convert_checkpoint = MllamaAdapter.convert_checkpoint
