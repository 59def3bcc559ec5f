"""A gateway's restart under traffic leaves vLLM serving (issue 46): the pool's store outlives the
gateway that opened it and owns its entries' bytes, so the restarted gateway finds the old
gateway's entries (same store, same keys) and vLLM loads them; every answer equals vLLM's own
tower's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from vllm_fixtures import CONNECTOR, NEEDS_VLLM, POOL, pool, ray_address, tiny_model  # noqa: F401 - fixtures
from vllm_requests import answer, assert_same_answer, chat, png
from vllm_servers import VllmServer, free_port

pytestmark = [pytest.mark.vllm, NEEDS_VLLM]


@pytest.fixture(scope="module")
def server(tiny_model, ray_address, tmp_path_factory):  # noqa: F811 - fixtures imported above
    log = tmp_path_factory.mktemp("vllm-restart") / "store.log"
    server = VllmServer(
        tiny_model,
        {
            "ec_connector": "VitpoolECConnector",
            "ec_role": "ec_consumer",
            "ec_connector_module_path": CONNECTOR,
            "ec_connector_extra_config": {"pool": POOL, "ray_address": ray_address, "log_every_s": 1},
        },
        log,
        {"RAY_AUTH_MODE": "disabled"},
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def start_gateway(model, server, address, log) -> tuple[subprocess.Popen, str]:
    """`python -m vitpool.integrations.vllm.gateway` in a process of its own (a Ray job), waited for."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vitpool.integrations.vllm.gateway",
            "--model",
            str(model),
            "--upstream",
            server.url,
            "--pool",
            POOL,
            "--address",
            address,
            "--publish",
            "store",
            "--dtype",
            "float32",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, "the gateway exited"
        try:
            urllib.request.urlopen(url + "/vitpool/stats", timeout=2)
            return process, url
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.5)
    process.kill()
    raise TimeoutError("the gateway did not start in 180 s")


def test_vllm_keeps_answering_across_a_gateway_restart(server, pool, tiny_model, ray_address, tmp_path):  # noqa: F811 - fixtures imported above
    import ray

    from vitpool.integrations.vllm.store import find_store

    requests = [chat([png(700 + index, 64, 64 + 32 * (index % 2))]) for index in range(4)]
    expected = [answer(server.url, body, tiny_model) for body in requests]  # vLLM's own tower
    with open(tmp_path / "gateway.log", "w") as log:
        gateway, url = start_gateway(tiny_model, server, ray_address, log)
        for body, want in zip(requests, expected):
            assert_same_answer(answer(url, body, tiny_model), want)
        store = find_store(POOL)
        published = ray.get(store.stats.remote())
        vllm_pid, started = server.process.pid, time.monotonic()
        before = stats_of(url)
        gateway.kill()  # the restart: SIGKILL, no clean shutdown
        gateway.wait(30)
        answered = len(requests)
        gateway, url = start_gateway(tiny_model, server, ray_address, log)
        try:
            # the same images: the old entries, found under the same keys (vLLM answers them from
            # its own encoder cache, which holds those keys still)
            for body, want in zip(requests, expected):
                assert_same_answer(answer(url, body, tiny_model), want)
                answered += 1
            restarted = stats_of(url)
            # new images, over more than the connector's retry interval: the workers load from the store
            for index in range(6):
                fresh = chat([png(800 + index, 64, 64)])
                assert_same_answer(answer(url, fresh, tiny_model), answer(server.url, fresh, tiny_model))
                answered += 1
                time.sleep(1.5)
        finally:
            gateway.kill()
            gateway.wait(30)
    assert before["gateway"]["encoded"] == 4
    assert (
        restarted["gateway"]["reused"] == 4 and restarted["gateway"]["encoded"] == 0
    )  # found, not encoded again
    assert server.process.poll() is None and server.process.pid == vllm_pid  # vLLM never went down
    after = ray.get(find_store(POOL).stats.remote())  # the same store: it outlived both gateways
    assert published.published >= 4 and published.loaded >= 4
    assert after.dropped == 0 and after.loaded >= published.loaded + 6
    assert after.published == published.published + 6
    time.sleep(2)
    counters = re.findall(r"vitpool connector \(\w+\): (.*)", server.log.read_text())
    print(
        f"answered {answered} requests across the restart; vLLM up {time.monotonic() - started:.1f} s since; "
        f"store {after}; connector {counters[-2:]}"
    )
    assert counters and "Traceback" not in server.log.read_text()


def stats_of(url: str) -> dict:
    with urllib.request.urlopen(url + "/vitpool/stats", timeout=10) as response:
        return json.loads(response.read())


def test_an_entry_that_cannot_be_loaded_after_vllm_was_told_it_is_there_fails_one_request_not_vllm(
    server,
    pool,  # noqa: F811 - fixtures imported above
    tiny_model,  # noqa: F811
    ray_address,  # noqa: F811
):
    """The last resort: the store says "here" but the entry cannot be loaded (here: bytes that do
    not parse as what the entry says; in life, the store's node lost with them): that request
    fails, counted, and vLLM goes on answering right."""
    import numpy as np
    import ray

    from vitpool.integrations.vllm.store import StoredRef, open_store

    key = "unloadable-entry"
    array = np.zeros((4, 128 * 3), np.int8)  # said to be float32: the reader cannot lay it out
    store = open_store(POOL)
    assert ray.get(
        store.put_many.remote([StoredRef(key, [ray.put(array)], "array", array.nbytes, "float32")])
    ) == [True]
    picture = png(900, 64, 64)
    with pytest.raises(urllib.error.HTTPError):
        answer(server.url, chat([picture], uuids=[key]), tiny_model)
    assert server.process.poll() is None
    expected = answer(server.url, chat([picture]), tiny_model)
    assert_same_answer(
        answer(server.url, chat([png(900, 64, 64)], uuids=["another-key"]), tiny_model), expected
    )
    time.sleep(2)
    answer(server.url, chat([png(901, 64, 64)]), tiny_model)  # a step more: the counters are logged
    counters = re.findall(r"vitpool connector \(worker\): (.*)", server.log.read_text())
    print(f"worker counters after an unloadable entry: {counters[-1:]}")
    assert counters and "lost 1" in counters[-1]
