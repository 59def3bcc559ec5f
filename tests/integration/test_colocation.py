"""Serving tensor-parallel deployments on a local cluster with two fake GPUs: a pool colocated
on the LLM's placement group (one encoder per bundle, beside the LLM's workers), and one encode
delivered to two worker actors that read the same bytes from the node's object store."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import ray
import torch
from conftest import BUDGETS, assert_same, mixed_items
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vitpool import ConfigError, Embedding, EncoderPool, shared_results

pytestmark = pytest.mark.ray


@ray.remote(num_gpus=0.75, num_cpus=1)
class TPWorker:
    """Stands for one tensor-parallel rank of an LLM."""

    def receive(self, boxed_refs: list) -> dict:
        (refs,) = boxed_refs  # boxed, so that Ray hands over the references, not the values
        with shared_results():
            embeddings = ray.get(refs)
        return {
            "tokens": [e.tokens.clone().numpy() for e in embeddings],
            "deepstack": [[d.clone().numpy() for d in e.deepstack] for e in embeddings],
            "placement_group": ray.get_runtime_context().get_placement_group_id(),
        }


@pytest.fixture(scope="module")
def colocated(ray_cluster):
    group = placement_group([{"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}], strategy="PACK")
    ray.get(group.ready(), timeout=60)
    workers = [
        TPWorker.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, bundle)).remote()
        for bundle in range(2)
    ]
    pool = EncoderPool.launch(
        budgets=BUDGETS,
        name="vitpool-colocated",
        device="cpu",
        placement_group=group,
        actor_options={"num_gpus": 0.25},
    )
    yield group, workers, pool
    pool.shutdown()
    for worker in workers:
        ray.kill(worker)
    remove_placement_group(group)


def test_one_encoder_actor_per_bundle_beside_the_llm(colocated, reference_encoder):
    group, _, pool = colocated
    assert pool.num_actors == 2
    assert sorted(ray.get(pool._controller.bundles.remote()).values()) == [0, 1]
    infos = ray.get(pool._controller.membership.remote()).infos.values()
    assert {info.placement_group_id for info in infos} == {group.id.hex()}
    items = mixed_items(700)
    assert_same(pool.encode(items), reference_encoder.encode(items))  # callers see no difference


def test_one_encode_reaches_both_ranks_identically(colocated, reference_encoder):
    group, workers, pool = colocated
    items = mixed_items(710)
    refs = pool.encode_refs(items)
    received = ray.get([worker.receive.remote([refs]) for worker in workers])
    expected = reference_encoder.encode(items)
    for rank in received:
        assert rank["placement_group"] == group.id.hex()
        for got, want in zip(rank["tokens"], expected):
            torch.testing.assert_close(torch.from_numpy(got.copy()), want.tokens, rtol=1e-5, atol=1e-5)
    first, second = received
    for a, b in zip(first["tokens"], second["tokens"]):
        assert np.array_equal(a, b)
    for a, b in zip(first["deepstack"], second["deepstack"]):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_shared_results_are_views_not_copies():
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    array.flags.writeable = False  # as an array in the object store is
    embedding = Embedding(torch.from_numpy(array.copy()))
    reducer, (dtype_name, tokens, deepstack) = embedding.__reduce__()
    tokens = np.asarray(tokens)
    tokens.flags.writeable = False
    with shared_results():
        shared = reducer(dtype_name, tokens, deepstack)
    private = reducer(dtype_name, tokens, deepstack)
    assert shared.tokens.data_ptr() == tokens.ctypes.data  # the same bytes
    assert private.tokens.data_ptr() != tokens.ctypes.data  # a copy of its own, writable
    private.tokens.add_(1)
    assert pickle.loads(pickle.dumps(embedding)).tokens.equal(embedding.tokens)


def test_colocation_settings_are_checked(colocated):
    group, _, _ = colocated
    with pytest.raises(ConfigError, match="share of each bundle's GPU"):
        EncoderPool.launch(name="vitpool-bad-colocation", device="cpu", placement_group=group)
    with pytest.raises(ConfigError, match="bundles to"):
        EncoderPool.launch(
            name="vitpool-bad-colocation",
            device="cpu",
            placement_group=group,
            num_actors=3,
            actor_options={"num_gpus": 0.1},
        )
    with pytest.raises(ConfigError, match="has 1 GPU"):
        EncoderPool.launch(
            name="vitpool-bad-colocation",
            device="cpu",
            placement_group=group,
            actor_options={"num_gpus": 1.5},
        )
