"""Warm standbys (`vitpool.actors.standby`, `vitpool.pool.warm_standbys`) on a local Ray cluster with two
fake GPUs, CPU actors: a killed actor's place is taken by its node's standby process, which loses
no call and answers as the encoder in this process does; a standby that cannot take over gives
way to a fresh actor; scaling away from a node stops its standby; shutdown leaves none."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from conftest import BUDGETS, assert_same, mixed_items, wait_for
from test_faults import actor_pids, checked_stream, process_alive

from vitpool import EncoderPool

pytestmark = pytest.mark.ray


def launch(name: str, **settings) -> EncoderPool:
    return EncoderPool.launch(
        budgets=BUDGETS,
        name=name,
        device="cpu",
        startup_timeout_s=120,
        warm_standby=True,
        max_actor_restarts=2,
        metrics_interval_s=None,
        **settings,
    )


def new_actor_items(pool: EncoderPool, pid: int) -> int:
    """Items the actor in process `pid` (a standby that took over) has encoded; 0 until it is one."""
    index = next((index for index, process in actor_pids(pool).items() if process == pid), None)
    return 0 if index is None else next((a.items for a in pool.stats().actors if a.actor_index == index), 0)


def ready_standby(pool: EncoderPool) -> tuple[str, int]:
    """The node's standby, once it has imported the engine: (node id, its process id)."""
    wait_for(lambda: ray.get(pool._controller.standbys.remote()), 60, "a standby to start", pool)
    ((node, handle),) = ray.get(pool._controller.standbys.remote()).items()
    ray.get(handle.standby_ready.remote(), timeout=120)
    return node, ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))


@pytest.mark.parametrize("standby_graphs", [True, False], ids=["built-ahead", "built-at-take-over"])
def test_a_killed_actor_is_replaced_by_its_nodes_standby_and_nothing_is_lost(
    ray_cluster, reference_encoder, standby_graphs
):
    pool = launch(
        f"vitpool-standby-{standby_graphs}",
        num_actors=2,
        actor_options={"num_gpus": 0.5},
        standby_graphs=standby_graphs,
    )
    try:
        node, standby_pid = ready_standby(pool)
        state = ray.get(ray.get(pool._controller.standbys.remote())[node].standby_state.remote())
        assert state.built_ahead == standby_graphs and state.device == ("cpu" if standby_graphs else ""), (
            state
        )
        victim, pid = min(actor_pids(pool).items())
        with checked_stream(pool, reference_encoder) as stream:
            wait_for(lambda: stream.completed >= 10, 120, "the stream to run", pool)
            os.kill(pid, signal.SIGKILL)
            completed_at_kill = stream.completed
            wait_for(
                lambda: pool.num_actors == 2 and victim not in actor_pids(pool), 120, "the take-over", pool
            )
            wait_for(
                lambda: stream.completed >= completed_at_kill + 40 or stream.failures,
                120,
                "calls after",
                pool,
            )
            # the new actor counts in the pool as soon as it is ready, and reaches this process's
            # dispatcher a moment later (on a loaded machine, after 40 calls): it must take work then
            wait_for(
                lambda: new_actor_items(pool, standby_pid) > 0 or stream.failures,
                120,
                "the new actor to take work",
                pool,
            )
        stats = pool.stats()
        assert stream.failures == [] and stats.failed_calls == 0, stats.summary()
        assert stats.actor_restarts == 1 and stats.standby_takeovers == 1, stats.summary()
        # the standby's own process became the new actor, and it took work
        assert standby_pid in actor_pids(pool).values()
        (new_index,) = (index for index, process in actor_pids(pool).items() if process == standby_pid)
        assert next(a for a in stats.actors if a.actor_index == new_index).items > 0, stats.summary()
        # and the node has a fresh standby for the next failure
        _, next_standby_pid = ready_standby(pool)
        assert next_standby_pid not in (standby_pid, pid)
    finally:
        pool.shutdown()
    wait_for(
        lambda: not process_alive(standby_pid) and not process_alive(next_standby_pid),
        30,
        "processes to stop",
    )


def test_a_standby_that_cannot_take_over_gives_way_to_a_fresh_actor(ray_cluster, reference_encoder):
    pool = launch("vitpool-standby-gone", num_actors=2, actor_options={"num_gpus": 0.5})
    try:
        _, standby_pid = ready_standby(pool)
        os.kill(standby_pid, signal.SIGKILL)  # the standby dies first, unnoticed
        victim, pid = min(actor_pids(pool).items())
        with checked_stream(pool, reference_encoder) as stream:
            wait_for(lambda: stream.completed >= 5, 120, "the stream to run", pool)
            os.kill(pid, signal.SIGKILL)
            wait_for(
                lambda: pool.num_actors == 2 and victim not in actor_pids(pool), 120, "the fresh actor", pool
            )
            completed = stream.completed
            wait_for(lambda: stream.completed >= completed + 20 or stream.failures, 120, "calls after", pool)
        stats = pool.stats()
        assert stream.failures == [] and stats.failed_calls == 0, stats.summary()
        assert stats.actor_restarts == 1 and stats.standby_takeovers == 0, stats.summary()
        assert standby_pid not in actor_pids(pool).values()
        items = mixed_items(5)
        assert_same(pool.encode(items), reference_encoder.encode(items))
    finally:
        pool.shutdown()


def test_standbys_are_off_by_default_on_cpu_actors(ray_cluster):
    pool = EncoderPool.launch(
        budgets=BUDGETS,
        name="vitpool-no-standby",
        device="cpu",
        num_actors=1,
        startup_timeout_s=120,
        metrics_interval_s=None,
    )
    try:
        assert ray.get(pool._controller.standbys.remote()) == {}
    finally:
        pool.shutdown()


def test_the_autoscaler_turns_a_ready_standby_into_a_new_actor(ray_cluster, reference_encoder):
    pool = launch("vitpool-standby-up", num_actors=1, actor_options={"num_gpus": 0.5})
    try:
        _, standby_pid = ready_standby(pool)
        ray.get(pool._controller.scale_to.remote(2))  # what the autoscaler calls
        wait_for(lambda: pool.num_actors == 2, 120, "the second actor", pool)
        stats = pool.stats()
        assert stats.standby_takeovers == 1 and stats.actor_restarts == 0, stats.summary()
        assert standby_pid in actor_pids(pool).values()
        for seed in range(4):
            items = mixed_items(30 + seed)
            assert_same(pool.encode(items), reference_encoder.encode(items))
    finally:
        pool.shutdown()


def test_an_actor_dead_before_the_callers_first_call_is_replaced_by_the_standby(
    ray_cluster, reference_encoder
):
    pool = launch("vitpool-standby-first", num_actors=2, actor_options={"num_gpus": 0.5})
    try:
        _, standby_pid = ready_standby(pool)
        victim, pid = min(actor_pids(pool).items())
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not process_alive(pid), 30, "the actor to die")
        deadline = time.monotonic() + 120
        calls = [mixed_items(60 + n)[:3] for n in range(4)]
        # the controller's view (this handle's count may still include the dead actor)
        while not (len(pids := actor_pids(pool)) == 2 and victim not in pids):
            assert time.monotonic() < deadline, pool.stats().summary()
            for items in calls:  # the first of these finds the dead actor
                assert_same(pool.encode(items, timeout_s=60), reference_encoder.encode(items))
        stats = pool.stats()
        assert stats.standby_takeovers == 1 and stats.failed_calls == 0, stats.summary()
        assert standby_pid in actor_pids(pool).values()
    finally:
        pool.shutdown()


def test_the_controller_replaces_a_dead_actor_that_no_caller_sends_to(ray_cluster):
    """A caller reports an actor dead when a batch to it fails; one that no caller chooses is
    found by the controller's own check."""
    pool = EncoderPool.launch(
        budgets=BUDGETS,
        name="vitpool-unused-dead",
        device="cpu",
        num_actors=2,
        startup_timeout_s=120,
        metrics_interval_s=None,
        warm_standby=False,
    )
    try:
        victim, pid = min(actor_pids(pool).items())
        os.kill(pid, signal.SIGKILL)  # and no call at all
        wait_for(
            lambda: pool.num_actors == 2 and victim not in actor_pids(pool), 120, "the replacement", pool
        )
        stats = pool.stats()
        assert stats.actor_failures == 1 and stats.actor_restarts == 1 and stats.calls == 0, stats.summary()
    finally:
        pool.shutdown()
