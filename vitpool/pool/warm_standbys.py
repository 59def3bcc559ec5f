"""The pool's warm standbys (`vitpool.actors.standby`): one process per node that runs the pool's
encoder actors, ready to take the place of an actor there that dies.

A standby holds none of Ray's resources. With the pool's `standby_graphs` it builds the encoder
ahead on the GPU of the node's actor that made it start (`ensure`), beside that actor, outside
Ray's accounting; its memory is the cost (`StandbyState`). The GPU a replacement takes is held in
Ray's accounting by a small actor with the encoder actor's resources, placed on the same node
(`hold_gpu`): Ray gives that actor the GPU the dead actor freed. A standby without an encoder runs
on exactly the GPU ids Ray gave the hold; what happens where one built ahead serves from another
GPU: `vitpool.pool.replacement`. The hold starts a bare Ray worker (its class travels by value, so
it imports neither torch nor vitpool) and lives as long as the actor it holds for.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger(__name__)

HOLD_TIMEOUT_S = 10.0  # a GPU not free on the node by then: the pool starts a fresh actor instead
# What an actor asks Ray for, which the hold asks for in the standby's place; the standby takes
# the other options (runtime_env, ...), so that it runs where and as an encoder actor would.
_RESOURCE_OPTIONS = ("num_cpus", "num_gpus", "resources", "memory", "accelerator_type")
_PLACEMENT_OPTIONS = (
    "scheduling_strategy",
    "placement_group",
    "placement_group_bundle_index",
    "name",
    "namespace",
)


@dataclass(frozen=True)
class Standby:
    """A node's standby as the pool keeps it: its handle, and the GPUs it builds its encoder on
    (None: it builds at take-over, on the GPU it is given)."""

    handle: Any  # ray.actor.ActorHandle
    gpu_ids: list[str] | None = None

    @property
    def builds_ahead(self) -> bool:
        return self.gpu_ids is not None


class Standbys:
    """The standby of each node, started on demand (`ensure`) and handed out once (`take`)."""

    def __init__(
        self,
        pool_name: str,
        namespace: str,
        model: str | None,
        actor_options: dict,
        delivering: bool,
        max_concurrency: int,
    ) -> None:
        self._pool_name = pool_name
        self._namespace = namespace
        self._model = model
        self._options = {
            key: value
            for key, value in actor_options.items()
            if key not in _RESOURCE_OPTIONS + _PLACEMENT_OPTIONS
        }
        self._delivering = delivering
        self._max_concurrency = max_concurrency
        self._by_node: dict[str, Standby] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._closed = False

    def ensure(self, node_id: str | None, ahead: tuple[Any, list[str]] | None = None) -> None:
        """Start a standby on `node_id` unless it has one; with `ahead`, (an actor's `ActorSpec`,
        the node's GPU ids of an actor there), it builds that encoder on those GPUs at once."""
        if node_id is None:
            return
        with self._lock:
            if self._closed or node_id in self._by_node:
                return
            # Imported here: the controller loads the actor classes' modules only when it needs them.
            if self._delivering:
                from vitpool.actors.delivering_actor import StandbyDeliveringEncoderActor as standby_class
            else:
                from vitpool.actors.standby import StandbyEncoderActor as standby_class
            options = {  # as the encoder actor's (the user's options win), but no resources, on this node
                "max_concurrency": self._max_concurrency,
                **self._options,
                "num_cpus": 0,
                "num_gpus": 0,
                "name": f"{self._pool_name}-standby-{next(self._numbers)}",
                "namespace": self._namespace,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
            }
            spec, gpu_ids = ahead if ahead is not None else (None, None)
            handle = ray.remote(standby_class).options(**options).remote(self._model, spec, gpu_ids or ())
            self._by_node[node_id] = Standby(handle, None if ahead is None else list(gpu_ids))
        logger.info(
            "starting a warm standby on node %s%s",
            node_id[:12],
            ""
            if ahead is None
            else f", its encoder built ahead beside the actor on GPU {','.join(gpu_ids) or '-'}",
        )

    def take(self, node_id: str | None) -> Standby | None:
        """The standby of `node_id` (now the caller's), or None."""
        with self._lock:
            return None if node_id is None else self._by_node.pop(node_id, None)

    def take_any(self) -> tuple[str, Standby] | None:
        """Some node's standby (node id, standby; now the caller's), or None."""
        with self._lock:
            return self._by_node.popitem() if self._by_node else None

    def give_back(self, node_id: str, standby: Standby) -> None:
        """A standby taken and not used stays its node's (or stops, if the node has one again)."""
        with self._lock:
            if not self._closed and node_id not in self._by_node:
                self._by_node[node_id] = standby
                return
        ray.kill(standby.handle, no_restart=True)

    def keep_only(self, node_ids: set[str]) -> None:
        """Stop the standbys of nodes outside `node_ids` (no actor of the pool runs there now)."""
        with self._lock:
            gone = [self._by_node.pop(node) for node in list(self._by_node) if node not in node_ids]
        for standby in gone:
            ray.kill(standby.handle, no_restart=True)

    def handles(self) -> dict[str, Any]:
        """Node id -> its standby's handle."""
        with self._lock:
            return {node: standby.handle for node, standby in self._by_node.items()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            standbys, self._by_node = list(self._by_node.values()), {}
        for standby in standbys:
            ray.kill(standby.handle, no_restart=True)


def hold_gpu(node_id: str, actor_options: dict, timeout_s: float = HOLD_TIMEOUT_S) -> tuple[Any, list[str]]:
    """An actor on `node_id` that holds an encoder actor's resources, and the GPU ids Ray gave it.

    Raises:
        TimeoutError: the resources did not come free on the node within `timeout_s` (the hold
            is stopped).
        ray.exceptions.RayError: the hold could not start (its node is gone, ...).
    """
    resources = {key: actor_options[key] for key in _RESOURCE_OPTIONS if key in actor_options}
    hold = (
        _gpu_hold_class()
        .options(
            **resources,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote()
    )
    try:
        gpu_ids = ray.get(hold.gpu_ids.remote(), timeout=timeout_s)
    except BaseException:
        ray.kill(hold, no_restart=True)
        raise
    return hold, gpu_ids


@functools.cache
def _gpu_hold_class() -> Any:
    # Defined in a function so that Ray sends the class by value: its worker then imports only
    # Ray, not this package (whose import brings torch, seconds of a replacement's start).
    class GpuHold:
        """Holds an encoder actor's resources for the standby that took over its GPU."""

        def gpu_ids(self) -> list[str]:
            import ray

            return [str(gpu) for gpu in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]

    return ray.remote(GpuHold)
