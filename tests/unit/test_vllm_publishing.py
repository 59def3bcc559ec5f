"""Publishing embeddings for vLLM without vLLM: the per-family layouts, the file publisher (atomic,
bounded in bytes, digests) and the byte-bounded bookkeeping it shares with the pool's store."""

from __future__ import annotations

import os

import pytest
import torch

from vitpool import ConfigError, Embedding
from vitpool.integrations.vllm.bounded import BoundedEntries
from vitpool.integrations.vllm.layouts import (
    full_model_type,
    supported_model_types,
    vllm_embedding,
    vllm_layout,
)
from vitpool.integrations.vllm.publisher import FILE_NAME, FilePublisher, check_key, entry_bytes, read_entry


def test_qwen3_vl_keeps_its_deepstack_beside_the_tokens():
    tokens, first, second = torch.randn(6, 8), torch.randn(6, 8), torch.randn(6, 8)
    packed = vllm_embedding(Embedding(tokens, [first, second]), "qwen3_vl", torch.bfloat16)
    assert packed.shape == (6, 24) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    assert torch.equal(packed[:, 8:16], first.to(torch.bfloat16))


def test_a_token_family_is_its_tokens_and_a_tower_config_names_its_family():
    tokens = torch.randn(5, 16)
    assert torch.equal(vllm_embedding(Embedding(tokens), "qwen2_5_vl_vision", torch.float32), tokens)


def test_a_full_model_type_that_ends_as_a_towers_is_its_own():
    # Aya Vision's checkpoints say "aya_vision"; a tower-only save of its module "aya_vision_vision"
    assert full_model_type("aya_vision") == "aya_vision" == full_model_type("aya_vision_vision")
    assert full_model_type("qwen2_5_vl_vision") == "qwen2_5_vl"
    assert vllm_layout("aya_vision") is vllm_layout("aya_vision_vision")


def test_a_family_vllm_cannot_take_is_refused_with_the_ones_it_can():
    with pytest.raises(ConfigError, match="'deepseek_ocr2'.*qwen3_vl"):
        vllm_embedding(Embedding(torch.randn(2, 4)), "deepseek_ocr2", torch.float32)
    assert "qwen3_vl" in supported_model_types()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_entry_reads_back_exactly(tmp_path, dtype):
    publisher = FilePublisher(tmp_path)
    tensor = torch.randn(7, 12).to(dtype)
    assert publisher.publish("key-1", tensor)
    read = read_entry(publisher.path("key-1"))
    assert read.dtype == dtype and torch.equal(read, tensor)
    assert not [name for name in os.listdir(tmp_path / "key-1") if name != FILE_NAME]  # no partial file left


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) - 3],  # truncated
        lambda data: data[:-4] + bytes(b ^ 0xFF for b in data[-4:]),  # bytes changed after publishing
        lambda data: b"",  # empty
    ],
)
def test_a_damaged_entry_reads_as_missing(tmp_path, damage):
    path = tmp_path / FILE_NAME
    path.write_bytes(damage(entry_bytes(torch.randn(4, 4))))
    assert read_entry(path) is None


def test_a_file_without_a_digest_is_not_an_entry(tmp_path):
    from safetensors.torch import save_file

    save_file({"ec_cache": torch.randn(2, 2)}, tmp_path / FILE_NAME)
    assert read_entry(tmp_path / FILE_NAME) is None


@pytest.mark.parametrize("key", ["", ".hidden", "a/b", "../x", "x" * 201, "spa ce"])
def test_keys_that_are_not_plain_directory_names_are_refused(key):
    with pytest.raises(ValueError, match="embedding key"):
        check_key(key)


def test_the_byte_bound_holds_under_a_stream_of_distinct_items(tmp_path):
    entry = len(entry_bytes(torch.randn(16, 16)))
    publisher = FilePublisher(tmp_path, max_bytes=5 * entry, min_age_s=0.0)
    for index in range(40):
        assert publisher.publish(f"item-{index}", torch.randn(16, 16))
        on_disk = sum(file.stat().st_size for file in tmp_path.glob(f"*/{FILE_NAME}"))
        assert on_disk <= 5 * entry
    stats = publisher.stats()
    assert stats.entries == 5 and stats.bytes <= 5 * entry and stats.evicted == 35 and stats.published == 40
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(f"item-{i}" for i in range(35, 40))


def test_the_least_recently_used_entry_goes_first(tmp_path):
    entry = len(entry_bytes(torch.randn(8, 8)))
    publisher = FilePublisher(tmp_path, max_bytes=2 * entry, min_age_s=0.0)
    publisher.publish("a", torch.randn(8, 8))
    publisher.publish("b", torch.randn(8, 8))
    assert publisher.contains("a")  # asked for: used
    publisher.publish("c", torch.randn(8, 8))
    assert publisher.contains("a") and publisher.contains("c") and not publisher.contains("b")
    assert publisher.contains_many(["c", "b", "a", "zz"]) == [True, False, True, False]


def test_publish_many_writes_each_entry_whole_and_answers_in_order(tmp_path):
    """publish_many writes on several threads: every entry is its own tensor, and a refused one
    (over the bound alone) is False in its place."""
    tensors = [torch.randn(32, 8) * index for index in range(12)]
    entry = len(entry_bytes(tensors[0]))
    publisher = FilePublisher(tmp_path, max_bytes=12 * entry, min_age_s=0.0)
    entries = [(f"k{index}", tensor) for index, tensor in enumerate(tensors)]
    accepted = publisher.publish_many(entries[:6] + [("huge", torch.randn(512, 512))] + entries[6:])
    assert accepted == [True] * 6 + [False] + [True] * 6
    for key, tensor in entries:
        assert torch.equal(read_entry(publisher.path(key)), tensor)
    assert publisher.stats().entries == 12 and not (tmp_path / "huge").exists()


def test_young_entries_are_not_evicted_and_the_publish_is_refused(tmp_path):
    entry = len(entry_bytes(torch.randn(8, 8)))
    publisher = FilePublisher(tmp_path, max_bytes=2 * entry, min_age_s=3600.0)
    assert publisher.publish("a", torch.randn(8, 8)) and publisher.publish("b", torch.randn(8, 8))
    assert not publisher.publish("c", torch.randn(8, 8))
    assert not (tmp_path / "c").exists() and publisher.stats().refused == 1
    assert not publisher.publish("huge", torch.randn(64, 64))  # over the bound alone


def test_republishing_a_key_replaces_it_without_counting_it_twice(tmp_path):
    publisher = FilePublisher(tmp_path, min_age_s=0.0)
    publisher.publish("k", torch.zeros(4, 4))
    publisher.publish("k", torch.ones(4, 4))
    assert torch.equal(read_entry(publisher.path("k")), torch.ones(4, 4))
    assert publisher.stats().entries == 1 and publisher.stats().bytes == len(entry_bytes(torch.ones(4, 4)))


def test_entries_already_on_disk_are_adopted_and_bounded(tmp_path):
    first = FilePublisher(tmp_path, min_age_s=0.0)
    for index in range(4):
        first.publish(f"old-{index}", torch.randn(8, 8))
    entry = len(entry_bytes(torch.randn(8, 8)))
    second = FilePublisher(tmp_path, max_bytes=2 * entry)
    assert second.stats().entries == 2 and second.stats().bytes == 2 * entry
    assert sum(1 for _ in tmp_path.glob(f"*/{FILE_NAME}")) == 2
    assert second.publish("new", torch.randn(8, 8))  # adopted entries count as old enough to evict


def test_an_entry_asked_about_is_not_evicted_for_min_age_s():
    """vLLM may be told an entry exists when it is asked about: from then on it is as safe from
    eviction as a new one, however long ago it was published."""
    import time

    entries = BoundedEntries(max_bytes=100, min_age_s=3600.0)
    entries.add("old", 60, added_at=time.monotonic() - 7200)
    assert entries.touch_many(["old", "absent"]) == [True, False]
    assert entries.add("new", 60) is None and "old" in entries
    untouched = BoundedEntries(max_bytes=100, min_age_s=3600.0)
    untouched.add("old", 60, added_at=time.monotonic() - 7200)
    assert untouched.add("new", 60) == ["old"]


def test_a_writers_stale_partial_file_is_removed_and_a_fresh_one_kept(tmp_path):
    """A partial file is another writer's (a gateway sharing the root) until it is an hour old."""
    import os
    import time

    publisher = FilePublisher(tmp_path, min_age_s=0.0)
    publisher.publish("whole", torch.ones(4, 4))
    stale = tmp_path / "dead" / f".{FILE_NAME}.1.x.partial"
    fresh = tmp_path / "writing" / f".{FILE_NAME}.2.y.partial"
    for path in (stale, fresh):
        path.parent.mkdir()
        path.write_bytes(b"half")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    reopened = FilePublisher(tmp_path, min_age_s=0.0)
    assert not (tmp_path / "dead").exists() and fresh.exists() and reopened.contains("whole")


def test_bounded_entries_count_replacements_and_removals():
    entries = BoundedEntries(max_bytes=100, min_age_s=0.0)
    assert entries.add("a", 60) == [] and entries.add("a", 40) == []
    assert entries.snapshot().bytes == 40
    assert entries.add("b", 70) == ["a"]
    assert entries.remove("b") and not entries.remove("b")
    assert entries.snapshot().bytes == 0 and entries.snapshot().evicted == 1
    with pytest.raises(ValueError, match="max_bytes"):
        BoundedEntries(max_bytes=0, min_age_s=0.0)
