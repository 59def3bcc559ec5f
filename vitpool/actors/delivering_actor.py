"""An encoder actor that can also hand a call's outputs to other actors (the tensor-parallel
ranks of an LLM deployment) over Ray Direct Transport; `vitpool.pool.rank_delivery` drives it.

Ray creates the actors of a class with such methods with `enable_tensor_transport`, so the pool
uses this class only when it was launched with a `rank_transport`. This module imports Ray.
"""

from __future__ import annotations

import numpy as np
import ray
import torch

from vitpool.actors.encoder_actor import EncoderActor
from vitpool.actors.standby import StandbyMixin
from vitpool.specs import ItemSpec


class DeliveringEncoderActor(EncoderActor):
    """An `EncoderActor` whose call outputs can stay on its device and go to ranks over RDT.
    Each method takes a call's item specs (checked by the caller's item rules) and pixels, and
    returns its outputs in `OutputLayout` order, each the items' rows in order."""

    @ray.method(tensor_transport="nccl")
    def encode_concatenated_nccl(self, specs: list[ItemSpec], *pixels: np.ndarray) -> list[torch.Tensor]:
        return self.concatenated_outputs(specs, pixels, output_device=None)

    @ray.method(tensor_transport="gloo")
    def encode_concatenated_gloo(self, specs: list[ItemSpec], *pixels: np.ndarray) -> list[torch.Tensor]:
        return self.concatenated_outputs(specs, pixels, output_device=None)

    def rdt_unavailable(self, transport: str) -> str | None:
        """Why RDT over `transport` cannot work from this actor, or None if it can."""
        from ray.util.collective import collective

        on_gpu = self.encoder.device.type == "cuda"
        if transport == "nccl" and not on_gpu:
            return "NCCL moves GPU tensors, and this encoder actor runs on its CPU"
        if transport == "nccl" and not collective.nccl_available():
            return "Ray's NCCL collectives need cupy in the actors' environment, and it is not installed"
        if transport == "gloo" and on_gpu:
            return "gloo moves CPU tensors, and this encoder actor runs on a GPU (use nccl)"
        if transport == "gloo" and not collective.gloo_available():
            return "Ray's gloo collectives (torch.distributed) are not available in the actors' environment"
        return None


class StandbyDeliveringEncoderActor(StandbyMixin, DeliveringEncoderActor):
    """A standby (`vitpool.actors.standby`) that becomes a `DeliveringEncoderActor`."""
