"""Where the pool's actors go: joining a Ray cluster (or starting a local one that the pool then
owns), what the cluster or a placement group can hold, and the actors' options to fit it."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import ray

from vitpool.errors import ConfigError, counted
from vitpool.pool.ray_auth import match_authentication

logger = logging.getLogger(__name__)

MAX_GPU_ACTOR_THREADS = 4


@dataclass(frozen=True)
class Placement:
    """A colocated pool's placement group and the bundles its actors may take, one actor each."""

    placement_group: Any  # ray.util.placement_group.PlacementGroup
    bundles: tuple[int, ...]


@dataclass(frozen=True)
class JoinedCluster:
    """The Ray cluster this process joined, and why that one: several clusters can run on one
    machine, and without an address Ray follows whichever `ray start` wrote its address file last."""

    address: str  # the cluster's GCS address, host:port
    reason: str  # how it was chosen, e.g. "from RAY_ADDRESS"
    connected_here: bool  # this call connected (its pool disconnects on shutdown); False: already connected

    def __str__(self) -> str:
        return f"Ray cluster at {self.address} ({self.reason})"


FROM_ADDRESS_ARGUMENT = "from the address argument"
FROM_RAY_ADDRESS = "from RAY_ADDRESS"

# What this process joined last: the CLI prints it, and an error that no pool was found names it.
# Ray's connection is one per process, so this record is too.
_last_joined: JoinedCluster | None = None
_ray_init_options: dict[str, Any] = {}  # the command line's quiet Ray (`quiet_ray_logs`)
_warned_stale: set[str] = set()  # stale address files already reported by this process


def quiet_ray_logs() -> None:
    """Ray's own INFO and WARNING lines off for this process (a command line's terminal): its
    Python logger, from `ray.init` on. vitpool's messages and every error still show. (Its C++
    core's level is left alone: RAY_BACKEND_LOG_LEVEL set prints a line of its own saying so.)"""
    _ray_init_options["logging_level"] = logging.ERROR
    logging.getLogger("ray").setLevel(logging.ERROR)


def last_joined() -> JoinedCluster | None:
    """The Ray cluster `join_ray` (so `EncoderPool.launch` / `connect`) last joined in this
    process, and why that one; None before any."""
    return _last_joined


def join_ray(address: str | None) -> JoinedCluster:
    """Connect this process to Ray, to the cluster `ray.init()` would join: `address`, else
    RAY_ADDRESS, else the cluster last started on this machine with `ray start` while it still
    runs, else a new local cluster. Returns which cluster and why (logged at INFO; `last_joined()`
    keeps it); its `connected_here` is True if this call connected (the pool disconnects, or stops
    the local cluster it started, on shutdown), False if Ray was already initialised.

    Unlike `ray.init()`, an address file left by a cluster that no longer runs is not followed
    (Ray would wait on it, then fail): a local cluster starts instead, with a warning. And this
    process is put in the cluster's authentication mode first (`match_authentication`): a
    cluster that wants a token this process does not send is found out at once, not after
    Ray's ~20 s of retries, and an open cluster is not joined in token mode.

    Raises:
        ConnectionError: the cluster could not be joined (one line naming it and why it was chosen).
    """
    global _last_joined
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if _last_joined is not None and _last_joined.address == current:
            return dataclasses.replace(_last_joined, connected_here=False)
        return JoinedCluster(current, "this process was already connected to it", connected_here=False)
    reason = FROM_ADDRESS_ARGUMENT if address else FROM_RAY_ADDRESS
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address not in ("local", "auto"):
        if "://" not in address:  # ray:// is Ray Client, with its own server in front
            reason += match_authentication(address)
        _init_or_explain(address, address, reason)
    elif address == "auto":
        reason = f"address 'auto': from {_address_file()}, the cluster last started on this machine"
        if local := running_local_cluster():
            reason += match_authentication(local)
        _init_or_explain(address, local or address, reason)
    elif address is None and (local := running_local_cluster()):
        reason = f"from {_address_file()}, the cluster last started on this machine"
        reason += match_authentication(local)
        _init_or_explain(
            None, local, reason
        )  # Ray's own lookup (and its local token), now known not to be stale
    else:
        if address == "local":
            reason = "a new local cluster for this process (address='local')"
        else:
            reason = "a new local cluster for this process: none runs here (`ray start --head` starts one)"
        logger.info("starting %s", reason)  # a few seconds
        ray.init(address="local", **_ray_init_options)
    _last_joined = JoinedCluster(ray.get_runtime_context().gcs_address, reason, connected_here=True)
    logger.info("%s", _last_joined)
    return _last_joined


def joins_a_cluster(address: str | None) -> bool:
    """Whether a pool launched (or looked for) with `address` runs in a cluster that outlives this
    process, which may have other nodes: what `join_ray` would join, or, where this process is
    connected already, a cluster of more than this node. "local" (as the argument or RAY_ADDRESS)
    asks for a private cluster."""
    if ray.is_initialized():
        return sum(1 for node in ray.nodes() if node.get("Alive")) > 1
    target = address or os.environ.get("RAY_ADDRESS") or None
    if target is not None:
        return target != "local"
    return running_local_cluster() is not None


def _init_or_explain(init_address: str | None, cluster_address: str, reason: str) -> None:
    """`ray.init(address=init_address)`, whose failure to connect names the cluster and why it
    was the one chosen."""
    try:
        ray.init(address=init_address, **_ray_init_options)
    except ConnectionError as error:
        lines = str(error).strip().splitlines()
        raise ConnectionError(
            f"could not join the Ray cluster at {cluster_address} ({reason}): "
            f"{lines[0] if lines else type(error).__name__}"
        ) from error


def _address_file_owner() -> int | None:
    """The uid that owns the address file `ray start` wrote; None where it cannot be read."""
    try:
        return os.stat(_address_file()).st_uid
    except OSError:
        return None


def _address_file() -> str:
    """The file where `ray start` writes its cluster's address (/tmp/ray/ray_current_cluster)."""
    try:
        from ray._common.utils import get_ray_address_file

        return get_ray_address_file(None)
    except Exception:  # noqa: BLE001 - Ray's private helper moved: name the usual place
        return "/tmp/ray/ray_current_cluster"


def running_local_cluster() -> str | None:
    """The address of the cluster last started on this machine with `ray start`, if its GCS
    still runs; None if there is none (Ray's own lookup, minus its stale-file hang)."""
    try:
        from ray._private import services, utils

        address = utils.read_ray_address()
        if not address:
            return None
        running = services.find_gcs_addresses()
    except Exception as error:  # noqa: BLE001 - Ray's private helpers moved: behave as without a cluster
        logger.debug("could not look for a running local Ray cluster: %s", error)
        return None
    port = address.rsplit(":", 1)[-1]
    if any(str(candidate).rsplit(":", 1)[-1] == port for candidate in running):
        owner = _address_file_owner()
        if owner is not None and owner != os.getuid():
            # /tmp/ray is every user's: another user's cluster is not this one's to join by default
            logger.warning(
                "Ray's address file (%s) names %s, a cluster another user (uid %d) started: it is ignored; "
                "pass address= (--address) or set RAY_ADDRESS to join it",
                _address_file(),
                address,
                owner,
            )
            return None
        return address
    if address not in _warned_stale:  # a launch looks twice (whether to join, then joining)
        _warned_stale.add(address)
        logger.warning("Ray's address file names %s, but no Ray cluster runs there: it is ignored", address)
    return None


def clusters_on_this_machine() -> list[str]:
    """The GCS addresses of the Ray clusters running on this machine (any user's), sorted; empty
    where Ray's helper cannot tell."""
    try:
        from ray._private import services

        return sorted(str(address) for address in services.find_gcs_addresses())
    except Exception as error:  # noqa: BLE001 - Ray's private helper moved: none known
        logger.debug("could not list the Ray clusters on this machine: %s", error)
        return []


# Ray's resource of the head node: a tiny share of it places an actor there. The pool's controller
# and cache go there (as Ray Serve's controller does): the encoder actors are the controller's, so
# a controller on a worker node would take the whole pool down with that node.
ON_HEAD_NODE = {"resources": {"node:__internal_head__": 0.001}}


def cluster_gpus() -> float:
    return float(ray.cluster_resources().get("GPU", 0.0))


def cluster_cpus() -> float:
    return float(ray.cluster_resources().get("CPU", 1.0))


def check_capacity(options: dict[str, Any], num_actors: int) -> None:
    """Refuse at once what the cluster could never place (Ray would wait for it forever)."""
    total = ray.cluster_resources()
    for resource, key in (("GPU", "num_gpus"), ("CPU", "num_cpus")):
        needed = float(options.get(key) or 0) * num_actors
        available = total.get(resource, 0.0)
        if needed <= available + 1e-9:
            continue
        if resource == "GPU" and available <= 0:
            raise ConfigError(
                f"the Ray cluster has no GPU, and each encoder actor asks for num_gpus={options.get(key)}: "
                "to run on CPUs, leave num_gpus out of actor_options (or set it to 0) and launch with "
                "device='cpu'; or join a cluster with GPUs (address=...)"
            )
        actors = counted(num_actors, "encoder actor")
        raise ConfigError(
            f"{actors} with {key}={options.get(key)} {'needs' if num_actors == 1 else 'need'} "
            f"{needed:g} {resource}{'' if needed == 1 else 's'}; the cluster has {available:g}. Use fewer "
            f"actors or a fractional share (actor_options={{'{key}': ...}})"
        )


def colocated_options(placement_group: Any, actor_options: dict[str, Any] | None) -> tuple[dict, Placement]:
    """Actor options and the usable bundles of a placement group to colocate with."""
    specs = placement_group.bundle_specs
    gpu_bundles = tuple(i for i, spec in enumerate(specs) if spec.get("GPU", 0) > 0)
    options = {"num_cpus": 0, **(actor_options or {})}
    if gpu_bundles and "num_gpus" not in options:
        raise ConfigError(
            "a colocated pool needs its share of each bundle's GPU: pass actor_options={'num_gpus': 0.25} "
            "(the LLM's workers in the same bundles must leave that much free)"
        )
    options.setdefault("num_gpus", 0)
    bundles = gpu_bundles or tuple(range(len(specs)))
    for bundle in bundles:
        for resource, key in (("GPU", "num_gpus"), ("CPU", "num_cpus")):
            if float(options[key] or 0) > specs[bundle].get(resource, 0) + 1e-9:
                raise ConfigError(
                    f"bundle {bundle} of the placement group has {specs[bundle].get(resource, 0):g} "
                    f"{resource}; an encoder actor asks {key}={options[key]}"
                )
    return options, Placement(placement_group, bundles)


def check_bundles(placement: Placement, num_actors: int) -> None:
    if num_actors > len(placement.bundles):
        raise ConfigError(
            f"{counted(num_actors, 'encoder actor')}, but the placement group has "
            f"{counted(len(placement.bundles), 'bundle')} to hold them (one actor per bundle)"
        )


def free_resources() -> str:
    free = ray.available_resources()
    return ", ".join(f"{free.get(r, 0.0):g} {r}" for r in ("GPU", "CPU"))


def default_threads(options: dict[str, Any], num_actors: int) -> int:
    share = max(1, int(cluster_cpus() // max(1, num_actors)))
    return min(share, MAX_GPU_ACTOR_THREADS) if options.get("num_gpus") else share
