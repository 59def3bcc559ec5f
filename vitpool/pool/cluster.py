"""Joining a Ray cluster, or starting a local one that the pool then owns."""

from __future__ import annotations

import logging
import os

import ray

logger = logging.getLogger(__name__)


def join_ray(address: str | None) -> bool:
    """Connect this process to Ray. Returns True if this call did it (the pool disconnects, or
    stops the local cluster it started, on shutdown); False if Ray was already initialised.

    `address` (or RAY_ADDRESS) names an existing cluster. Without one a local cluster starts with
    address="local", never "auto": a stale /tmp/ray address file makes "auto" hang.
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address)
    else:
        logger.info("starting a local Ray cluster for the pool")
        ray.init(address="local")
    return True


def cluster_gpus() -> float:
    return float(ray.cluster_resources().get("GPU", 0.0))


def cluster_cpus() -> float:
    return float(ray.cluster_resources().get("CPU", 1.0))
