"""The `get_image_features` stand-in of VideoLLaMA 3's Hugging Face model (the transformers
drop-in, `vitpool.integrations.transformers`; why one step above the tower: `vitpool.models.stand_in`).
The model resamples the tower's output per item (`pixel_unshuffle`, inside the tower class, by the
merge sizes it is given) and runs its projector in `get_image_features`, which `get_video_features`
calls too; a tower stand-in answering [tokens, D] would be resampled and projected again. So the
stand-in answers `get_image_features` (both modalities) and the projector becomes a pass-through."""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vitpool.items import Video
from vitpool.models.stand_in import Image, Item, PooledImageFeatures


class VideoLlama3Features(PooledImageFeatures):
    """`VideoLlama3Model.get_image_features`: patch rows [rows, C*P*P] of all images (or videos),
    their grids and merge sizes in; `pooler_output` one tensor an item out, `last_hidden_state`
    all of them joined. Items `Image(rows, (t, h, w, merge size))`, or `Video` where t > 1."""

    family = "VideoLLaMA 3"
    tower = "vision_model"
    projectors = ("projector",)

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        image_merge_sizes: torch.Tensor,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling:
        grids = [tuple(int(n) for n in grid) for grid in torch.as_tensor(image_grid_thw).tolist()]
        merges = [int(m) for m in torch.as_tensor(image_merge_sizes).reshape(-1).tolist()]
        rows = [t * h * w for t, h, w in grids]
        if sum(rows) != pixel_values.shape[0] or len(merges) != len(grids):
            raise ValueError(
                f"pixel_values have {pixel_values.shape[0]} rows; image_grid_thw {grids} needs {sum(rows)}, "
                f"with one merge size each (got {merges})"
            )
        chunks = torch.split(pixel_values.detach().cpu(), rows)
        items: list[Item] = [
            (Video if grid[0] > 1 else Image)(chunk, (*grid, merge))
            for chunk, grid, merge in zip(chunks, grids, merges)
        ]
        tokens = tuple(self._encode(items))
        return BaseModelOutputWithPooling(last_hidden_state=torch.cat(tokens), pooler_output=tokens)

    @staticmethod
    def encoder_module(inner: torch.nn.Module, tower: torch.nn.Module) -> torch.nn.Module:
        import copy

        from vitpool.families.video_llama_3.adapter import VideoLlama3Encoder

        # copies: the adapter changes the tower's attention
        return VideoLlama3Encoder(copy.deepcopy(tower), copy.deepcopy(inner.projector))
