"""A drop-in vision tower for Hugging Face vision-language models of every family vitpool serves
(Qwen3-VL, Qwen3.5, Qwen2.5-VL, Qwen2-VL, GLM-4.1V / 4.5V / 4.6V): `model.generate(...)` encodes
images and videos through an `EncoderPool` (or an in-process `GraphEncoder`), deepstack features
included where the family has them.

    from vitpool.integrations.transformers import replace_vision_tower
    original = replace_vision_tower(model, pool)       # model.model.visual now asks the pool
    model.generate(**inputs)                           # same tokens as with the original tower

The model calls its tower with the processor's pixel rows of all images (or all videos) of a
request and their grids; the stand-in splits them into items, encodes them, and answers in the
tower's own output type (`pooler_output`, and `deepstack_features` for a family that has them),
on the model's device and in its dtype. GLM passes a video as one (1, h, w) grid row per frame;
its tower encodes each frame alone, so those rows are encoded as images, with the same result.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from vitpool.graphs import GraphEncoder
from vitpool.items import Embedding, Image, Item, Video
from vitpool.models.registry import find_family, supported_model_types


class Encoder(Protocol):
    def encode(self, items: list[Item]) -> list[Embedding]: ...


class PooledVisionTower(torch.nn.Module):
    """Stands in for `model.model.visual` of a vision-language model of a vitpool family.

    Args:
        encoder: an `EncoderPool` or a `GraphEncoder` (anything with `encode(items)`), loaded with
            the same vision weights as the model.
        spatial_merge_size: the tower's merge size (2 in every family so far); the model's
            `get_image_features` / `get_video_features` read it from the tower.
        dtype, device: where the model expects the embeddings.
    """

    def __init__(self, encoder: Encoder, spatial_merge_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.encoder = encoder
        self.spatial_merge_size = spatial_merge_size
        self._dtype = dtype
        self._device = torch.device(device)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any
    ) -> BaseModelOutputWithPooling:
        grids = [tuple(int(n) for n in grid) for grid in grid_thw.tolist()]
        rows = [t * h * w for t, h, w in grids]
        if sum(rows) != pixel_values.shape[0]:
            raise ValueError(f"pixel_values have {pixel_values.shape[0]} rows; grid_thw {grids} needs {sum(rows)}")
        # A grid with one temporal patch is an image to the tower, whether it came as one or not.
        items: list[Item] = [
            (Image if grid[0] == 1 else Video)(chunk.detach().cpu(), grid)
            for chunk, grid in zip(torch.split(pixel_values, rows), grids)
        ]
        results = self.encoder.encode(items)
        tokens = self._gather([r.tokens for r in results])
        num_deepstack = len(results[0].deepstack) if results else 0
        if not num_deepstack:  # Qwen2-VL, Qwen2.5-VL, Qwen3.5, GLM: the merged tokens alone
            return BaseModelOutputWithPooling(pooler_output=tokens)
        deepstack = [self._gather([r.deepstack[k] for r in results]) for k in range(num_deepstack)]
        return BaseModelOutputWithDeepstackFeatures(pooler_output=tokens, deepstack_features=deepstack)

    def _gather(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.to(self._device, self._dtype, non_blocking=True) for t in tensors])


def replace_vision_tower(model: torch.nn.Module, encoder: Encoder) -> torch.nn.Module:
    """Make `model` (a Hugging Face vision-language model with its tower at `model.model.visual`:
    Qwen3-VL, Qwen3.5, Qwen2.5-VL, Qwen2-VL, GLM-4.1V / 4.5V / 4.6V) encode through `encoder`.
    Returns the original tower, to put back or free."""
    inner = getattr(model, "model", model)
    original = getattr(inner, "visual", None)
    if original is None:
        raise TypeError(f"{type(model).__name__} has no vision tower at .model.visual")
    weight = next(original.parameters())
    merge = getattr(original, "spatial_merge_size", None) or original.config.spatial_merge_size
    inner.visual = PooledVisionTower(encoder, merge, weight.dtype, weight.device)
    return original


def graph_encoder_for(model: torch.nn.Module, **kwargs: Any) -> GraphEncoder:
    """An in-process GraphEncoder over a copy of `model`'s own vision tower (same weights, same
    device and dtype). `kwargs` go to GraphEncoder (budgets, max_items_per_batch, ...)."""
    tower = getattr(model, "model", model).visual
    if isinstance(tower, PooledVisionTower):
        raise TypeError("the model's tower is already replaced; pass the original tower's model")
    model_type = getattr(getattr(tower, "config", None), "model_type", None)
    family = find_family(model_type) if model_type else None
    if family is None:
        raise TypeError(
            f"{type(model).__name__}'s vision tower ({model_type!r}) is of no vitpool family; "
            f"supported: {', '.join(supported_model_types())}"
        )
    weight = next(tower.parameters())
    adapter = family.adapter(copy.deepcopy(tower))  # the adapter changes the tower's attention
    return GraphEncoder(adapter, device=weight.device, dtype=weight.dtype, **kwargs)
