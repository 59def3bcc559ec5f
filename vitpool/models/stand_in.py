"""The base of the transformers drop-in's stand-ins (`vitpool.integrations.transformers`): a module
that takes the place of a model's vision modules and answers from an encoder (an `EncoderPool` or
a `GraphEncoder`). Each family answered at `get_image_features` has its stand-in in its own
package (`features.py`).

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

from typing import Any, Protocol

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

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
