"""LLaVA 1.5 (`LlavaModel`): the CLIP tower (`CLIPVisionModel`), the feature selection of
`get_image_features` and the `multi_modal_projector` (`LlavaMultiModalProjector`), in one graph.

An image is one view of one fixed size (336² in llava-1.5-7b-hf: `CLIPImageProcessor` resizes and
centre-crops every image to it), so an image's item is [1, 3, S, S]; an item of several views (a
prompt's images, stacked as the processor stacks them) gives their tokens in order, as the model
scatters them into its prompt (`TileRules`, as Gemma 3's views). Each view is one fixed-length
attention sequence, its class token and (S / P)² patches, and the tower runs views as its batch
dimension, so a batch needs no metadata: a padding view is a zero view whose tokens nobody reads.

What the graph runs, as `get_image_features` computes it: the patch and position embeddings, CLIP's
`pre_layrnorm`, the encoder layers up to the deepest hidden state `vision_feature_layer` reads
(hidden state 0 is `pre_layrnorm`'s output, hidden state i the output of layer i), those hidden
states side by side, the class token dropped under `vision_feature_select_strategy="default"`, then
the projector into the LLM's width. Layers past the deepest one read are not run: with the releases'
-2 the last layer is cut. That is exact, not an approximation: each layer reads only the hidden
state before it, and nothing the model reads (the selected hidden states, hence the projector's
output) depends on the last layer or on `post_layernorm` (which normalises only the pooled class
token, `pooler_output`, that LLaVA never reads). The class token is dropped only after the layers,
as in Hugging Face, since every patch attends to it in each layer. The cut layer and
`post_layernorm` stay in the module (a checkpoint holds them and loads strictly); they are never run.

`LlavaEncoder` holds the tower and the projector (state keys `vision_tower.*` and
`multi_modal_projector.*`). transformers 5 saves them so (a model's state_dict has them under
`model.`); the releases keep CLIP's inner `vision_model.` level (`vision_tower.vision_model.*`),
which transformers 5's `CLIPVisionModel` no longer has.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import torch

from vitpool.errors import ConfigError
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE, ConfigField, renames
from vitpool.models.compat import check_tower_parts
from vitpool.models.projected import TowerWithProjector, tower_and_projector
from vitpool.models.tiled import TiledAdapter, install_kernels
from vitpool.rules.tiles import TileRules

TOWER_PARTS = (
    "vision_tower.embeddings",
    "vision_tower.pre_layrnorm",
    "vision_tower.encoder.layers",
    "multi_modal_projector.linear_2",
)
STRATEGIES = ("default", "full")  # LlavaConfig's: drop the class token, or keep it
# The default budgets hold up to MAX_GRAPH_VIEWS views (one an image: calls close together share a
# batch) and no more than MAX_GRAPH_TOKENS tokens: 8 views of 336² (576 tokens each). Larger batches
# run eager at their own size, where the tower is compute-bound and a graph saves little of the time
# (as for the other towers' large inputs); the caps are not yet tuned on a GPU for this family.
MAX_GRAPH_VIEWS = 8
MAX_GRAPH_TOKENS = 8192


class LlavaEncoder(TowerWithProjector):
    """The tower and the projector, as `LlavaModel` holds them, with what `get_image_features`
    reads of the full config (`settings`: vision_feature_layer, vision_feature_select_strategy)."""

    def __init__(self, vision_tower: torch.nn.Module, projector: torch.nn.Module, settings: Any) -> None:
        super().__init__(vision_tower, projector)
        self.vision_feature_layer = copy.deepcopy(settings.vision_feature_layer)
        self.vision_feature_select_strategy = settings.vision_feature_select_strategy


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> LlavaEncoder:
    """Fresh tower and projector from a full LlavaConfig or a CLIP vision config with the adapter's
    PROJECTOR_FIELDS."""
    from transformers import CLIPVisionModel
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    full = LlavaAdapter.projector_config(config)
    tower, projector = tower_and_projector(CLIPVisionModel, LlavaMultiModalProjector, full, dtype)
    return LlavaEncoder(tower, projector, full)


def feature_layers(vision_feature_layer: Any, num_layers: int) -> tuple[int, ...]:
    """The hidden states `get_image_features` reads, as indices from 0 (`pre_layrnorm`'s output)
    to `num_layers` (the last layer's), concatenated in this order where there are several.

    Raises:
        ConfigError: a layer outside the tower's hidden states.
    """
    layers = (
        vision_feature_layer if isinstance(vision_feature_layer, (list, tuple)) else [vision_feature_layer]
    )
    if not layers:
        raise ConfigError("LLaVA: vision_feature_layer selects no hidden state")
    indices = []
    for layer in layers:
        if isinstance(layer, bool) or int(layer) != layer:
            raise ConfigError(f"LLaVA: vision_feature_layer {layer!r} is not a layer index")
        index = int(layer) if int(layer) >= 0 else num_layers + 1 + int(layer)
        if not 0 <= index <= num_layers:
            raise ConfigError(
                f"LLaVA: vision_feature_layer {layer} is outside the tower's {num_layers + 1} hidden states "
                f"(-{num_layers + 1} to {num_layers})"
            )
        indices.append(index)
    return tuple(indices)


def graph_views(tokens_per_view: int) -> int:
    """The most views the default budgets hold: MAX_GRAPH_VIEWS, fewer where they would pass
    MAX_GRAPH_TOKENS (at least one)."""
    return max(1, min(MAX_GRAPH_VIEWS, MAX_GRAPH_TOKENS // tokens_per_view))


class LlavaAdapter(TiledAdapter):
    """Adapter for `LlavaEncoder`: rows are views (one an image), no metadata."""

    # What a tower-only save's vision config carries besides CLIP's fields (the full model's
    # LlavaConfig holds them): the projector's and the feature selection.
    PROJECTOR_FIELDS = (
        dataclasses.replace(TEXT_HIDDEN_SIZE, cast=int),
        *(
            ConfigField(name, name, copy.deepcopy)
            for name in (
                "projector_hidden_act",
                "multimodal_projector_bias",
                "vision_feature_layer",
                "vision_feature_select_strategy",
            )
        ),
    )
    PROJECTOR_SUBJECT = "a LLaVA vision config"
    PROJECTOR_ADVICE = (
        "to build its multi_modal_projector and select its features; give the full model's config "
        "(LlavaConfig) or a tower-only save written from tower_only_config (a plain CLIP tower has no "
        "projector for vitpool to run)"
    )
    # Other models with a CLIP tower (VipLLaVA's projector; LLaVA-NeXT's anyres grids, whose full
    # checkpoints find their own family first) are not this one.
    FULL_MODEL_TYPES = ("llava",)
    OTHER_MODEL = (
        "a {model_type} checkpoint with a CLIP vision tower: vitpool runs CLIP towers with LLaVA 1.5's "
        "projector and fixed-size views only (model_type {expected})"
    )
    # Tensors keyed as saved: `vision_tower.*` / `multi_modal_projector.*` (transformers 5's
    # save_pretrained, tower-only saves), the same under `model.` (a model's state_dict),
    # `vision_tower.vision_model.*` (the releases keep CLIP's tower one level down; transformers 5's
    # module has no such level).
    CHECKPOINT_RENAMES = renames(
        (r"^(?:model\.)?vision_tower\.vision_model\.", "vision_tower."), (r"^model\.", "")
    )
    # Older CLIP saves keep the position ids, a non-persistent buffer the module makes itself.
    CHECKPOINT_IGNORED = (re.compile(r"vision_tower\.(?:vision_model\.)?embeddings\.position_ids$"),)

    def __init__(self, tower: LlavaEncoder) -> None:
        check_tower_parts("LLaVA", tower, TOWER_PARTS)
        strategy = tower.vision_feature_select_strategy
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"LLaVA: vision_feature_select_strategy {strategy!r} is not one of {list(STRATEGIES)}"
            )
        vision = tower.vision_tower
        config = vision.config
        self.tower = tower
        self.feature_layers = feature_layers(tower.vision_feature_layer, len(vision.encoder.layers))
        # the class token goes after the layers (every patch attends to it in each of them)
        self.drops_class_token = strategy == "default"
        side = int(config.image_size) // int(config.patch_size)
        self.tokens_per_tile = side * side + (0 if self.drops_class_token else 1)
        self.max_graph_tiles = graph_views(self.tokens_per_tile)
        self.item_rules = TileRules(
            int(config.num_channels),
            int(config.image_size),
            self.tokens_per_tile,
            ((int(tower.multi_modal_projector.linear_2.out_features),),),
        )
        install_kernels(tower)

    @property
    def layers_run(self) -> int:
        """The encoder layers the graph runs: up to the deepest hidden state read."""
        return max(self.feature_layers)

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        # pixels: [views, C, S, S] -> features [views, tokens a view, D_vision * layers read]
        # -> tokens [views * tokens a view, LLM width]
        tokens = self.tower.multi_modal_projector(self._features(pixels))
        return [tokens.reshape(-1, tokens.shape[-1])]

    def _features(self, pixels: torch.Tensor) -> torch.Tensor:
        return clip_features(self.tower.vision_tower, pixels, self.feature_layers, self.drops_class_token)


def clip_features(
    vision: torch.nn.Module, pixels: torch.Tensor, layers: tuple[int, ...], drops_class_token: bool
) -> torch.Tensor:
    """A CLIP tower's hidden states `layers` (`feature_layers`) of views [views, C, S, S], side by
    side, less the class token where `drops_class_token` ("default"): [views, tokens a view,
    D_vision * layers read]. Layers past the deepest one read are not run."""
    hidden = vision.pre_layrnorm(vision.embeddings(pixels))
    states = {0: hidden}
    for index, layer in enumerate(vision.encoder.layers[: max(layers)], start=1):
        hidden = layer(hidden, None)  # None: every token of a view attends to every other
        states[index] = hidden
    read = [states[index] for index in layers]
    features = read[0] if len(read) == 1 else torch.cat(read, dim=-1)
    return features[:, 1:] if drops_class_token else features


# The loader's hooks (`vitpool.models.family.adapter_checkpoint`).
projector_config = LlavaAdapter.projector_config
tower_only_config = LlavaAdapter.tower_only_config
convert_checkpoint = LlavaAdapter.convert_checkpoint
