"""A gateway's keys carry the store's scope: keys under a store opened anew are new, so vLLM never
meets a stand-in it cached for an entry of the lost store; under the same store they stay."""

from __future__ import annotations

import types

from vitpool.integrations.vllm.gateway import key_prefix
from vitpool.integrations.vllm.publisher import FilePublisher


def test_store_keys_follow_the_store_and_file_keys_are_the_models():
    store = types.SimpleNamespace(scope="aa11")
    assert key_prefix("abc", store) == key_prefix("abc", store) == "abc-aa11"
    store.scope = "bb22"  # the store was opened anew
    assert key_prefix("abc", store) == "abc-bb22"
    assert key_prefix("abc", FilePublisher.__new__(FilePublisher)) == "abc"  # files outlive the gateway
