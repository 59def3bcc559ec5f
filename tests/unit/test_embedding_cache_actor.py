"""The embedding cache's own logic, without Ray: keys, hits, claims, the byte bound, a handle's own
tier, the keys a plan carries and the encoder actor's publishing."""

from __future__ import annotations

import asyncio
import types

import msgpack
import pytest
import torch

from vitpool.actors import cache_publisher
from vitpool.items import Embedding, prepare_item
from vitpool.models import load_adapter
from vitpool.pool.cache_actor import CLAIMED, HIT, PENDING, EmbeddingCacheActor
from vitpool.pool.cache_keys import item_key, model_identity
from vitpool.pool.embedding_cache import _LocalTier
from vitpool.specs import BatchPlan, ItemSpec, plan_from_wire, plan_to_wire

ROW_WIDTH = 3 * 2 * 16 * 16


@pytest.fixture(scope="module")
def rules():
    return load_adapter(None, torch.device("cpu"), torch.float32).item_rules


def prepared(pixels: torch.Tensor, grid: tuple[int, int, int], rules):
    from vitpool import Image

    return prepare_item(0, Image(pixels, grid), rules)


def embedding(rows: int, width: int = 8) -> Embedding:
    return Embedding(torch.randn(rows, width), [torch.randn(rows, width)])


def entry(key: bytes, value: Embedding) -> tuple[bytes, list, int]:
    """What a caller sends `insert` (a reference in Ray; any object stands for one here)."""
    return key, [value], sum(tensor.nbytes for tensor in value.outputs)


def run(coroutine):
    return asyncio.run(coroutine)


def test_keys_follow_content_grid_model_and_dtype(rules):
    pixels = torch.randn(16, ROW_WIDTH)
    identity = model_identity(None, "float32")
    key = item_key(identity, prepared(pixels, (1, 4, 4), rules).parts)
    assert len(key) == 16  # 128 bits
    assert item_key(identity, prepared(pixels.clone(), (1, 4, 4), rules).parts) == key
    changed = pixels.clone()
    changed[7, 100] += 1e-3  # one pixel
    assert item_key(identity, prepared(changed, (1, 4, 4), rules).parts) != key
    assert item_key(identity, prepared(pixels, (1, 2, 8), rules).parts) != key  # same rows, another grid
    assert item_key(model_identity(None, "bfloat16"), prepared(pixels, (1, 4, 4), rules).parts) != key
    assert item_key(identity, prepared(pixels.double(), (1, 4, 4), rules).parts) != key  # pixel dtype


def save_checkpoint(directory, tensors: dict[str, torch.Tensor], config: str = '{"model_type": "qwen3_vl"}'):
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(config)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_model_identity_is_the_checkpoints_content_not_its_place(tmp_path):
    import os
    import shutil

    weights = {"visual.a": torch.randn(64, 64), "visual.b": torch.randn(8)}
    first = model_identity(str(save_checkpoint(tmp_path / "one", weights)), "bfloat16")
    assert len(first) == 16 and model_identity(str(tmp_path / "one"), "bfloat16") == first
    # a copy elsewhere (another node's disk, another mount), with other modification times: the same model
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    os.utime(tmp_path / "two" / "model.safetensors", ns=(1, 1))
    assert model_identity(str(tmp_path / "two"), "bfloat16") == first
    (tmp_path / "link").symlink_to(tmp_path / "one")
    assert model_identity(tmp_path / "link", "bfloat16") == first
    # the same tensors in other shards: the same model
    from safetensors.torch import save_file

    shard_dir = tmp_path / "sharded"
    save_checkpoint(shard_dir, {"visual.a": weights["visual.a"]})
    save_file({"visual.b": weights["visual.b"]}, str(shard_dir / "model-2.safetensors"))
    assert model_identity(str(shard_dir), "bfloat16") == first
    assert model_identity(str(tmp_path / "one"), "float32") != first  # the dtype


def test_model_identity_changes_with_the_weights(tmp_path):
    weights = {"visual.a": torch.randn(64, 64), "visual.b": torch.randn(8)}
    first = model_identity(str(save_checkpoint(tmp_path / "one", weights)), "bfloat16")
    tuned = {name: tensor.clone() for name, tensor in weights.items()}
    tuned["visual.a"][0, 0] += 1e-3  # rewritten in place: one value of one tensor
    assert model_identity(str(save_checkpoint(tmp_path / "one", tuned)), "bfloat16") != first
    retyped = {name: tensor.half() for name, tensor in weights.items()}
    assert model_identity(str(save_checkpoint(tmp_path / "half", retyped)), "bfloat16") != first
    other_config = save_checkpoint(tmp_path / "config", weights, '{"model_type": "qwen3_vl", "depth": 2}')
    assert model_identity(str(other_config), "bfloat16") != first
    # a weights file that is not safetensors still counts (its actor refuses it)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "config.json").write_text('{"model_type": "qwen3_vl"}')
    (tmp_path / "raw" / "model.safetensors").write_bytes(b"x" * 10)
    raw = model_identity(str(tmp_path / "raw"), "bfloat16")
    (tmp_path / "raw" / "model.safetensors").write_bytes(b"y" * 11)
    assert model_identity(str(tmp_path / "raw"), "bfloat16") != raw


def test_model_identity_reads_a_sample_of_each_tensor_not_the_weights(tmp_path, monkeypatch):
    from vitpool.pool import cache_keys

    save_checkpoint(tmp_path, {"visual.large": torch.zeros(1024, 1024), "visual.small": torch.ones(4)})
    reads: list[int] = []
    path_class = type(tmp_path)
    real_open = path_class.open
    monkeypatch.setattr(path_class, "open", lambda path, *a, **k: _Counted(real_open(path, *a, **k), reads))
    model_identity(str(tmp_path), "bfloat16")
    assert 0 < sum(reads) < 2 * cache_keys.WEIGHT_SAMPLE_BYTES + 4096  # of a 4 MiB file


class _Counted:
    """A file whose reads are counted."""

    def __init__(self, file, reads: list) -> None:
        self._file, self._reads = file, reads

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(size)
        self._reads.append(len(data))
        return data

    def seek(self, *args):
        return self._file.seek(*args)


def test_a_checkpoint_this_process_cannot_see_is_its_name_and_dtype(tmp_path):
    assert model_identity("/elsewhere/m", "bfloat16") == model_identity("/elsewhere/m", "bfloat16")
    assert model_identity("/elsewhere/m", "bfloat16") != model_identity("/elsewhere/n", "bfloat16")
    assert model_identity(None, "bfloat16") == model_identity(None, "bfloat16")  # the shipped model


def test_a_miss_is_claimed_once_and_others_wait_for_its_result():
    async def scenario():
        cache = EmbeddingCacheActor(1 << 20)
        assert await cache.lookup([b"a"]) == [(CLAIMED, [])]
        assert await cache.lookup([b"a"]) == [(PENDING, [])]
        waiter = asyncio.ensure_future(cache.wait_for([b"a"]))
        await asyncio.sleep(0)
        assert not waiter.done()
        stored = embedding(4)
        await cache.insert([entry(b"a", stored)])
        assert (await waiter) == [[stored]]
        assert await cache.lookup([b"a"]) == [(HIT, [stored])]
        stats = await cache.stats()
        assert (stats.hits, stats.misses, stats.waits, stats.entries) == (1, 2, 1, 1)
        assert stats.bytes == 2 * 4 * 8 * 4

    run(scenario())


def test_an_abandoned_or_lapsed_claim_lets_a_waiter_encode_it():
    async def scenario():
        cache = EmbeddingCacheActor(1 << 20, claim_timeout_s=0.05)
        await cache.lookup([b"a", b"b"])
        waiter = asyncio.ensure_future(cache.wait_for([b"a"]))
        await cache.abandon([b"a"])
        assert await waiter == [[]]
        assert await cache.lookup([b"a"]) == [(CLAIMED, [])]  # the next asker owns it
        assert await cache.wait_for([b"b"]) == [[]]  # b's claimant never answered: lapsed
        assert await cache.lookup([b"b"]) == [(CLAIMED, [])]
        assert (await cache.stats()).lapsed_claims == 1

    run(scenario())


def test_the_byte_bound_holds_and_the_least_recently_used_go_first():
    async def scenario():
        entry_bytes = 2 * 4 * 8 * 4
        cache = EmbeddingCacheActor(3 * entry_bytes)
        for key in (b"a", b"b", b"c"):
            await cache.lookup([key])
            await cache.insert([entry(key, embedding(4))])
        assert (await cache.lookup([b"a"]))[0][0] == HIT  # a is now the most recent
        for number in range(20):
            key = b"new%d" % number
            await cache.lookup([key])
            await cache.insert([entry(key, embedding(4))])
            assert (await cache.stats()).bytes <= 3 * entry_bytes
        stats = await cache.stats()
        assert stats.entries == 3 and stats.evictions == 20
        await cache.insert([entry(b"huge", embedding(1000))])  # larger than the whole cache: not kept
        assert (await cache.stats()).too_large == 1
        assert (await cache.lookup([b"huge"]))[0][0] == CLAIMED

    run(scenario())


def test_forgotten_entries_miss():
    async def scenario():
        cache = EmbeddingCacheActor(1 << 20)
        await cache.insert([entry(b"a", embedding(2))])
        await cache.forget([b"a"])
        assert (await cache.lookup([b"a"]))[0][0] == CLAIMED
        stats = await cache.stats()
        assert stats.bytes == 0 and stats.lost_hits == 1

    run(scenario())


def test_a_handles_tier_is_bounded_least_recently_used_and_hands_out_copies():
    entry_bytes = 2 * 4 * 8 * 4
    tier = _LocalTier(2 * entry_bytes)
    first = embedding(4)
    tier.keep(b"a", first)
    first.tokens.add_(1.0)  # the caller's result: the tier kept a copy
    served = tier.get(b"a")
    assert not torch.equal(served.tokens, first.tokens)
    served.tokens.zero_()  # and hands out copies
    assert tier.get(b"a").tokens.abs().sum() > 0
    tier.keep(b"b", embedding(4))
    assert tier.get(b"a") is not None  # a is now the most recent
    tier.keep(b"c", embedding(4))
    assert tier.get(b"b") is None and tier.get(b"a") is not None and tier.get(b"c") is not None
    tier.keep(b"huge", embedding(100))  # larger than the tier: not kept, nothing evicted
    assert tier.get(b"huge") is None and tier.get(b"a") is not None


def test_a_plans_cache_keys_travel_and_bad_ones_are_refused():
    spec = ItemSpec("image", (16, 1536), "float32", (1, 4, 4), 4)
    plan = BatchPlan(None, (spec, spec), (b"k" * 16, None))
    assert plan_from_wire(msgpack.unpackb(msgpack.packb(plan_to_wire(plan)))) == plan
    assert "cache_keys" not in plan_to_wire(BatchPlan(None, (spec,)))  # a plan without keys reads as before
    for keys in ([b"k" * 16], ["text", None], b"k"):
        wire = {**plan_to_wire(plan), "cache_keys": keys}
        with pytest.raises(ValueError, match="cache keys"):
            plan_from_wire(wire)


class _Recorder:
    """Stands for the cache actor's handle: records what `insert` and `abandon` were sent."""

    def __init__(self, fail: bool = False) -> None:
        self.inserted, self.abandoned = [], []

        def insert(entries):
            if fail:
                raise RuntimeError("the cache is gone")
            self.inserted.extend(entries)

        self.insert = types.SimpleNamespace(remote=insert)
        self.abandon = types.SimpleNamespace(remote=self.abandoned.extend)


def test_the_encoder_actor_publishes_results_and_gives_up_failed_items(monkeypatch):
    monkeypatch.setattr(cache_publisher.ray, "put", lambda value: ("ref", value))
    cache = _Recorder()
    publisher = cache_publisher.CachePublisher(cache)
    good, other = embedding(4), embedding(2)
    publisher.publish([b"a", None, b"c", b"d"], [good, other, None, ValueError("refused")])
    publisher.close()
    ((key, [(_, stored)], nbytes),) = cache.inserted
    assert key == b"a" and stored is good and nbytes == 2 * 4 * 8 * 4
    assert cache.abandoned == [b"c", b"d"]
    assert publisher.published == 1 and publisher.failures == 0
    failing = cache_publisher.CachePublisher(_Recorder(fail=True))
    failing.publish([b"a"], [good])  # logged and counted; the claim lapses in the cache
    failing.close()
    assert failing.failures == 1
