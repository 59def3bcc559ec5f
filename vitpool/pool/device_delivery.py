"""Delivery over the GPU: an encoder actor hands a call's embeddings straight to the GPUs of
tensor-parallel ranks with Ray Direct Transport (NCCL), one encode for every rank.

Ray's constraints (2.60): the encoder actor and the ranks must share a collective group, and
every actor that takes part must be created with `enable_tensor_transport=True` (a receiver
without it hangs for a minute, then both actors die). vitpool creates its encoder actors that way
when the pool is launched with `device_delivery=True`; the ranks are the caller's to create so.
"""

from __future__ import annotations

import ray
import torch

from vitpool.actors import OK, EncoderActor
from vitpool.errors import EncodeError, InvalidItemError
from vitpool.items import ItemMetadata


class DeviceDeliveringEncoderActor(EncoderActor):
    """An encoder actor that can also return a call's outputs as GPU tensors over NCCL."""

    @ray.method(tensor_transport="nccl")
    def encode_on_device(self, metadata: list[ItemMetadata], *pixels) -> list[torch.Tensor]:
        """The call's outputs on this actor's GPU: [tokens, *deepstack], each the items'
        rows concatenated in order (split them by each item's token count)."""
        values, receipt = self.run_batch(metadata, list(pixels), output_device=None)
        if receipt.status != OK:
            raise EncodeError(f"encoder actor {self.actor_index} refused the call ({receipt.status})")
        if receipt.item_errors:
            position, reason = next(iter(receipt.item_errors.items()))
            raise InvalidItemError(position, reason)
        num_deepstack = len(values[0].deepstack)
        return [
            torch.cat([v.tokens for v in values]),
            *[torch.cat([v.deepstack[k] for v in values]) for k in range(num_deepstack)],
        ]
