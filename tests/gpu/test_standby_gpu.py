"""GPU: a pool's warm standby (`vitpool.actors.standby`) takes over the dead actor's GPU, and the
actor it becomes answers as the encoder in this process does: one that built its encoder ahead
holds it on the GPU (memory counted), one that did not has not started CUDA before the take-over.
Skipped without CUDA."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch
from conftest import image, relative_error

from vitpool import EncoderPool, GraphEncoder

pytestmark = pytest.mark.gpu

BUDGETS = [64, 128, 256]


@pytest.mark.parametrize("standby_graphs", [True, False], ids=["built-ahead", "built-at-take-over"])
def test_a_standby_takes_over_the_dead_actors_gpu_and_answers_right(standby_graphs):
    generator = torch.Generator().manual_seed(3)
    calls = [[image(8 * (1 + n % 3), 8, generator)] for n in range(12)]
    encoder = GraphEncoder.from_pretrained(None, budgets=BUDGETS, device="cuda", dtype=torch.bfloat16)
    wanted = [encoder.encode(call, output_device="cpu") for call in calls]
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        pool = EncoderPool.launch(
            budgets=BUDGETS,
            dtype="bfloat16",
            num_actors=2,
            actor_options={"num_gpus": 0.5},
            max_actor_restarts=1,
            metrics_interval_s=None,
            standby_graphs=standby_graphs,
        )
        try:
            while not (standbys := ray.get(pool._controller.standbys.remote(), timeout=30)):
                time.sleep(0.2)
            (standby,) = standbys.values()
            ray.get(standby.standby_ready.remote(), timeout=300)

            def started_cuda(actor) -> bool:
                from vitpool.actors.standby import cuda_driver_initialized

                return cuda_driver_initialized()

            assert ray.get(standby.__ray_call__.remote(started_cuda), timeout=30) == standby_graphs
            state = ray.get(standby.standby_state.remote(), timeout=30)
            assert state.built_ahead == standby_graphs and (state.device_bytes > 0) == standby_graphs, state
            for call in calls:  # both actors known to this process before the kill
                pool.encode(call, timeout_s=60)
            membership = ray.get(pool._controller.membership.remote(), timeout=30)
            victim = min(membership.infos)
            gpu_ids = membership.infos[victim].gpu_ids
            os.kill(membership.infos[victim].pid, signal.SIGKILL)
            deadline = time.monotonic() + 120
            # the controller's view, not this process's (which may still count the dead actor)
            while len(infos := ray.get(pool._controller.membership.remote()).infos) != 2 or victim in infos:
                assert time.monotonic() < deadline, pool.stats(timeout_s=10).summary()
                for call in calls:  # reports the death, then runs on
                    pool.encode(call, timeout_s=60)
            stats = pool.stats(timeout_s=30)
            assert stats.standby_takeovers == 1 and stats.failed_calls == 0, stats.summary()
            infos = ray.get(pool._controller.membership.remote(), timeout=30).infos
            (new,) = [infos[index] for index in set(infos) - set(membership.infos)]
            assert new.gpu_ids == gpu_ids and new.device.startswith("cuda")
            for _ in range(3):  # the new actor gets some of these
                for call, want in zip(calls, wanted, strict=True):
                    (got,) = pool.encode(call, timeout_s=60)
                    for got_tensor, want_tensor in zip(got.outputs, want[0].outputs, strict=True):
                        assert (
                            torch.isfinite(got_tensor).all()
                            and relative_error(got_tensor, want_tensor) <= 1e-2
                        )
            assert (
                next(a for a in pool.stats(timeout_s=30).actors if a.actor_index == new.actor_index).items > 0
            )
        finally:
            pool.shutdown()
    finally:
        ray.shutdown()
