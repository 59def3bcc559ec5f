"""Starting a pool's actors and finding a running pool: what `EncoderPool.launch`, `connect` and
`scale` do on Ray before a handle exists.

Mistakes the caller's process can see (`preflight`) are refused before Ray is joined or any actor
starts; an actor's own start error is raised as its own type (`start_errors`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import ray

from vitpool.actors.reports import ActorInfo
from vitpool.encoder_spec import check_int
from vitpool.errors import ConfigError, PoolNotFoundError, PoolUnavailableError, VitpoolError, counted
from vitpool.pool.cluster import (
    ON_HEAD_NODE,
    JoinedCluster,
    check_bundles,
    check_capacity,
    cluster_gpus,
    colocated_options,
    default_threads,
    free_resources,
    join_ray,
    joins_a_cluster,
)
from vitpool.pool.controller import MAX_WATCHING_HANDLES, NAMESPACE, WATCH_GROUP, Membership, PoolController
from vitpool.pool.preflight import (
    check_device,
    check_family,
    checked_model_directory,
    family_modules_for_actors,
)
from vitpool.pool.settings import PoolSettings
from vitpool.pool.start_errors import died_at_start, one_line, start_error, start_failure

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 15.0
PROGRESS_FORMAT = "vitpool: %(message)s"  # as the command line shows it
CONTROLLER_CONCURRENCY = 32  # scaling, failure reports, stats; long polls have their own group


@contextlib.contextmanager
def progress_on_stderr(enabled: bool) -> Iterator[None]:
    """vitpool's INFO lines (the cluster joined, actors starting and ready) on stderr for the
    duration, where the caller has not set up logging: a start-up takes tens of seconds, and
    without a handler Python shows nothing below WARNING. Logging the caller configured (a
    handler on "vitpool" or the root logger, or a level set on "vitpool") is left alone, as
    `enabled=False` leaves everything."""
    library = logging.getLogger("vitpool")
    if not enabled or library.handlers or logging.getLogger().handlers or library.level != logging.NOTSET:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(PROGRESS_FORMAT))
    library.addHandler(handler)
    library.setLevel(logging.INFO)
    try:
        yield
    finally:
        library.removeHandler(handler)
        library.setLevel(logging.NOTSET)


def launch_pool(
    settings: PoolSettings,
    num_actors: int | None,
    name: str,
    address: str | None,
    actor_options: dict[str, Any] | None,
    placement_group: Any,
) -> tuple[Any, bool, Membership]:
    """Start the controller and its actors; returns (controller, whether this joined Ray, the
    membership once every actor is ready). Leaves nothing behind when it raises.

    Raises:
        ConfigError, CheckpointError: a mistake seen here before anything starts, or the one an
            actor met as it started (raised as its own type).
        VitpoolError: an actor failed to start for another reason (its one line; the rest is
            the error's cause).
    """
    check_int("num_actors", num_actors, none="one per GPU of the cluster, or one CPU actor")
    if settings.autoscale is not None:
        low, high = settings.autoscale
        if placement_group is not None:
            raise ConfigError(
                "autoscale does not apply to a pool colocated with a placement group (its bundles are fixed)"
            )
        if num_actors is not None and not low <= num_actors <= high:
            raise ConfigError(f"num_actors={num_actors} is outside autoscale={settings.autoscale}")
        num_actors = low if num_actors is None else num_actors
    in_a_cluster = joins_a_cluster(address)
    if settings.detached and not ray.is_initialized() and not in_a_cluster:
        raise ConfigError(
            "a detached pool outlives this process, so it needs a Ray cluster that does: start one with "
            "`ray start --head` (launch and `vitpool serve` then join it), or pass address=..."
        )
    settings = dataclasses.replace(settings, model=checked_model_directory(settings.model, in_a_cluster))
    joined = join_ray(address)
    owns_ray = joined.connected_here
    controller = None
    try:
        placement = None
        if placement_group is not None:
            options, placement = colocated_options(placement_group, actor_options)
            num_actors = len(placement.bundles) if num_actors is None else num_actors
            check_bundles(placement, num_actors)
        else:
            gpus = cluster_gpus()
            options = {"num_gpus": 1 if gpus >= 1 else 0, "num_cpus": 1, **(actor_options or {})}
            if num_actors is None:
                num_actors = max(1, int(gpus)) if options.get("num_gpus") else 1
            check_capacity(options, num_actors)
        check_device(settings.device, options, cluster_gpus())
        check_family(settings.model, family_modules_for_actors(options))
        threads = settings.actor_threads or default_threads(options, num_actors)
        try:
            lifetime = {"lifetime": "detached"} if settings.detached else {}
            controller = (
                ray.remote(concurrency_groups={WATCH_GROUP: MAX_WATCHING_HANDLES})(PoolController)
                .options(
                    name=name,
                    namespace=NAMESPACE,
                    num_cpus=0,
                    max_concurrency=CONTROLLER_CONCURRENCY,
                    **ON_HEAD_NODE,
                    **lifetime,
                )
                .remote(name, settings, options, threads, placement)
            )
            ray.get(controller.version.remote())
        except ValueError as error:  # Ray: the name is taken
            controller = None
            raise ConfigError(
                f"a pool named {name!r} is already running in the {joined} ({error}); connect to it "
                f"with EncoderPool.connect({name!r}) or launch with another name"
            ) from None
        logger.info(
            "launching %spool %r: %s (%s), model %s",
            "detached " if settings.detached else "",
            name,
            counted(num_actors, "encoder actor"),
            options,
            settings.model or "shipped tiny Qwen3-VL",
        )
        started, _ = ray.get(controller.scale.remote(num_actors))
        failures = await_started(controller, started, settings.startup_timeout_s)
        if failures:
            raise start_failure(failures, num_actors, str(joined), _elsewhere(joined, "launch in"))
        if settings.autoscale is not None:
            ray.get(controller.start_autoscaling.remote())
        return controller, owns_ray, ray.get(controller.membership.remote())
    except BaseException as error:
        if controller is not None:
            stop_controller(controller)
        if owns_ray:
            ray.shutdown()
        if isinstance(error, ray.exceptions.RayActorError):
            # The controller died, or never started: Ray's error names neither the cluster nor why
            # this one, and a cluster joined by mistake is a usual reason.
            raise died_at_start(
                "the pool's controller", error, str(joined), _elsewhere(joined, "launch in")
            ) from error
        raise


def find_pool(name: str, address: str | None, timeout_s: float) -> tuple[Any, bool, Membership]:
    """A running pool's controller, whether this joined Ray, and its membership once an actor is
    ready. Raises PoolUnavailableError when there is no such pool or no ready actor in time, or
    no cluster to look in (a private one started here could hold no pool); each message names
    the cluster looked in and why that one."""
    if not ray.is_initialized() and not joins_a_cluster(address):
        raise PoolNotFoundError(
            f"no pool named {name!r}: no Ray cluster runs on this machine to look in (no RAY_ADDRESS, and "
            "`ray start` left no running cluster's address); pass address= (--address) or set RAY_ADDRESS "
            "for a cluster elsewhere"
        )
    joined = join_ray(address)
    owns_ray = joined.connected_here
    try:
        try:
            controller = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            raise PoolNotFoundError(
                f"no pool named {name!r} in the {joined}; {_elsewhere(joined, 'look in')}, or start "
                "one with EncoderPool.launch or `vitpool serve`",
                where=str(joined),
            ) from None
        deadline = time.monotonic() + timeout_s
        membership = ray.get(controller.membership.remote(), timeout=timeout_s)
        while not membership.actors:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolUnavailableError(
                    f"pool {name!r} has no ready encoder actor after {timeout_s:.0f} s"
                )
            changed = ray.get(
                controller.wait_for_change.remote(membership.version, remaining), timeout=timeout_s
            )
            membership = changed or membership
        return controller, owns_ray, membership
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise


def scale_pool(
    controller: Any, num_actors: int, startup_timeout_s: float
) -> tuple[list[int], int, list[tuple[int, BaseException]]]:
    """Start or retire actors so that `num_actors` take work; returns (retired indices, how many
    actors were started, the index and start error of each new actor that failed to start)."""
    check_int("num_actors", num_actors)
    placement = ray.get(controller.placement.remote())
    if placement is not None:
        check_bundles(placement, num_actors)
    else:
        check_capacity(ray.get(controller.actor_options.remote()), num_actors)
    started, retired = ray.get(controller.scale.remote(num_actors))
    return retired, len(started), await_started(controller, started, startup_timeout_s)


def await_started(
    controller: Any, started: list[tuple[int, Any, Any]], timeout_s: float
) -> list[tuple[int, BaseException]]:
    """Wait for new actors to load and capture, logging progress; activate each that is ready.
    Returns the index and start error (`start_errors.start_error`) of each that failed (they
    are dropped from the pool)."""
    pending = {ref: index for index, _, ref in started}
    total, failures = len(started), []
    start = last_report = time.monotonic()
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
        for ref in ready:
            index = pending.pop(ref)
            try:
                info: ActorInfo = ray.get(ref)
            except ray.exceptions.RayError as error:
                failure = start_error(error)
                logger.error("encoder actor %d failed to start: %s", index, one_line(failure))
                failures.append((index, failure))
                ray.get(controller.forget.remote(index))
                continue
            ray.get(controller.activate.remote(index, info))
            logger.info(
                "encoder actor %d ready on %s in %.1f s (%s, %d disabled) [%d/%d]",
                index,
                info.device,
                info.startup_seconds,
                counted(len(info.budgets), "budget"),
                len(info.disabled_budgets),
                total - len(pending),
                total,
            )
        now = time.monotonic()
        if pending and now - last_report >= PROGRESS_EVERY_S:
            last_report = now
            logger.info(
                "waiting for %d of %s to be placed, load and capture (%.0f s; free in the cluster now: %s)",
                len(pending),
                counted(total, "encoder actor"),
                now - start,
                free_resources(),
            )
        if pending and now - start > timeout_s:
            for index in pending.values():
                failures.append(
                    (
                        index,
                        VitpoolError(
                            f"encoder actor {index} was not ready after {timeout_s:.0f} s "
                            f"(startup_timeout_s); free in the cluster now: {free_resources()}"
                        ),
                    )
                )
                ray.get(controller.forget.remote(index))
            break
    return failures


def stop_controller(controller: Any) -> None:
    try:
        ray.get(controller.shutdown.remote(), timeout=60)
    except ray.exceptions.RayError:
        pass
    ray.kill(controller, no_restart=True)


def _elsewhere(joined: JoinedCluster, verb: str) -> str:
    """Where a pool was looked for (or launched), and how to choose another cluster."""
    if joined.connected_here:
        return f"pass address= (--address) or set RAY_ADDRESS to {verb} another"
    return f"this process was already connected to it: call ray.shutdown() first to {verb} another"
