"""A gateway's restart under traffic leaves vLLM serving (issue 46): the pool's store outlives the
gateway that opened it, the entries that went with the old gateway are dropped (vLLM encodes those
images itself), and every answer equals vLLM's own tower's."""

from __future__ import annotations

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
def server(tiny_model, ray_address, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-restart") / "store.log"
    server = VllmServer(tiny_model, {"ec_connector": "VitpoolECConnector", "ec_role": "ec_consumer",
                                     "ec_connector_module_path": CONNECTOR,
                                     "ec_connector_extra_config": {"pool": POOL, "ray_address": ray_address,
                                                                   "log_every_s": 1}},
                        log, {"RAY_AUTH_MODE": "disabled"})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def start_gateway(tiny_model, server, ray_address, log) -> tuple[subprocess.Popen, str]:
    """`python -m vitpool.integrations.vllm.gateway` in a process of its own (a Ray job), waited for."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "vitpool.integrations.vllm.gateway", "--model", str(tiny_model), "--upstream",
         server.url, "--pool", POOL, "--address", ray_address, "--publish", "store", "--dtype", "float32",
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
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


def test_vllm_keeps_answering_across_a_gateway_restart(server, pool, tiny_model, ray_address, tmp_path):
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
        gateway.kill()  # the restart: SIGKILL, no clean shutdown
        gateway.wait(30)
        answered = len(requests)
        gateway, url = start_gateway(tiny_model, server, ray_address, log)
        try:
            for body, want in zip(requests, expected):  # the same images: their old entries are dropped
                assert_same_answer(answer(url, body, tiny_model), want)
                answered += 1
            # new images, over more than the connector's retry interval: after the restart the
            # scheduler finds the store again and says "here"; the workers must load from it too
            for index in range(6):
                fresh = chat([png(800 + index, 64, 64)])
                assert_same_answer(answer(url, fresh, tiny_model), answer(server.url, fresh, tiny_model))
                answered += 1
                time.sleep(1.5)
        finally:
            gateway.kill()
            gateway.wait(30)
    assert server.process.poll() is None and server.process.pid == vllm_pid  # vLLM never went down
    after = ray.get(find_store(POOL).stats.remote())  # the same store: it outlived both gateways
    assert published.published >= 4 and published.loaded >= 4
    assert after.dropped >= 4  # the old gateway's entries: vLLM was never told they are there
    assert after.loaded > published.loaded and after.published >= published.published + 10
    time.sleep(2)
    counters = re.findall(r"vitpool connector \(\w+\): (.*)", server.log.read_text())
    print(f"answered {answered} requests across the restart; vLLM up {time.monotonic() - started:.1f} s since; "
          f"store {after}; connector {counters[-2:]}")
    assert counters and "Traceback" not in server.log.read_text()


PUBLISH_AND_EXIT = """
import sys, ray, torch
from vitpool.integrations.vllm.store import StoredRef, find_store
from vitpool.transport.wire import to_array
ray.init(address=sys.argv[1], log_to_driver=False)
array = to_array(torch.zeros(4, 128 * 3))
# no owner job named: the store cannot tell this entry's bytes are gone once this process exits
entry = StoredRef(sys.argv[3], [ray.put(array)], "array", array.nbytes, "float32", owner="")
assert ray.get(find_store(sys.argv[2]).put_many.remote([entry])) == [True]
"""


def test_an_entry_lost_after_vllm_was_told_it_is_there_fails_one_request_not_vllm(server, pool, tiny_model,
                                                                                   ray_address):
    """The last resort: the store says "here" but the bytes are gone (their publisher exited and the
    store could not tell): that request fails, counted, and vLLM goes on answering right."""
    from vitpool.integrations.vllm.store import open_store

    open_store(POOL)
    key = "lost-entry"
    subprocess.run([sys.executable, "-c", PUBLISH_AND_EXIT, ray_address, POOL, key], check=True, timeout=120,
                   env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    picture = png(900, 64, 64)
    with pytest.raises(urllib.error.HTTPError):
        answer(server.url, chat([picture], uuids=[key]), tiny_model)
    assert server.process.poll() is None
    expected = answer(server.url, chat([picture]), tiny_model)
    assert_same_answer(answer(server.url, chat([png(900, 64, 64)], uuids=["another-key"]), tiny_model), expected)
    time.sleep(2)
    answer(server.url, chat([png(901, 64, 64)]), tiny_model)  # a step more: the counters are logged
    counters = re.findall(r"vitpool connector \(worker\): (.*)", server.log.read_text())
    print(f"worker counters after a lost entry: {counters[-1:]}")
    assert counters and "lost 1" in counters[-1]
