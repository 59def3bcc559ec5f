"""A pool spread over several Ray nodes of one machine (`ray.cluster_utils.Cluster`: a head without
GPUs, three nodes with one fake GPU each; the encoder actors run on their CPU).

What it checks:
- actors on different nodes give the in-process GraphEncoder's results, and a caller on a node
  without actors reaches them all through Ray's object store;
- callers on several nodes (the driver, and Ray actors pinned to other nodes, each with its own
  handle from `EncoderPool.connect`) get correct results, and a handle takes the same-node channel
  to exactly the actors of its own node: the batches it counts as channel batches are the ones
  its node's actor ran, and a caller on a node without actors counts none;
- losing a node with an encoder actor while calls stream in loses no call: its batches go to the
  other actor, the pool starts a replacement on the node with a free GPU, and a caller on that
  node then reaches the replacement through the channel;
- results that wait in a lost node's object store (the actor answered, the node went before the
  fetch) are encoded again, and the controller runs on the head node (its encoder actors share its
  fate, so a controller on a worker node would take the pool down with that node).

Every node runs its own raylet and agents on the same (in CI, 2-core) machine, so the file keeps
to one cluster and one pool for all its tests, one thread per actor, and small streams. The tests
run in file order: the last two each take a node away.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import ray
import torch
from conftest import BUDGETS, CheckedStream, assert_same, image, mixed_items, video, wait_for
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import vitpool.pool.encode_call as encode_call_module
from vitpool import EncoderPool

pytestmark = pytest.mark.ray

POOL_NAME = "vitpool-multi-node"
GPU_NODES = 3  # two hold the pool's actors; the third is the room a replacement needs
NUM_ACTORS = 2


# the cluster


@dataclass
class MultiNodeCluster:
    """The test cluster: its head (this driver's node, no GPU) and its live fake-GPU nodes."""

    cluster: Cluster
    head_node_id: str
    gpu_nodes: dict[str, object] = field(default_factory=dict)  # node id -> ray._private.node.Node

    def remove_node(self, node_id: str) -> None:
        """Kill a node's raylet and processes, and wait until the cluster counts it dead (only then
        do callers learn that its actors died)."""
        self.cluster.remove_node(self.gpu_nodes.pop(node_id))
        wait_for(lambda: not node_alive(node_id), 30, f"node {node_id[:8]} to be seen dead")


def node_alive(node_id: str) -> bool:
    return any(node["NodeID"] == node_id and node["Alive"] for node in ray.nodes())


def process_start_times(root_pid: int) -> dict[int, str]:
    """Every live descendant of `root_pid` (Ray's GCS, raylets, agents, workers), by pid, with its
    start time (so that a pid reused by another process later is not mistaken for it)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    started: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is not None and stat[0] != "Z":
            children[int(stat[1])].append(int(entry))
            started[int(entry)] = stat[19]
    found, todo = {}, [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = started[child]
            todo.append(child)
    return found


def still_running(processes: dict[int, str]) -> list[int]:
    """The processes of `processes` that run yet (a zombie waiting to be reaped has ended)."""
    running = []
    for pid, start_time in processes.items():
        stat = _proc_stat(pid)
        if stat is not None and stat[0] != "Z" and stat[19] == start_time:
            running.append(pid)
    return running


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: state, ppid, ... (None once the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


@pytest.fixture(scope="module")
def cluster():
    """Head (this driver; no GPU) and GPU_NODES nodes with one fake GPU each, for the module.

    The finalizer stops every node and checks that none of the cluster's processes outlives it;
    it also puts back Ray's address file (ray_current_cluster in Ray's temp directory, this run's
    own: tests/conftest.py), which `Cluster` points at itself: later `ray.init()` or
    `EncoderPool.connect()` calls without an address read it.
    """
    os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray 2.60 turns on token auth for new local clusters
    address_file = ray._private.utils.get_ray_address_file(None)
    previous_address = None
    if os.path.exists(address_file):
        with open(address_file) as current:
            previous_address = current.read()
    processes_before = process_start_times(os.getpid())
    test_cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False}
    )
    try:
        nodes = [test_cluster.add_node(num_cpus=2, num_gpus=1) for _ in range(GPU_NODES)]
        test_cluster.wait_for_nodes()
        ray.init(address=test_cluster.address, log_to_driver=False)
        yield MultiNodeCluster(test_cluster, test_cluster.head_node.node_id, {n.node_id: n for n in nodes})
    finally:
        ours = {pid: t for pid, t in process_start_times(os.getpid()).items() if pid not in processes_before}
        ray.shutdown()
        test_cluster.shutdown()
        if previous_address is None:
            if os.path.exists(address_file):
                os.remove(address_file)
        else:
            with open(address_file, "w") as restored:
                restored.write(previous_address)
        deadline = time.monotonic() + 30
        while still_running(ours) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert still_running(ours) == [], "Ray processes outlived Cluster.shutdown()"


@pytest.fixture(scope="module")
def pool(cluster):
    """Two actors, each asking for a whole (fake) GPU, so each lands on a node of its own."""
    pool = EncoderPool.launch(
        budgets=BUDGETS,
        name=POOL_NAME,
        device="cpu",
        num_actors=NUM_ACTORS,
        actor_options={"num_gpus": 1},
        actor_threads=1,  # 2 cores: one thread per actor
        startup_timeout_s=120,
        max_actor_restarts=3,
    )
    yield pool
    pool.shutdown()


# helpers


def membership(pool: EncoderPool):
    """The controller's membership now (the handle's own view may lag by one long poll)."""
    return ray.get(pool._controller.membership.remote())


def controller_node(pool: EncoderPool) -> str:
    return ray._private.state.actors(actor_id=pool._controller._actor_id.hex())["Address"]["NodeID"]


def actor_batches(pool: EncoderPool) -> dict[int, int]:
    """Batches each live actor ran, from every caller."""
    return {stats.actor_index: stats.batches for stats in pool.stats().actors}


def actor_items(pool: EncoderPool) -> dict[int, int]:
    return {stats.actor_index: stats.items for stats in pool.stats().actors}


def free_gpu_node(cluster: MultiNodeCluster, infos: dict) -> str:
    """The GPU node that holds none of the pool's actors (its GPU is the room for a replacement)."""
    free = [node for node in cluster.gpu_nodes if node not in {info.node_id for info in infos.values()}]
    assert len(free) == 1, f"expected one GPU node without an actor, found {len(free)}"
    return free[0]


def pinned_to(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def stream_items(seed: int) -> list:
    """Items whose results are each under Ray's 100 KiB inline limit, so they come back inside
    the actor's reply rather than wait in its node's object store: the stream below then loses
    nothing when that node goes. (Results that do wait there are lost with it; see
    test_results_waiting_on_a_lost_node_are_encoded_again.)"""
    generator = torch.Generator().manual_seed(seed)
    items = [
        image(8, 8, generator),
        video(2, 4, 6, generator),
        image(12, 12, generator),
        image(2, 2, generator),
    ]
    return items[: 2 + seed % 3]


@dataclass
class CallerView:
    """A handle's counters (its process's calls) and how it reaches each actor."""

    node_id: str
    batches: int
    channel_batches: int
    failed_calls: int
    through_channel: dict[int, bool]  # actor index -> whether its link is the same-node channel


# Ray pickles this class by value into its worker, where neither this module nor conftest can be
# imported (the workers' path has the repository's root only): it uses nothing of either.
@ray.remote(num_cpus=0, max_concurrency=8)
class RemoteCaller:
    """A caller on a node of the test's choosing, as an LLM deployment's worker would be: its own
    process and handle (`EncoderPool.connect`), so its own dispatcher, links and counters."""

    def __init__(self, pool_name: str) -> None:
        self._pool = EncoderPool.connect(pool_name)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._completed = 0
        self._failures: list[str] = []
        self._threads: list[threading.Thread] = []

    def encode_concurrently(self, calls: list[list]) -> list:
        """Each call from its own thread, all at once, so that the handle has batches for both
        actors in flight together."""
        with ThreadPoolExecutor(len(calls)) as executor:
            return list(executor.map(lambda items: self._pool.encode(items, timeout_s=120), calls))

    def start_stream(self, calls: list[tuple[list, list]]) -> None:
        """Per (items, expected results), a thread calling back to back, checking every result."""
        for items, expected in calls:
            thread = threading.Thread(target=self._stream, args=(items, expected), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _stream(self, items: list, expected: list) -> None:
        while not self._stop.is_set():
            try:
                results = self._pool.encode(items, timeout_s=120)
                # conftest's assert_same: every output tensor of every item (tokens, deepstack)
                torch.testing.assert_close(
                    [r.outputs for r in results], [e.outputs for e in expected], rtol=1e-5, atol=1e-5
                )
            except Exception as error:  # noqa: BLE001 - collected and reported to the test
                self._failures.append(repr(error))
                return
            with self._lock:
                self._completed += 1

    def progress(self) -> tuple[int, list[str]]:
        """Calls completed (each checked) and the failures, so far."""
        return self._completed, list(self._failures)

    def stop_stream(self) -> tuple[int, list[str]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=150)
        return self.progress()

    def view(self) -> dict:
        """CallerView's fields."""
        stats = self._pool.stats()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "batches": stats.batches,
            "channel_batches": stats.channel_batches,
            "failed_calls": stats.failed_calls,
            "through_channel": {i: slot.link.is_local for i, slot in self._pool._dispatcher._actors.items()},
        }

    def close(self) -> None:
        self._pool.close()


def view_of(caller) -> CallerView:
    return CallerView(**ray.get(caller.view.remote(), timeout=60))


def start_caller(node_id: str):
    caller = RemoteCaller.options(scheduling_strategy=pinned_to(node_id)).remote(POOL_NAME)
    assert CallerView(**ray.get(caller.view.remote(), timeout=120)).node_id == node_id
    return caller


def stop_caller(caller) -> None:
    try:
        ray.get(caller.close.remote(), timeout=30)  # its channel segments unlinked, its connections closed
    finally:
        ray.kill(caller)


# the tests


def test_actors_on_separate_nodes_give_the_in_process_results(cluster, pool, reference_encoder):
    infos = membership(pool).infos
    nodes = {info.node_id for info in infos.values()}
    assert len(infos) == NUM_ACTORS and len(nodes) == NUM_ACTORS, "two actors should hold two nodes' GPUs"
    assert nodes <= set(cluster.gpu_nodes) and cluster.head_node_id not in nodes
    before_stats, before_items = pool.stats(), actor_items(pool)
    calls = [mixed_items(10 + n) for n in range(3)]
    with ThreadPoolExecutor(len(calls)) as executor:
        results = list(executor.map(lambda items: pool.encode(items, timeout_s=120), calls))
    for items, got in zip(calls, results):
        assert_same(got, reference_encoder.encode(items))
    # a call's batches go to the actor with the least outstanding work: both nodes served some
    after_items = actor_items(pool)
    assert all(after_items[index] > before_items.get(index, 0) for index in infos), after_items
    # the driver's node (the head) holds no actor: every batch went through Ray's object store
    after_stats = pool.stats()
    assert after_stats.batches > before_stats.batches
    assert after_stats.channel_batches == before_stats.channel_batches == 0
    # references (results left in the actors' nodes' object stores) resolve to the same results
    items = mixed_items(20)
    assert_same(ray.get(pool.encode_refs(items, timeout_s=120)), reference_encoder.encode(items))


def test_callers_on_several_nodes_take_the_channel_only_to_their_own_nodes_actor(
    cluster, pool, reference_encoder
):
    infos = membership(pool).infos
    near, far = sorted(infos)  # the caller "near" shares a node with actor `near`
    spare_node = free_gpu_node(cluster, infos)
    near_caller, spare_caller = start_caller(infos[near].node_id), start_caller(spare_node)
    try:
        # The near caller alone: each batch it sent went to one actor, so its channel batches must
        # be exactly those its node's actor ran, and its other batches exactly the far actor's.
        calls = [mixed_items(100 + n) for n in range(3)]
        before = actor_batches(pool)
        results = ray.get(near_caller.encode_concurrently.remote(calls), timeout=180)
        after, view = actor_batches(pool), view_of(near_caller)
        for items, got in zip(calls, results):
            assert_same(got, reference_encoder.encode(items))
        assert view.through_channel == {near: True, far: False}
        assert view.channel_batches == after[near] - before[near] > 0
        assert view.batches - view.channel_batches == after[far] - before[far] > 0
        assert view.failed_calls == 0

        # Three callers at once, on three nodes: the driver (head, no actor), the near caller, and
        # one on the node whose GPU is free (no actor). Only the near caller has a channel.
        driver_before = pool.stats()
        near_calls = [mixed_items(200 + n) for n in range(2)]
        spare_calls = [mixed_items(300 + n) for n in range(2)]
        driver_calls = [mixed_items(400 + n) for n in range(2)]
        near_pending = near_caller.encode_concurrently.remote(near_calls)
        spare_pending = spare_caller.encode_concurrently.remote(spare_calls)
        with ThreadPoolExecutor(len(driver_calls)) as executor:
            driver_results = list(executor.map(lambda items: pool.encode(items, timeout_s=120), driver_calls))
        for calls, results in (
            (near_calls, ray.get(near_pending, timeout=180)),
            (spare_calls, ray.get(spare_pending, timeout=180)),
            (driver_calls, driver_results),
        ):
            for items, got in zip(calls, results):
                assert_same(got, reference_encoder.encode(items))
        near_view, spare_view, driver_after = view_of(near_caller), view_of(spare_caller), pool.stats()
        assert near_view.channel_batches > view.channel_batches
        assert spare_view.through_channel == {near: False, far: False}
        assert spare_view.batches > 0 and spare_view.channel_batches == 0
        assert driver_after.batches > driver_before.batches and driver_after.channel_batches == 0
        assert near_view.failed_calls == spare_view.failed_calls == driver_after.failed_calls == 0
    finally:
        stop_caller(near_caller)
        stop_caller(spare_caller)


def test_the_controller_runs_on_the_head_node(cluster, pool):
    """Where a pool's controller runs decides which node the pool cannot lose: the encoder actors
    are the controller's (Ray fate-shares them with it), and every handle fails once it is gone.
    The head node is the one node a cluster cannot lose anyway (its GCS runs there).

    Ray places zero-resource actors on a random node, so one launch proves little: this looks at
    the module's pool and up to 8 small pools of one CPU actor, and stops at the first controller
    off the head. With the cluster's 4 nodes, the defect passes unseen with odds of 4^-9."""
    placements = {POOL_NAME: controller_node(pool)}
    for attempt in range(8):
        if any(node != cluster.head_node_id for node in placements.values()):
            break
        probe = EncoderPool.launch(
            budgets=[16],
            name=f"vitpool-placement-{attempt}",
            device="cpu",
            num_actors=1,
            actor_options={"num_gpus": 0},
            actor_threads=1,
            startup_timeout_s=120,
        )
        try:
            placements[probe.name] = controller_node(probe)
        finally:
            probe.shutdown()
    elsewhere = {name: node[:8] for name, node in placements.items() if node != cluster.head_node_id}
    assert not elsewhere, f"controllers off the head node {cluster.head_node_id[:8]}: {elsewhere}"


def test_losing_a_node_mid_stream_loses_no_call_and_the_pool_recovers(cluster, pool, reference_encoder):
    infos = membership(pool).infos
    # The lost node holds an encoder actor but not the pool's controller: losing the controller's
    # node ends the whole pool (test_the_controller_runs_on_the_head_node). With two actors on two
    # nodes, one of them is always free of it.
    holds_controller = controller_node(pool)
    victim = min(index for index, info in infos.items() if info.node_id != holds_controller)
    victim_node = infos[victim].node_id
    spare_node = free_gpu_node(cluster, infos)
    health_before = pool.stats()
    # a second caller, on the node where the replacement will land (the only free GPU)
    spare_caller = start_caller(spare_node)
    try:
        spare_caller.start_stream.remote(
            [(items, reference_encoder.encode(items)) for items in (stream_items(50), stream_items(51))]
        )
        with CheckedStream(pool, reference_encoder, [stream_items(seed) for seed in range(3)], 150) as stream:

            def both_streams_run() -> bool:
                return stream.completed >= 6 and ray.get(spare_caller.progress.remote())[0] >= 3

            wait_for(both_streams_run, 120, "both streams to run", pool)
            completed_at_loss, lost_at = stream.completed, time.monotonic()
            cluster.remove_node(victim_node)
            wait_for(
                lambda: stream.completed >= completed_at_loss + 10 or stream.failures,
                120,
                "calls after the node was lost",
                pool,
            )
            wait_for(
                lambda: pool.num_actors == NUM_ACTORS and victim not in membership(pool).actors,
                120,
                "a replacement actor",
                pool,
            )
            recovered_s = time.monotonic() - lost_at
            (replacement,) = set(membership(pool).actors) - set(infos)
            assert membership(pool).infos[replacement].node_id == spare_node
            # the replacement takes work, and the caller on its node reaches it through the channel
            wait_for(lambda: actor_items(pool).get(replacement, 0) > 0, 120, "work on the replacement", pool)
            wait_for(
                lambda: view_of(spare_caller).channel_batches > 0,
                120,
                "the spare node's caller to use the channel to the replacement",
                pool,
            )
            completed_after_recovery = stream.completed
            wait_for(
                lambda: stream.completed >= completed_after_recovery + 10 or stream.failures,
                120,
                "calls after the recovery",
                pool,
            )
        spare_completed_total, spare_failures = ray.get(spare_caller.stop_stream.remote(), timeout=180)
        spare_view = view_of(spare_caller)
    finally:
        stop_caller(spare_caller)
    stats = pool.stats()
    assert stream.failures == [] and spare_failures == [], (stream.failures, spare_failures)
    assert stats.failed_calls == 0 and spare_view.failed_calls == 0, stats.summary()
    assert stats.actor_failures - health_before.actor_failures == 1, stats.summary()
    assert stats.actor_restarts - health_before.actor_restarts == 1, stats.summary()
    assert pool.num_actors == NUM_ACTORS and len(stats.actors) == NUM_ACTORS
    assert spare_view.through_channel[replacement] is True and not any(
        local for index, local in spare_view.through_channel.items() if index != replacement
    )
    print(
        f"\nlost the node of actor {victim} mid-stream: {stream.completed} + {spare_completed_total} calls "
        f"checked, none failed, {stats.requeued_items} items sent again; actor {replacement} took over on "
        f"the spare node {recovered_s:.1f} s later"
    )


def test_results_waiting_on_a_lost_node_are_encoded_again(cluster, pool, reference_encoder, monkeypatch):
    """The window between an actor's reply (its results still in its node's object store) and the
    caller fetching them, made deterministic: the node that holds one of the results is lost right
    when the caller is about to fetch them. The items are still in the caller, and another actor
    is up: the call should encode them again."""
    generator = torch.Generator().manual_seed(700)
    # two items each larger than every budget: two batches, one per actor (the least loaded takes
    # the next), and ~550 KB of results each, stored in the actor's node's object store
    items = [image(40, 36, generator), image(40, 36, generator)]
    expected = reference_encoder.encode(items)
    holds_controller = controller_node(pool)
    fetch_results = encode_call_module.refs_among
    lost: list[str] = []

    def lose_a_node_before_the_fetch(results):
        refs = fetch_results(results)
        if refs and not lost:
            locations = ray.experimental.get_object_locations(list(refs.values()))
            holders = {node for where in locations.values() for node in where["node_ids"]}
            # not the controller's node: that would end the pool (test_the_controller_runs_on_the_head_node)
            victim = next(
                node for node in sorted(holders) if node != holds_controller and node in cluster.gpu_nodes
            )
            cluster.remove_node(victim)
            lost.append(victim)
        return refs

    monkeypatch.setattr(encode_call_module, "refs_among", lose_a_node_before_the_fetch)
    results = pool.encode(items, timeout_s=120)
    assert lost, "no result waited in an object store: nothing was tested"
    assert_same(results, expected)
