"""What the vLLM gateway reads of its checkpoint alone, before it needs the pool: the family, the
vision weights' digest, the image processor and the keys' model prefix. The command line reads it
on a thread of its own while it joins Ray and the pool, which a restarted gateway waits for too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitpool.integrations.vllm.images import (
    checkpoint_family,
    model_prefix,
    processor_backend,
    processor_items,
)
from vitpool.integrations.vllm.layouts import vllm_layout
from vitpool.items import Item
from vitpool.models.loading import vision_weights_digest


@dataclass(frozen=True)
class GatewayModel:
    """What the gateway reads of its checkpoint alone, no pool needed: the family, the vision
    weights' digest, the image processor's backend, the keys' model prefix and the item maker."""

    model_type: str
    weights: str
    processor: str  # "" where a function given makes the items
    identity: str
    make_item: Callable[[Any], Item]


def read_model(
    checkpoint: str | Path, dtype: torch.dtype, make_item: Callable[[Any], Item] | None = None
) -> GatewayModel:
    """Read the checkpoint's side of a gateway (`GatewayModel`); it reads the vision weights once.

    Raises:
        ConfigError: a family vLLM's layout is not known for, or whose items the gateway cannot
            make from its processor (give `make_item`).
    """
    model_type = checkpoint_family(checkpoint)
    vllm_layout(model_type)  # refuse a family vLLM's layout is not known for, first
    weights = vision_weights_digest(checkpoint)
    # a function given decides its own pixels; the checkpoint's processor, on vLLM's backend where it can
    processor = "" if make_item is not None else processor_backend()
    identity = model_prefix(checkpoint, dtype, processor)
    if make_item is None:
        make_item = processor_items(checkpoint, model_type)
    return GatewayModel(model_type, weights, processor, identity, make_item)
