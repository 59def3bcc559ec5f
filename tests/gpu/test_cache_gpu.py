"""GPU: the embedding cache on a GPU actor. The actor publishes outputs that are still on its GPU
(copied to the host on its publishing thread, beside the same-node channel's copy), and another
handle's hit returns exactly what the first call got, which the encoder in this process gives too.
Skipped without CUDA."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch
from conftest import image, relative_error

from vitpool import EncoderPool, GraphEncoder

pytestmark = pytest.mark.gpu

BUDGETS = [64, 128, 256]


def test_a_gpu_actors_published_embeddings_are_hits_for_another_handle():
    generator = torch.Generator().manual_seed(5)
    items = [image(8 * (1 + n % 3), 8 * (1 + n % 2), generator) for n in range(6)]
    encoder = GraphEncoder.from_pretrained(None, budgets=BUDGETS, device="cuda", dtype=torch.bfloat16)
    wanted = encoder.encode(items, output_device="cpu")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        pool = EncoderPool.launch(
            budgets=BUDGETS,
            dtype="bfloat16",
            num_actors=1,
            actor_options={"num_gpus": 0.5},
            embedding_cache_bytes=64 << 20,
            warm_standby=False,
            metrics_interval_s=None,
        )
        try:
            first = pool.encode(items, timeout_s=60)
            assert (
                pool.stats(timeout_s=30).channel_batches > 0
            )  # the outputs left the GPU through the channel
            for got, expected in zip(first, wanted):
                for tensor, reference in zip(got.outputs, expected.outputs):
                    assert torch.isfinite(tensor).all()
                    assert relative_error(tensor.float(), reference.float()) < 2e-2
            deadline = time.monotonic() + 30
            while (cache := pool.stats(timeout_s=30).cache).inserts < len(items):
                assert time.monotonic() < deadline, cache.summary()
                time.sleep(0.05)
            encoded = sum(actor.items for actor in pool.stats(timeout_s=30).actors)
            other = EncoderPool.connect(pool.name)
            try:
                again = other.encode(items, timeout_s=60)
                assert other.stats(timeout_s=30).cache.hits >= len(items)
            finally:
                other.close()
            assert sum(actor.items for actor in pool.stats(timeout_s=30).actors) == encoded
            for got, expected in zip(again, first):
                for tensor, reference in zip(got.outputs, expected.outputs):
                    assert torch.equal(tensor, reference)
        finally:
            pool.shutdown()
    finally:
        ray.shutdown()
