"""Stand-ins for the `get_image_features` of the vision-language models whose vision path vitpool
answers one step above the tower (used by `vitpool.integrations.transformers`).

The families added later (InternVL, Llama 4, Step-3.7, DeepSeek-OCR-2, MiniCPM-V 4.6) are answered
one step up, at the model's `get_image_features`, not at the tower: their models do work between
the tower and the LLM that a tower stand-in cannot skip (InternVL's `pixel_shuffle`, a method of
the model; Step-3.7's and DeepSeek-OCR-2's join of crops and global view, and the separator;
MiniCPM-V 4.6's Merger), and they call their tower without a grid. Their forward calls
`self.get_image_features(...)` and nothing else of the vision modules (Llama 4 then runs its
projector), so a bound method of the stand-in (`PooledImageFeatures`) set on the model instance
takes the call; the tower attribute holds the stand-in and the projector (or Merger) becomes a
pass-through, so nothing of the original vision modules runs (`restore_vision_tower` puts them
back and removes the instance attribute). The stand-in builds vitpool's items
from what the model is given: one item per image where its inputs say where an image ends
(Step-3.7's and DeepSeek-OCR-2's `num_local_patches`), one per tile (InternVL, Llama 4: the model
gets the tiles of all images with no boundaries, and a tile attends within itself) and one per
slice (MiniCPM-V 4.6: `target_sizes` has a row per slice, each its own attention sequence), so the
results do not depend on where one image ends. It answers in the fields and shapes the model
reads. Images only: MiniCPM-V 4.6's videos reach the stand-in as frames' slices, not tested.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.errors import ConfigError
from vitpool.items import Embedding, Image, Item


class Encoder(Protocol):
    def encode(self, items: list[Item]) -> list[Embedding]: ...


class StandIn(torch.nn.Module):
    """What every stand-in for a model's vision modules holds: the encoder that answers, and the
    dtype and device the model expects its embeddings in (read by the model as its tower's)."""

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.encoder = encoder
        self._dtype = dtype
        self._device = torch.device(device)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device


class PooledImageFeatures(StandIn):
    """Stands in for the vision tower of a family whose model's `get_image_features` vitpool
    answers (see the module's opening); `get_image_features` takes the model's arguments.

    A subclass names the model's attributes (`tower`, `projectors`) and writes
    `get_image_features` and `encoder_module`.

    Args:
        encoder: an `EncoderPool` or a `GraphEncoder`, loaded with the same vision weights.
        dtype, device: where the model expects the embeddings.
        config: the model's config (`model.model.config`, or Llama 4's own).
    """

    family: str
    tower: str
    projectors: tuple[str, ...] = ("multi_modal_projector",)

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device)

    def forward(self, *args: Any, **kwargs: Any) -> BaseModelOutputWithPooling:
        return self.get_image_features(*args, **kwargs)

    def get_image_features(self, *args: Any, **kwargs: Any) -> BaseModelOutputWithPooling:
        raise NotImplementedError

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        """vitpool's module over copies of `inner`'s tower and projector (for `graph_encoder_for`)."""
        raise NotImplementedError

    def _encode(self, items: list[Item]) -> list[torch.Tensor]:
        """Each item's tokens [num_tokens, LLM width], on the model's device and in its dtype."""
        return [r.tokens.to(self._device, self._dtype, non_blocking=True) for r in self.encoder.encode(items)]

    def _encode_tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [tiles, C, S, S] of any number of images, one item each -> [tiles, tokens a tile, width]."""
        return torch.stack(self._encode([Image(tile[None]) for tile in pixel_values.detach().cpu()]))


class InternVLFeatures(PooledImageFeatures):
    """`InternVLModel.get_image_features`: tiles in, `pooler_output` [tiles, tokens a tile, width]."""

    family = "InternVL"
    tower = "vision_tower"

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        if vision_feature_layer not in (None, -1) or vision_feature_select_strategy not in (None, "default"):
            raise ConfigError(
                "vitpool runs InternVL with vision_feature_layer=-1 and vision_feature_select_strategy="
                f"'default'; got {vision_feature_layer!r}, {vision_feature_select_strategy!r}: leave them "
                "unset"
            )
        return BaseModelOutputWithPooling(pooler_output=self._encode_tiles(pixel_values))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.models.internvl import InternVLEncoder

        return InternVLEncoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector), inner.config)


class Llama4Features(PooledImageFeatures):
    """`Llama4ForConditionalGeneration.get_image_features`: tiles in, `last_hidden_state` [tiles,
    tokens a tile, LLM width], already projected (the model's projector is a pass-through)."""

    family = "Llama 4"
    tower = "vision_model"

    def get_image_features(self, pixel_values: torch.Tensor, **kwargs: Any) -> BaseModelOutputWithPooling:
        return BaseModelOutputWithPooling(last_hidden_state=self._encode_tiles(pixel_values))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.models.llama4 import Llama4Encoder

        return Llama4Encoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector))


class Step3p7Features(PooledImageFeatures):
    """`Step3p7Model.get_image_features`: a global view per image (`pixel_values` [images, C, S, S]),
    the crops of all images (`pixel_values_local`) and each image's crop count
    (`num_local_patches`) in; `pooler_output` one tensor an image (crops' tokens, then the global
    view's) out. Items `Image(view, inputs={"pixel_values_local": its crops})`."""

    family = "Step-3.7"
    tower = "vision_model"

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        pixel_values_local: torch.Tensor | None = None,
        num_local_patches: Any = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        views = pixel_values.detach().cpu()
        counts = [0] * len(views) if num_local_patches is None else [int(n) for n in num_local_patches]
        num_crops = 0 if pixel_values_local is None else pixel_values_local.shape[0]
        if len(counts) != len(views) or sum(counts) != num_crops:
            raise ValueError(
                f"{self.family}: num_local_patches {counts} must give each of the {len(views)} images its "
                f"crops and add up to the {num_crops} crops of pixel_values_local"
            )
        crops = torch.split(pixel_values_local.detach().cpu(), counts) if num_crops else [None] * len(views)
        items: list[Item] = [
            Image(view[None], inputs={"pixel_values_local": local} if count else None)
            for view, local, count in zip(views, crops, counts)
        ]
        return BaseModelOutputWithPooling(pooler_output=self._encode(items))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.models.step3p7 import LOCAL_IMAGE_SIZE, Step3p7Encoder

        local = int(getattr(tower.config, "local_image_size", None) or LOCAL_IMAGE_SIZE)
        return Step3p7Encoder(copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector), local)


class DeepseekOcr2Features(Step3p7Features):
    """`DeepseekOcr2Model.get_image_features`: Step-3.7's arguments and answer; vitpool's global
    path appends the `view_separator` to each image's tokens, as the model does."""

    family = "DeepSeek-OCR-2"
    tower = "vision_tower"

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.models.deepseek_ocr2 import LOCAL_IMAGE_SIZE, DeepseekOcr2Encoder

        local = int(getattr(tower.config, "local_image_size", None) or LOCAL_IMAGE_SIZE)
        return DeepseekOcr2Encoder(
            copy.deepcopy(tower), copy.deepcopy(inner.multi_modal_projector), inner.view_separator, local
        )


class MiniCPMV4_6Features(PooledImageFeatures):
    """`MiniCPMV4_6Model.get_image_features`: the processor's strip [1, C, P, N*P] of every slice's
    patches and `target_sizes` [slices, 2] in; `pooler_output` one tensor a slice out. Items
    `Image(a slice's patch rows, [[h, w]])`."""

    family = "MiniCPM-V 4.6"
    tower = "vision_tower"
    projectors = ("merger",)

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)
        self.patch_size = int(config.vision_config.patch_size)
        self.downsample_mode = config.downsample_mode

    def get_image_features(
        self, pixel_values: torch.Tensor, target_sizes: torch.Tensor, downsample_mode: str | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        from vitpool.models.minicpmv4_6_rules import patch_rows

        mode = downsample_mode or self.downsample_mode
        if mode != "16x":
            raise ConfigError(f"{self.family}: vitpool runs downsample_mode '16x' only; got {mode!r}")
        sizes = [(int(h), int(w)) for h, w in torch.as_tensor(target_sizes).tolist()]
        rows = patch_rows(pixel_values.detach().cpu(), self.patch_size)  # [N, C, P, P]
        if sum(h * w for h, w in sizes) != rows.shape[0]:
            raise ValueError(
                f"{self.family}: pixel_values hold {rows.shape[0]} patches; target_sizes {sizes} need "
                f"{sum(h * w for h, w in sizes)}"
            )
        chunks = torch.split(rows, [h * w for h, w in sizes])
        items: list[Item] = [Image(chunk, [[h, w]]) for chunk, (h, w) in zip(chunks, sizes)]
        return BaseModelOutputWithPooling(pooler_output=self._encode(items))

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        from vitpool.models.minicpmv4_6 import MiniCPMV4_6Encoder

        if inner.config.downsample_mode != "16x":
            raise ConfigError(
                f"MiniCPM-V 4.6: vitpool runs downsample_mode '16x' only; the model's config has "
                f"{inner.config.downsample_mode!r}"
            )
        return MiniCPMV4_6Encoder(copy.deepcopy(tower), copy.deepcopy(inner.merger))


# by the tower's config model_type: families answered at get_image_features
FEATURE_STAND_INS: dict[str, type[PooledImageFeatures]] = {
    "internvl_vision": InternVLFeatures,
    "llama4_vision_model": Llama4Features,
    "step3p5_vision": Step3p7Features,
    "deepseek_ocr2_vision": DeepseekOcr2Features,
    "minicpmv4_6_vision": MiniCPMV4_6Features,
}
