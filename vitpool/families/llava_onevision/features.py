"""The `get_image_features` stand-in of LLaVA-OneVision's Hugging Face model (the transformers
drop-in, `vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`).
The model packs each image's features after its projector (the unpadding, the pooling, the
newlines), which a tower stand-in could not skip. Images only: `get_video_features` calls the tower
itself, which this stand-in refuses with a message."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.errors import ConfigError
from vitpool.families.llava_onevision.rules import LlavaOnevisionRules, max_num_patches_of
from vitpool.models.family import named_object

# Image and Item through the stand-ins' base, which holds the one known arrow from models/ up to
# items.py (tests/unit/test_import_flow.py): a stand-in builds items
from vitpool.models.stand_in import Encoder, Image, Item, PooledImageFeatures


class TileTableFeatures(PooledImageFeatures):
    """What LLaVA-OneVision's and LLaVA-NeXT's stand-ins share: the settings a call may name
    (`settings`, the model's config's: another value is refused), each image's tiles cut from
    pixel values padded per image or stacked, and the encoder module (`ENCODER`, "module:Class" of
    the family's `vitpool.families.llava_onevision.tile_table.TileTableEncoder`)."""

    tower = "vision_tower"
    projectors = ("multi_modal_projector",)
    ENCODER: str
    settings: dict[str, Any]

    def check_settings(self, asked: dict[str, Any]) -> None:
        """Raises ConfigError where a call names a setting other than the model's config's."""
        for name, value in asked.items():
            if value is not None and value != self.settings[name]:
                raise ConfigError(
                    f"{self.family}: the encoder runs {name}={self.settings[name]!r} (the model's config); "
                    f"got {value!r}"
                )

    def images(
        self, pixel_values: torch.Tensor, counts: list[int], sizes: list[tuple[int, int]]
    ) -> list[Item]:
        """`Image(tiles, size)` an image, its `counts[i]` tiles of `pixel_values`.

        Raises:
            ConfigError: pixel values neither [images, tiles, 3, S, S] nor the images' tiles stacked.
        """
        pixels = pixel_values.detach().cpu()
        if pixels.dim() == 5:  # padded per image
            tiles = [pixels[index, :count] for index, count in enumerate(counts)]
        elif pixels.dim() == 4 and pixels.shape[0] == sum(counts):  # the images' tiles, stacked
            tiles = list(pixels.split(counts))
        else:
            raise ConfigError(
                f"{self.family}: pixel_values of shape {tuple(pixels.shape)} are not [images, tiles, 3, S, "
                f"S] nor the {sum(counts)} tiles of images of sizes {sizes}, stacked"
            )
        return [Image(image_tiles, size) for image_tiles, size in zip(tiles, sizes)]

    @classmethod
    def encoder_module(cls, inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:  # type: ignore[override]
        return named_object(cls.ENCODER)(
            copy.deepcopy(tower),
            copy.deepcopy(inner.multi_modal_projector),
            inner.image_newline,
            inner.config,
        )


class LlavaOnevisionFeatures(TileTableFeatures):
    """`LlavaOnevisionModel.get_image_features`: pixel values [images, tiles, 3, S, S] padded with
    zero tiles (or the images' tiles stacked, [tiles, 3, S, S]), `image_sizes` [images, 2] and
    `batch_num_images` in; `pooler_output` one tensor an image out. An image of a one-image sample
    is its grid's tiles (`image_grid_pinpoints`), an image of a sample of several its base tile: the
    item `Image(tiles, image_sizes[i])`, as the model counts them."""

    family = "LLaVA-OneVision"
    ENCODER = "vitpool.families.llava_onevision.adapter:LlavaOnevisionEncoder"

    def __init__(self, encoder: Encoder, dtype: torch.dtype, device: torch.device, config: Any) -> None:
        super().__init__(encoder, dtype, device, config)
        vision = config.vision_config
        self.settings = {
            "vision_feature_layer": config.vision_feature_layer,
            "vision_feature_select_strategy": config.vision_feature_select_strategy,
            "vision_aspect_ratio": config.vision_aspect_ratio,
        }
        self.rules = LlavaOnevisionRules(
            channels=int(vision.num_channels),
            tile_size=int(vision.image_size),
            patch_size=int(vision.patch_size),
            pinpoints=tuple(tuple(int(v) for v in pin) for pin in config.image_grid_pinpoints),
            max_num_patches=max_num_patches_of(config.vision_aspect_ratio),
            output_width=int(config.text_config.hidden_size),
        )

    def forward(self, *args: Any, **kwargs: Any) -> BaseModelOutputWithPooling:
        raise ConfigError(
            "the transformers drop-in answers LLaVA-OneVision's get_image_features only; its "
            "get_video_features calls the tower directly: encode videos as vitpool.Video(frames) items "
            "instead"
        )

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        image_sizes: torch.Tensor,
        vision_feature_layer: Any = None,
        vision_feature_select_strategy: str | None = None,
        vision_aspect_ratio: str | None = None,
        batch_num_images: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        asked = {
            "vision_feature_layer": vision_feature_layer,
            "vision_feature_select_strategy": vision_feature_select_strategy,
            "vision_aspect_ratio": vision_aspect_ratio,
        }
        self.check_settings(asked)
        sizes = [(int(h), int(w)) for h, w in torch.as_tensor(image_sizes).tolist()]
        alone = (
            [True] * len(sizes)
            if batch_num_images is None
            else [int(n) == 1 for n in torch.as_tensor(batch_num_images).tolist() for _ in range(int(n))]
        )
        # as the model counts them: a one-image sample's grid and base tile, else the base tile
        counts = [
            self.rules.packed_grid(*size).num_crops + 1 if is_alone else 1
            for size, is_alone in zip(sizes, alone)
        ]
        items = self.images(pixel_values, counts, sizes)
        return BaseModelOutputWithPooling(pooler_output=self._encode(items))
