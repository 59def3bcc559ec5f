"""One encode delivered to every tensor-parallel rank of an LLM deployment.

`EncoderPool.deliver_to(ranks)` picks an encoder actor and a transport; `delivery.encode(items)`
returns one Ray reference and a small `DeliveryLayout`. The caller passes both, as top-level
arguments, to a method of every rank; there `received_embeddings(outputs, layout)` gives the
call's Embeddings. Rank code is the same whatever the transport:

- "object_store": the actor puts the call's outputs in Ray's object store once, as NumPy arrays;
  every rank on the node maps the same bytes (no copy per rank; read-only, so clone to write).
  Needs nothing of the ranks. Ranks on GPUs copy to their device themselves.
- "nccl" (GPU actors) or "gloo" (CPU actors), Ray Direct Transport: the outputs stay on the
  encoder actor's device and Ray sends them to each rank's device when the rank's method is
  about to run: no host round trip. The pool must be launched with `rank_transport` set (its
  actors then take part in RDT), and the ranks must:
    - be created with `enable_tensor_transport=True` and `max_concurrency` of 2 or more: Ray 2.60
      queues the receive behind the rank's own task when the reference is passed on before the
      encode is done, and a single-threaded rank then waits for ever (Ray kills both actors after
      RAY_rdt_fetch_fail_timeout_milliseconds, 60 s by default);
    - for NCCL, sit on GPUs other than the encoder actor's (NCCL refuses two members of one group
      on one GPU; so a pool colocated on the ranks' own GPUs delivers through the object store),
      and have cupy installed, which Ray's NCCL collectives need.

`transport="auto"` takes the pool's `rank_transport` when that works here and falls back to the
object store (with a warning saying why) when it does not. A delivery bypasses the dispatcher:
the call is one batch on the chosen actor, without packing across callers or retries.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from vitpool.errors import ConfigError, InvalidItemError
from vitpool.items import Embedding, Item
from vitpool.pool.item_checks import checked_items
from vitpool.specs import ItemRules
from vitpool.transport.wire import from_array, to_array

logger = logging.getLogger(__name__)

RDT_TRANSPORTS = ("nccl", "gloo")
_COLLECTIVE_BACKENDS = {"nccl": "nccl", "gloo": "torch_gloo"}
_ACTOR_METHODS = {
    "object_store": "encode_concatenated_arrays",
    "nccl": "encode_concatenated_nccl",
    "gloo": "encode_concatenated_gloo",
}


@dataclass(frozen=True)
class DeliveryLayout:
    """How to read a delivered call: its transport, output dtype and each item's token count."""

    transport: str
    dtype_name: str
    tokens_per_item: tuple[int, ...]


def received_embeddings(outputs: Sequence[Any], layout: DeliveryLayout) -> list[Embedding]:
    """In a rank's method: the Embeddings of a delivered call, in the call's order. `outputs` is
    what Ray resolved the delivery's reference to. Object-store outputs stay read-only views of
    the node's shared memory (no copy); clone one to write into it."""
    tensors = [
        tensor
        if isinstance(tensor, torch.Tensor)
        else from_array(tensor, layout.dtype_name, copy_read_only=False)
        for tensor in outputs
    ]
    if not tensors or tensors[0].shape[0] != sum(layout.tokens_per_item):
        raise ValueError(
            f"a delivery of {sum(layout.tokens_per_item)} tokens got outputs of shape "
            f"{[tuple(t.shape) for t in tensors]}: pass the reference and layout of the same encode"
        )
    embeddings, start = [], 0
    for num_tokens in layout.tokens_per_item:
        end = start + num_tokens
        embeddings.append(Embedding.from_outputs([t[start:end] for t in tensors]))
        start = end
    return embeddings


class RankDelivery:
    """Encodes calls on one encoder actor for a set of ranks; made by `EncoderPool.deliver_to`.

    Attributes:
        transport: "object_store", "nccl" or "gloo": the transport in use.
        actor_index: the encoder actor that encodes every call of this delivery.
    """

    def __init__(
        self,
        actor: Any,
        actor_index: int,
        transport: str,
        rules: ItemRules,
        dtype_name: str,
        max_item_tokens: int | None = None,
    ) -> None:
        self._actor = actor
        self.actor_index = actor_index
        self.transport = transport
        self._rules = rules
        self._dtype_name = dtype_name
        self._max_item_tokens = max_item_tokens

    def encode(self, items: Sequence[Item]) -> tuple[ray.ObjectRef, DeliveryLayout]:
        """Start encoding `items`; returns the reference and layout to pass to every rank.

        Raises:
            InvalidItemError: an item is malformed or over the pool's `max_item_tokens` (the
                message names its index); nothing is sent.
        """
        if not items:
            raise ValueError("a delivery needs at least one item")
        prepared = []
        for index, item in enumerate(checked_items(items, self._rules, self._max_item_tokens)):
            if len(item.parts) != 1:
                raise InvalidItemError(
                    index,
                    f"rank delivery takes items of one input; this one has {len(item.parts)} "
                    "(a global view and crops): encode it with pool.encode or encode_refs",
                )
            prepared.append(item.parts[0])
        method = getattr(self._actor, _ACTOR_METHODS[self.transport])
        reference = method.remote([p.spec for p in prepared], *[to_array(p.pixels) for p in prepared])
        return reference, DeliveryLayout(
            self.transport, self._dtype_name, tuple(p.spec.num_tokens for p in prepared)
        )


def _node_and_gpus(actor: Any) -> tuple[str, list[str]]:
    """Run inside an actor (`__ray_call__`): its node and the node's ids of its GPUs."""
    context = ray.get_runtime_context()
    return context.get_node_id(), [str(gpu) for gpu in context.get_accelerator_ids().get("GPU", [])]


def choose_transport(
    requested: str, launched_with: str | None, actor: Any, ranks: Sequence[Any], pool_name: str
) -> str:
    """The transport a delivery uses: `requested`, or for "auto" the pool's `rank_transport`
    (`launched_with`) where it works, else the object store, with a warning saying why. An RDT
    transport asked for by name that cannot work raises ConfigError saying why."""
    chosen = launched_with if requested == "auto" else requested
    if chosen not in RDT_TRANSPORTS:
        return "object_store"
    problem = rdt_problem(chosen, actor, ranks, launched_with)
    if problem is None:
        return chosen
    if requested != "auto":
        raise ConfigError(f"delivery over {chosen} cannot work: {problem}")
    logger.warning("pool %r: delivering through the object store, not %s: %s", pool_name, chosen, problem)
    return "object_store"


def rdt_problem(transport: str, actor: Any, ranks: Sequence[Any], launched_with: str | None) -> str | None:
    """Why a delivery over `transport` from `actor` to `ranks` cannot work, or None; when it can,
    the encoder actor and the ranks are joined in a collective group.

    Whether the ranks were created with enable_tensor_transport cannot be seen from their handles
    (Ray 2.60); a rank without it hangs on its first delivery until Ray's timeout kills it.
    """
    if launched_with != transport:
        return (
            f"the pool was launched with rank_transport={launched_with!r}; launch it with "
            f"rank_transport={transport!r}"
        )
    problem = ray.get(actor.rdt_unavailable.remote(transport))
    if problem is not None:
        return problem
    if transport == "nccl":
        encoder_at, *ranks_at = ray.get(
            [member.__ray_call__.remote(_node_and_gpus) for member in (actor, *ranks)]
        )
        for number, rank_at in enumerate(ranks_at):
            shared = set(encoder_at[1]) & set(rank_at[1]) if rank_at[0] == encoder_at[0] else set()
            if shared:
                return (
                    f"rank {number} shares GPU {sorted(shared)} with the encoder actor, and NCCL cannot put "
                    "two members of one group on one GPU: deliver from an encoder actor on a GPU of its own"
                )
    from ray.experimental.collective import create_collective_group, get_collective_groups

    if get_collective_groups([actor, *ranks]):  # joined before, by this process
        return None
    if get_collective_groups([actor]):
        return (
            "this encoder actor already delivers to other ranks, and Ray lets an actor join one collective "
            "group per backend: pick another actor_index"
        )
    try:
        create_collective_group([actor, *ranks], backend=_COLLECTIVE_BACKENDS[transport])
    except Exception as error:  # noqa: BLE001 - Ray raises several kinds; the caller falls back or reports
        return f"the collective group could not be created: {type(error).__name__}: {error}"
    return None
