"""Mistral 3 (Mistral Small 3.1 / 3.2 and their kin): the Pixtral tower (`PixtralVisionModel`) and
the model's `Mistral3MultiModalProjector`, run together in one graph.

Hugging Face's `Mistral3Model.get_image_features` takes a padded batch [B, 3, H, W] and each image's
real size (`image_sizes`). The tower convolves each image into P x P patches (`patch_conv`), keeps
each image's own h x w patches, flattens them row-major into one sequence, gives every patch its
2D rotary position (row, column: `PixtralVisionRotaryEmbedding`, axial), and attends with a
block-diagonal mask: each image over itself. The projector takes the hidden states of
`vision_feature_layer` (the last layer's in every release), RMS-normalises each row, lets its
patch merger unfold each image's m x m blocks into rows of m²*d features (channel-major, as
`F.unfold` lays them), projects them back to d (`merging_layer`), then runs a GELU MLP into the
LLM's width.

What differs for static capture (the rows are the patches, one per row: `rules.py`):

- `patch_conv` on a patch row is the convolution on the image (its kernel is its stride);
- the rotary positions [rows, 2] and the attention boundaries (`cu_seqlens`, one sequence per
  image and a trailing one for the padding rows; a static `max_seqlen`, the buffer's rows) are
  precomputed on the host per grid, and the tower's layers run with the packed attention;
- only the layers up to the projector's feature layer run (a later layer's output is not read);
- the merger's per-image `unfold` becomes one gather by a [tokens, m²] index of rows (blocks
  row-major, within a block row-major), transposed to unfold's channel-major order.

Padding rows sit at rotary position (0, 0) in their own sequence; padding tokens gather row 0.

One-token images. Hugging Face's `get_image_features` fails on a batch whose images give one token
in all (an m x m-patch image alone): it calls `squeeze(0)` on the projector's [1, D] output, which
drops the token axis, and `torch.split` then finds D rows where it expects 1. The model's math is
defined for them (the same image beside another one gets its token there): vitpool serves them.
An image under m patches a side gives no token (the merger's `unfold` has no block): the rules
refuse it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from vitpool.errors import ConfigError
from vitpool.families.mistral3.rules import Mistral3Rules
from vitpool.kernels.attention import install_packed_attention
from vitpool.models.adapter_base import AdapterBase, ConfigField, is_full_config, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.models.spatial_merge import item_cu_seqlens, item_grids
from vitpool.packing import Budget
from vitpool.rules.patch_rows import Grid
from vitpool.specs import ItemSpec

# What `Mistral3Adapter.forward` uses of transformers' Pixtral tower and Mistral 3 projector.
TOWER_PARTS = (
    "vision_tower.patch_conv",
    "vision_tower.ln_pre",
    "vision_tower.patch_positional_embedding",
    "vision_tower.transformer.layers",
    "multi_modal_projector.norm",
    "multi_modal_projector.patch_merger.merging_layer",
    "multi_modal_projector.linear_1",
    "multi_modal_projector.act",
    "multi_modal_projector.linear_2",
)
Tensors = dict[str, torch.Tensor]


class Mistral3Encoder(torch.nn.Module):
    """The Pixtral tower and Mistral 3's projector; state keys `vision_tower.*` and
    `multi_modal_projector.*` (a full checkpoint has them so, or under `model.`).

    Args:
        vision_tower: a `PixtralVisionModel`.
        multi_modal_projector: a `Mistral3MultiModalProjector`.
        vision_feature_layer: the hidden state the projector reads (the model config's; -1: the
            last layer's output, 0: the patch embeddings).

    Attributes:
        feature_index: that hidden state's index, 0 to the tower's layer count: the output of
            that many layers.
    """

    def __init__(
        self,
        vision_tower: torch.nn.Module,
        multi_modal_projector: torch.nn.Module,
        vision_feature_layer: Any = -1,
    ) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = multi_modal_projector
        self.config = vision_tower.config
        self.feature_index = feature_index(vision_feature_layer, len(vision_tower.transformer.layers))


def feature_index(vision_feature_layer: Any, num_layers: int) -> int:
    """The index into the tower's hidden states (0: the embeddings, `num_layers`: the last layer's
    output) of the model's `vision_feature_layer`.

    Raises:
        ConfigError: a list of layers (Hugging Face's Mistral 3 cannot run it either: its
            projector's norm and patch merger are one layer wide), or a layer out of range.
    """
    if isinstance(vision_feature_layer, (list, tuple)):
        raise ConfigError(
            f"Mistral 3: vision_feature_layer {list(vision_feature_layer)} (several layers) is not run; the "
            "projector's norm and patch merger take one layer's features (Hugging Face's model fails on it "
            "too)"
        )
    layer = int(vision_feature_layer)
    index = layer if layer >= 0 else num_layers + 1 + layer
    if not 0 <= index <= num_layers:
        raise ConfigError(
            f"Mistral 3: vision_feature_layer {layer} is outside the tower's {num_layers} layers"
        )
    return index


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> Mistral3Encoder:
    """Fresh tower and projector from a full `Mistral3Config` or a vision config with the adapter's
    PROJECTOR_FIELDS (`Mistral3Adapter.tower_only_config`)."""
    from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector
    from transformers.models.pixtral.modeling_pixtral import PixtralVisionModel

    if is_full_config(config):  # refused unless it is Mistral 3's
        config = Mistral3Adapter.tower_only_config(config)
    full = Mistral3Adapter.projector_config(config)
    tower, projector = tower_and_projector(PixtralVisionModel, Mistral3MultiModalProjector, full, dtype)
    return Mistral3Encoder(tower, projector, full.vision_feature_layer)


class Mistral3Adapter(AdapterBase):
    """Adapter for `Mistral3Encoder`: patch rows in, the projector's tokens out."""

    # What a tower-only save's vision config carries besides Pixtral's fields, for the projector
    # (`vision_config`, `text_config.hidden_size` and `rms_norm_eps`, and the rest by these names).
    PROJECTOR_FIELDS = (
        ConfigField("text_hidden_size", "text_config.hidden_size", int),
        ConfigField("text_rms_norm_eps", "text_config.rms_norm_eps", float),
        ConfigField("spatial_merge_size", "spatial_merge_size", int),
        ConfigField("projector_hidden_act", "projector_hidden_act"),
        ConfigField("multimodal_projector_bias", "multimodal_projector_bias", bool),
        ConfigField("vision_feature_layer", "vision_feature_layer"),
    )
    PROJECTOR_SUBJECT = "Mistral 3's projector"
    PROJECTOR_ADVICE = (
        "besides the Pixtral vision config: give the full model's config (Mistral3Config) or a tower-only "
        "save written with tower_only_config"
    )
    # Another model with a Pixtral tower (Pixtral-12B's LLaVA, LightOnOCR) has another projector.
    FULL_MODEL_TYPES = ("mistral3",)
    OTHER_MODEL = (
        "vitpool's mistral3 family runs the Pixtral tower with Mistral 3's patch-merging projector; a "
        "{model_type} checkpoint has another projector, which vitpool does not run"
    )
    # A full checkpoint's keys (the record's prefixes): as saved (`vision_tower.`,
    # `multi_modal_projector.`: what transformers writes, and the releases' layout) or as the model's
    # state_dict holds them (under `model.`).
    CHECKPOINT_RENAMES = renames((r"^model\.(vision_tower|multi_modal_projector)\.", r"\1."))

    def __init__(self, tower: Mistral3Encoder) -> None:
        check_tower_parts("Mistral 3", tower, TOWER_PARTS)
        vision, projector = tower.vision_tower, tower.multi_modal_projector
        config = vision.config
        self.tower = tower
        self.merge_size = int(projector.patch_merger.spatial_merge_size)
        self.item_rules = Mistral3Rules(
            int(config.num_channels),
            int(config.patch_size),
            self.merge_size,
            int(projector.linear_2.out_features),
        )
        self.merge_unit = self.item_rules.merge_unit
        self.num_layers_run = tower.feature_index  # later layers' outputs are not read
        self._per_grid = lru_cache(maxsize=1024)(self._grid_tensors)
        install_packed_attention(vision)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return {
            "position_ids": TensorSpec((num_rows, 2), torch.long),  # (row, column) of each patch
            # one sequence per image, the padding's, the leading 0
            "cu_seqlens": TensorSpec((budget.max_items + 2,), torch.int32),
            "merge_index": TensorSpec((budget.num_tokens, self.merge_unit), torch.long),
        }

    def build_metadata(self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget) -> Tensors:
        grids = item_grids(specs, num_rows, budget)
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        metadata["cu_seqlens"] = item_cu_seqlens(grids, num_rows, budget.max_items)
        row = token = 0
        for grid in grids:
            positions, merge_index = self._per_grid(grid)
            metadata["position_ids"][row : row + positions.shape[0]] = positions
            metadata["merge_index"][token : token + merge_index.shape[0]] = merge_index + row
            row += positions.shape[0]
            token += merge_index.shape[0]
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [rows, C, P, P], one patch per row
        vision, projector = self.tower.vision_tower, self.tower.multi_modal_projector
        embeddings = vision.patch_conv(pixels.to(vision.patch_conv.weight.dtype)).flatten(1)  # [rows, d]
        hidden = vision.ln_pre(embeddings).unsqueeze(
            0
        )  # [1, rows, d]: the tower's layers take a batch of one
        position_embeddings = vision.patch_positional_embedding(hidden, metadata["position_ids"])
        cu_seqlens, num_rows = metadata["cu_seqlens"], pixels.shape[0]
        for layer in vision.transformer.layers[: self.num_layers_run]:
            hidden = layer(
                hidden,
                None,
                position_embeddings=position_embeddings,
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens,
                max_length_q=num_rows,
                max_length_k=num_rows,  # static: Python ints from the buffer's shape
            )
        normed = projector.norm(hidden[0])
        merge_index = metadata["merge_index"]
        # [tokens, m², d] -> [tokens, d, m²]: F.unfold's channel-major features of a block
        blocks = normed[merge_index].transpose(1, 2).reshape(merge_index.shape[0], -1)
        merged = projector.patch_merger.merging_layer(blocks)
        return [projector.linear_2(projector.act(projector.linear_1(merged)))]

    def _grid_tensors(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's rotary positions [h*w, 2] (row, column; row-major as the tower flattens its
        patches) and its merger's gather index [tokens, m²] (token (bh, bw) takes rows
        (bh*m + i) * w + bw*m + j for i, j row-major, as `F.unfold` visits a block)."""
        _, h, w = grid
        m = self.merge_size
        rows, columns = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions = torch.stack([rows.flatten(), columns.flatten()], dim=-1)
        merge_index = torch.arange(h * w).view(h // m, m, w // m, m).transpose(1, 2).reshape(-1, m * m)
        return positions, merge_index


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
projector_config = Mistral3Adapter.projector_config
tower_only_config = Mistral3Adapter.tower_only_config
convert_checkpoint = Mistral3Adapter.convert_checkpoint
