"""A warm standby that built its encoder ahead on another GPU than the dead actor's
(`vitpool.pool.replacement`): it serves at once as a stand-in, a fresh actor starts on the GPU the
dead one freed, and the stand-in retires once that actor is ready; the node then gets a new standby.

The pool's controller runs in this process on a local cluster with two fake GPUs, one CPU actor on
each. Which GPU a CPU encoder sits beside means nothing to it, so the controller's check of where a
standby runs (`stays_on_its_gpu`, which a GPU pool makes) is made to compare the GPU ids here.
"""

from __future__ import annotations

import os
import signal

import pytest
import ray
from conftest import BUDGETS, wait_for
from test_faults import process_alive

from vitpool.pool import replacement
from vitpool.pool.controller import PoolController
from vitpool.pool.settings import PoolSettings

pytestmark = pytest.mark.ray


def pids(controller: PoolController) -> dict[int, int]:
    return {index: info.pid for index, info in controller.membership().infos.items()}


def test_a_standby_beside_another_gpu_stands_in_until_an_actor_is_ready_on_the_freed_one(
    ray_cluster, monkeypatch
):
    monkeypatch.setattr(
        replacement, "stays_on_its_gpu", lambda device, own, held: sorted(own) == sorted(held)
    )
    settings = PoolSettings(
        budgets=BUDGETS,
        device="cpu",
        warm_standby=True,
        max_actor_restarts=2,
        metrics_interval_s=None,
        startup_timeout_s=120,
    )
    controller = PoolController("vitpool-stand-in", settings, {"num_gpus": 1, "num_cpus": 1}, 1)
    try:
        started, _ = controller.scale(2)
        for index, _, info_ref in started:
            controller.activate(index, ray.get(info_ref, timeout=120))
        (standby,) = controller.standbys().values()
        state = ray.get(standby.standby_state.remote(), timeout=120)
        standby_pid = ray.get(standby.__ray_call__.remote(lambda self: os.getpid()))
        assert state.built_ahead and state.device == "cpu" and state.device_bytes == 0, state
        infos = controller.membership().infos
        assert sorted(gpu for info in infos.values() for gpu in info.gpu_ids) == ["0", "1"]
        (victim,) = (index for index, info in infos.items() if info.gpu_ids != state.gpu_ids)
        freed_gpus = infos[victim].gpu_ids
        os.kill(infos[victim].pid, signal.SIGKILL)
        wait_for(lambda: not process_alive(infos[victim].pid), 30, "the actor to die")

        assert controller.report_failure(victim)
        wait_for(lambda: standby_pid in pids(controller).values(), 60, "the standby to serve")
        (stand_in,) = (index for index, pid in pids(controller).items() if pid == standby_pid)
        stand_in_info = controller.membership().infos[stand_in]
        assert stand_in_info.gpu_ids == state.gpu_ids  # it serves from where it built
        # a switch: the encoder it built ahead, not one built at the take-over
        assert stand_in_info.startup_seconds < state.seconds / 2, (stand_in_info, state)

        # a fresh actor on the freed GPU takes over from the stand-in, which then retires
        wait_for(
            lambda: stand_in not in pids(controller) and len(pids(controller)) == 2,
            120,
            "the stand-in to retire",
        )
        infos = controller.membership().infos
        assert sorted(info.gpu_ids for info in infos.values()) == sorted([state.gpu_ids, freed_gpus])
        wait_for(lambda: not process_alive(standby_pid), 30, "the stand-in's process to stop")
        health = controller.health()
        assert health.counters.actor_restarts == 1 and health.counters.standby_takeovers == 1, health
        # the node has a standby again, built ahead, for the next failure
        wait_for(lambda: controller.standbys(), 60, "a new standby")
        (next_standby,) = controller.standbys().values()
        assert ray.get(next_standby.standby_state.remote(), timeout=120).built_ahead
    finally:
        controller.shutdown()
