"""A gateway whose published entries end with its process (the embedding store's) keys them per
process, so a restarted gateway never asks vLLM for a uuid whose cached stand-in outlived it."""

from __future__ import annotations

import types

from vitpool.integrations.vllm.gateway import key_prefix
from vitpool.integrations.vllm.publisher import FilePublisher
from vitpool.integrations.vllm.store import StorePublisher


def test_store_keys_are_a_gateways_own_and_file_keys_are_the_models():
    assert StorePublisher.entries_outlive_publisher is False
    store = types.SimpleNamespace(entries_outlive_publisher=False)
    first, second = key_prefix("abc", store), key_prefix("abc", store)
    assert first.startswith("abc-") and second.startswith("abc-") and first != second
    assert key_prefix("abc", FilePublisher.__new__(FilePublisher)) == "abc"  # files outlive the gateway
