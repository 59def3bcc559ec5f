"""Plain data that crosses every layer: the inputs (Image, Video) and the output (Embedding).

Inputs are checked when they are encoded, not when they are built, so that an error can name
the item's position in the caller's list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Image:
    """One image as the model's processor emits it.

    Args:
        pixel_values: flattened patches [t*h*w, C*T*P*P] (torch tensor or NumPy array, floating
            point), in the processor's order (merge blocks contiguous).
        grid_thw: (t, h, w) in patches; t is 1 for an image.
    """

    pixel_values: Any
    grid_thw: Any


@dataclass
class Video:
    """One video clip: like `Image`, with t temporal patches (frames / temporal patch size)."""

    pixel_values: Any
    grid_thw: Any


Item = Image | Video


@dataclass
class Embedding:
    """The encoder's output for one item.

    Attributes:
        tokens: merged output tokens [num_tokens, hidden] (the LLM's embedding width).
        deepstack: per-deepstack-layer features, each [num_tokens, hidden]; empty for models
            without deepstack.
    """

    tokens: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)
