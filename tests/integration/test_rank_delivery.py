"""One encode delivered to two tensor-parallel ranks: through the object store, and over Ray
Direct Transport (gloo between CPU actors), with the same rank code; clear errors and a clean
fallback where RDT cannot work."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import ray
import torch
from conftest import BUDGETS, assert_same, image, mixed_items

from vitpool import ConfigError, EncoderPool, InvalidItemError, received_embeddings

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0)
class Rank:
    """Stands for one tensor-parallel rank: reads a delivered call as the LLM would."""

    def take(self, outputs: list, layout) -> dict:
        embeddings = received_embeddings(outputs, layout)
        first = outputs[0]
        address = (
            first.data_ptr() if isinstance(first, torch.Tensor) else first.__array_interface__["data"][0]
        )
        return {
            "kinds": sorted({type(o).__name__ for o in outputs}),
            "writeable": [bool(o.flags.writeable) for o in outputs if isinstance(o, np.ndarray)],
            # the first item's tokens start where the delivered tokens do: a view, not a copy
            "view": embeddings[0].tokens.data_ptr() == address,
            "tokens": [e.tokens.clone().numpy() for e in embeddings],
            "deepstack": [[d.clone().numpy() for d in e.deepstack] for e in embeddings],
        }


@pytest.fixture(scope="module")
def gloo_pool(ray_cluster):
    pool = EncoderPool.launch(
        budgets=BUDGETS,
        name="vitpool-delivery",
        device="cpu",
        num_actors=1,
        rank_transport="gloo",
        actor_options={"num_gpus": 0, "num_cpus": 1},
    )
    # RDT receivers need enable_tensor_transport and a second thread (see rank_delivery.py).
    ranks = [Rank.options(enable_tensor_transport=True, max_concurrency=2).remote() for _ in range(2)]
    yield pool, ranks
    pool.shutdown()
    for rank in ranks:
        ray.kill(rank)


def delivered(delivery, ranks, items) -> list[dict]:
    reference, layout = delivery.encode(items)
    return ray.get([rank.take.remote(reference, layout) for rank in ranks], timeout=120)


def as_embeddings(received: dict) -> list:
    from vitpool import Embedding

    return [
        Embedding(torch.from_numpy(np.array(t)), [torch.from_numpy(np.array(d)) for d in ds])
        for t, ds in zip(received["tokens"], received["deepstack"], strict=True)
    ]


def test_rdt_over_gloo_gives_both_ranks_the_encoders_results(gloo_pool, reference_encoder):
    pool, ranks = gloo_pool
    delivery = pool.deliver_to(ranks)  # auto: the pool's rank_transport
    assert delivery.transport == "gloo"
    items = mixed_items(11)
    first, second = delivered(delivery, ranks, items)
    assert first["kinds"] == second["kinds"] == ["Tensor"]  # tensors by RDT, not arrays from the store
    assert first["view"] and second["view"]
    expected = reference_encoder.encode(items)
    assert_same(as_embeddings(first), expected)
    for a, b in zip(first["tokens"], second["tokens"], strict=True):
        assert np.array_equal(a, b)
    # again, with the reference passed on before the encode is done (the case that needs max_concurrency >= 2)
    more = [image(4, 6 + 2 * n, torch.Generator().manual_seed(n)) for n in range(3)]
    for received in delivered(delivery, ranks, more):
        assert_same(as_embeddings(received), reference_encoder.encode(more))


def test_object_store_delivery_gives_both_ranks_read_only_views(gloo_pool, reference_encoder):
    pool, ranks = gloo_pool
    delivery = pool.deliver_to(ranks, transport="object_store")
    items = mixed_items(12)
    first, second = delivered(delivery, ranks, items)
    assert first["kinds"] == ["ndarray"]
    assert first["writeable"] == [False] * 3 and first["view"]  # views of the store's bytes, not copies
    assert_same(as_embeddings(first), reference_encoder.encode(items))
    assert_same(as_embeddings(second), as_embeddings(first))


def test_rdt_falls_back_to_the_object_store_where_it_cannot_work(gloo_pool, reference_encoder, caplog):
    _, ranks = gloo_pool
    # rank_transport="nccl" on a machine without CUDA: the actor runs on its CPU, where NCCL cannot work
    pool = EncoderPool.launch(
        budgets=BUDGETS,
        name="vitpool-no-cuda",
        num_actors=1,
        rank_transport="nccl",
        actor_options={"num_gpus": 0, "num_cpus": 1},
    )
    try:
        with caplog.at_level(logging.WARNING, logger="vitpool.pool.rank_delivery"):
            delivery = pool.deliver_to(ranks)
        assert delivery.transport == "object_store"
        assert "not nccl: NCCL moves GPU tensors, and this encoder actor runs on its CPU" in caplog.text
        items = mixed_items(13)[:3]
        for received in delivered(delivery, ranks, items):
            assert received["kinds"] == ["ndarray"]
            assert_same(as_embeddings(received), reference_encoder.encode(items))
        with pytest.raises(ConfigError, match="over nccl cannot work: NCCL moves GPU tensors"):
            pool.deliver_to(ranks, transport="nccl")
    finally:
        pool.shutdown()


def test_an_encoder_actor_delivers_to_one_set_of_ranks_over_rdt(gloo_pool):
    pool, ranks = gloo_pool
    pool.deliver_to(ranks, transport="gloo")
    others = [Rank.options(enable_tensor_transport=True, max_concurrency=2).remote()]
    try:
        with pytest.raises(ConfigError, match="already delivers to other ranks"):
            pool.deliver_to(others, transport="gloo")
        assert pool.deliver_to(others, transport="object_store").transport == "object_store"
    finally:
        ray.kill(others[0])


def test_delivery_errors_are_clear(gloo_pool):
    pool, ranks = gloo_pool
    with pytest.raises(ConfigError, match="launched with rank_transport='gloo'"):
        pool.deliver_to(ranks, transport="nccl")
    with pytest.raises(ConfigError, match="transport 'carrier pigeon'"):
        pool.deliver_to(ranks, transport="carrier pigeon")
    with pytest.raises(ConfigError, match="no encoder actor 7"):
        pool.deliver_to(ranks, actor_index=7)
    delivery = pool.deliver_to(ranks)
    bad = image(4, 4)
    bad = type(bad)(bad.pixel_values[:-1], bad.grid_thw)  # a row short of its grid
    with pytest.raises(InvalidItemError, match="item 1"):
        delivery.encode([image(4, 4), bad])
    with pytest.raises(ValueError, match="at least one item"):
        delivery.encode([])
    with pytest.raises(ConfigError, match="needs GPU actors"):
        EncoderPool.launch(name="vitpool-no-nccl", device="cpu", rank_transport="nccl")
