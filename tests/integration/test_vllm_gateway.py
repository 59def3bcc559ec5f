"""The vLLM gateway and the pool's embedding store without vLLM: a stand-in upstream records what
the gateway forwards; a CPU pool of the shipped tiny Qwen3-VL encodes. (tests/vllm runs the same
against a real vLLM.)"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time

import numpy as np
import pytest
import ray
import torch

from vitpool import EncoderPool, Image, PoolUnavailableError
from vitpool.integrations.vllm.gateway import Gateway, image_key
from vitpool.integrations.vllm.layouts import vllm_embedding
from vitpool.integrations.vllm.publisher import FilePublisher, read_entry
from vitpool.integrations.vllm.store import StorePublisher, StoreReader, find_store

pytestmark = pytest.mark.ray
aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

BUDGETS = [16, 64, 256]


def png(seed: int, height: int = 64, width: int = 96) -> bytes:
    from PIL import Image as PILImage

    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    PILImage.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def chat(*images: bytes, stream: bool = False, uuids: dict[int, str] | None = None) -> dict:
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()}}
        for d in images
    ]
    for index, uuid in (uuids or {}).items():
        parts[index]["uuid"] = uuid
    return {
        "model": "m",
        "stream": stream,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
    }


def make_item(image) -> Image:
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    out = processor(images=image, return_tensors="pt")
    return Image(out["pixel_values"], out["image_grid_thw"][0])


def upstream_app(received: list[dict]) -> web.Application:
    """vLLM's OpenAI server, as far as the gateway sees it."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append(body)
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for index in range(3):
                await response.write(f"data: {json.dumps({'chunk': index})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


@pytest.fixture(scope="module")
def pool(ray_cluster):
    pool = EncoderPool.launch(model=None, budgets=BUDGETS, name="gateway-test", num_actors=1, device="cpu")
    yield pool
    pool.shutdown()


@pytest.fixture
def shipped(tmp_path):
    from vitpool.models.loading import SHIPPED_CHECKPOINT

    return SHIPPED_CHECKPOINT


async def serve(gateway: Gateway, received: list[dict]):
    upstream = TestServer(upstream_app(received))
    await upstream.start_server()
    gateway.upstream = str(upstream.make_url("")).rstrip("/")
    client = TestClient(TestServer(gateway.app()))
    await client.start_server()
    return upstream, client


def run(coroutine):
    return asyncio.run(coroutine)


def test_images_are_encoded_published_and_forwarded_with_their_uuid(
    pool, shipped, tmp_path, reference_encoder
):
    publisher = FilePublisher(tmp_path)
    gateway = Gateway(pool, publisher, shipped, "http://unused", dtype=torch.float32, make_item=make_item)
    pictures = [png(1), png(2, 32, 64)]
    received: list[dict] = []

    async def scenario():
        upstream, client = await serve(gateway, received)
        response = await client.post("/v1/chat/completions", json=chat(*pictures))
        assert response.status == 200 and (await response.json())["choices"][0]["message"]["content"] == "ok"
        await client.close()
        await upstream.close()

    run(scenario())
    [forwarded] = received
    parts = forwarded["messages"][0]["content"]
    from PIL import Image as PILImage

    for part, picture in zip(parts, pictures):
        assert part["uuid"] == image_key(gateway.prefix, picture)
        [expected] = reference_encoder.encode([make_item(PILImage.open(io.BytesIO(picture)).convert("RGB"))])
        published = read_entry(publisher.path(part["uuid"]))
        torch.testing.assert_close(
            published, vllm_embedding(expected, "qwen3_vl", torch.float32), rtol=1e-5, atol=1e-5
        )
    assert gateway.stats.encoded == 2 and gateway.stats.fallbacks == 0


def test_a_repeated_image_is_encoded_once_even_across_concurrent_requests(pool, shipped, tmp_path):
    gateway = Gateway(
        pool, FilePublisher(tmp_path), shipped, "http://unused", dtype=torch.float32, make_item=make_item
    )
    same, other = png(3), png(4)
    received: list[dict] = []

    async def scenario():
        upstream, client = await serve(gateway, received)
        responses = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=chat(same, other, same)) for _ in range(4))
        )
        assert all(response.status == 200 for response in responses)
        again = await client.post("/v1/chat/completions", json=chat(same))
        assert again.status == 200
        await client.close()
        await upstream.close()

    run(scenario())
    assert gateway.stats.encoded == 2 and gateway.stats.images == 13 and gateway.stats.reused == 11
    assert len({part["uuid"] for body in received for part in body["messages"][0]["content"][:-1]}) == 2


def test_a_stream_is_relayed_chunk_by_chunk_and_other_paths_pass_through(pool, shipped, tmp_path):
    gateway = Gateway(pool, FilePublisher(tmp_path), shipped, "http://unused", make_item=make_item)
    received: list[dict] = []

    async def scenario():
        upstream, client = await serve(gateway, received)
        response = await client.post("/v1/chat/completions", json=chat(png(5), stream=True))
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = await response.text()
        models = await (await client.get("/v1/models")).json()
        stats = await (await client.get("/vitpool/stats")).json()
        await client.close()
        await upstream.close()
        return text, models, stats

    text, models, stats = run(scenario())
    assert [line for line in text.split("\n\n") if line] == [
        *(f'data: {{"chunk": {i}}}' for i in range(3)),
        "data: [DONE]",
    ]
    assert models == {"data": [{"id": "m"}]}
    assert stats["gateway"]["encoded"] == 1 and stats["publisher"]["entries"] == 1


class DownPool:
    async def encode_async(self, items, timeout_s=None, return_exceptions=False):
        raise PoolUnavailableError("the pool has no encoder actor left")


def test_when_the_pool_is_down_requests_still_go_through_counted(shipped, tmp_path):
    gateway = Gateway(DownPool(), FilePublisher(tmp_path), shipped, "http://unused", make_item=make_item)
    received: list[dict] = []

    async def scenario():
        upstream, client = await serve(gateway, received)
        response = await client.post(
            "/v1/chat/completions", json=chat(png(6), png(7), uuids={1: "client-given"})
        )
        assert response.status == 200
        await client.close()
        await upstream.close()

    run(scenario())
    parts = received[0]["messages"][0]["content"]
    # a client's uuid is replaced by the content's key: a claimed name could poison other requests
    assert [part["uuid"] for part in parts[:2]] == [
        image_key(gateway.prefix, png(6)),
        image_key(gateway.prefix, png(7)),
    ]
    assert gateway.stats.fallbacks == 2 and gateway.stats.encoded == 0
    assert not list(tmp_path.iterdir())


def test_a_pool_of_other_vision_weights_is_refused(pool, shipped, tmp_path):
    """The pool (the shipped checkpoint) against vLLM's checkpoint: a copy elsewhere is the same
    tower; one weight changed is another, refused before any request is served."""
    import shutil

    from safetensors.torch import load_file, save_file

    from vitpool import ConfigError

    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(shipped, same)
    shutil.copytree(shipped, other)
    [weights] = other.glob("*.safetensors")
    state = load_file(weights)
    name = min(state)
    state[name] = state[name] + 1
    save_file(state, weights)
    Gateway(pool, FilePublisher(tmp_path / "ec"), same, "http://unused", make_item=make_item)
    with pytest.raises(ConfigError, match="vision weights differ"):
        Gateway(pool, FilePublisher(tmp_path / "ec"), other, "http://unused", make_item=make_item)


class UnreachablePublisher(FilePublisher):
    def contains_many(self, keys):
        raise ConnectionError("the store's owner has exited")


def test_a_publisher_that_cannot_answer_leaves_the_images_to_vllm(pool, shipped, tmp_path):
    """Asking what is published fails: the images are encoded and published as new, not a 500."""
    gateway = Gateway(pool, UnreachablePublisher(tmp_path), shipped, "http://unused", make_item=make_item)
    received: list[dict] = []

    async def scenario():
        upstream, client = await serve(gateway, received)
        response = await client.post("/v1/chat/completions", json=chat(png(30)))
        assert response.status == 200
        await client.close()
        await upstream.close()

    run(scenario())
    assert gateway.stats.encoded == 1 and gateway.stats.fallbacks == 0


def test_images_it_cannot_or_may_not_download_and_malformed_bodies_pass_to_vllm(shipped, tmp_path):
    """An unreachable image URL, a host not allowed, an image_url that is a bare string and messages
    that are not a list all go to vLLM as they came (vLLM answers them), not a 500."""
    gateway = Gateway(
        DownPool(),
        FilePublisher(tmp_path),
        shipped,
        "http://unused",
        make_item=make_item,
        allowed_media_domains=["127.0.0.1"],
        download_timeout_s=5.0,
    )
    received: list[dict] = []
    bodies = [
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": "http://127.0.0.1:9/a.png"},
                        },  # nothing listens
                        {
                            "type": "image_url",
                            "image_url": {"url": "http://example.invalid/b.png"},
                        },  # not allowed
                        {"type": "image_url", "image_url": "http://127.0.0.1:9/c.png"},  # not an object
                        {"type": "text", "text": "hi"},
                    ],
                }
            ],
        },
        {"model": "m", "messages": 5},
    ]

    async def scenario():
        upstream, client = await serve(gateway, received)
        for body in bodies:
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status == 200
        await client.close()
        await upstream.close()

    run(scenario())
    assert received == bodies and gateway.stats.passed_through == 3 and gateway.stats.images == 0


def test_an_unreachable_vllm_is_a_502_naming_it(shipped, tmp_path):
    gateway = Gateway(DownPool(), FilePublisher(tmp_path), shipped, "http://127.0.0.1:9", make_item=make_item)

    async def scenario():
        client = TestClient(TestServer(gateway.app()))
        await client.start_server()
        response = await client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        body = await response.json()
        await client.close()
        return response.status, body

    status, body = run(scenario())
    assert status == 502 and "127.0.0.1:9" in body["error"]["message"] and gateway.stats.upstream_errors == 1


def test_a_family_without_an_item_maker_or_a_vllm_layout_is_refused(tmp_path):
    from vitpool import ConfigError

    (tmp_path / "config.json").write_text('{"model_type": "internvl"}')
    with pytest.raises(ConfigError, match="your own function"):
        Gateway(DownPool(), FilePublisher(tmp_path / "ec"), tmp_path, "http://x")
    (tmp_path / "config.json").write_text('{"model_type": "mllama"}')
    with pytest.raises(ConfigError, match="'mllama'"):
        Gateway(DownPool(), FilePublisher(tmp_path / "ec"), tmp_path, "http://x", make_item=make_item)


def test_the_store_bounds_its_bytes_and_readers_find_it(ray_cluster):
    publisher = StorePublisher("store-test", max_bytes=3 * 64 * 4, min_age_s=0.0)
    for index in range(5):
        assert publisher.publish(f"k{index}", torch.full((8, 8), float(index)))
    stats = publisher.stats()
    assert stats.entries == 3 and stats.bytes == 3 * 64 * 4 and stats.evicted == 2
    reader = StoreReader("store-test")
    assert reader.contains("k4") and not reader.contains("k0")
    assert publisher.contains_many(["k0", "k4", "k3"]) == [False, True, True]
    k4, k0 = reader.get_many(["k4", "k0"])
    assert torch.equal(k4, torch.full((8, 8), 4.0)) and k0 is None
    store = find_store("store-test")
    ray.kill(store)
    # ray.kill returns before the actor is gone: wait until a call to it fails
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(store.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.05)
    assert not reader.contains("k4")  # gone: vLLM encodes itself
    assert not StoreReader("no-such-pool").contains("k4")
    # the publisher opens a new store, empty, and says so by its scope (a gateway's keys change)
    old_scope = publisher.scope
    assert publisher.contains_many(["k4"]) == [False]
    assert publisher.scope != old_scope
    assert publisher.publish("k5", torch.ones(8, 8)) and publisher.stats().entries == 1
    ray.kill(find_store("store-test"))


PUBLISH_AND_EXIT = """
import sys, ray, torch
from vitpool import Embedding
from vitpool.integrations.vllm.store import StorePublisher
ray.init(address=sys.argv[1], log_to_driver=False)
publisher = StorePublisher(sys.argv[2])
assert publisher.publish("tensor", torch.full((4, 8), 7.0))
assert publisher.publish_embeddings([("embedding", Embedding(torch.full((3, 8), 5.0), []))]) == [True]
print(publisher.scope)
"""


def test_entries_outlive_the_process_that_published_them(ray_cluster):
    """The store owns its copy of the bytes: after the publisher's process (a gateway) exited, an
    entry vLLM was told is there still loads, and a new publisher gets the same scope (its keys
    find the old entries)."""
    import os
    import subprocess
    import sys

    address = ray.get_runtime_context().gcs_address
    published = subprocess.run(
        [sys.executable, "-c", PUBLISH_AND_EXIT, address, "outlive-test"],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        env=os.environ.copy(),
    )
    assert published.returncode == 0, published.stderr[-3000:]
    reader = StoreReader("outlive-test")
    assert reader.contains("tensor") and reader.contains("embedding")
    tensor, embedding = reader.get_many(["tensor", "embedding"])
    assert torch.equal(tensor, torch.full((4, 8), 7.0)) and torch.equal(
        embedding.tokens, torch.full((3, 8), 5.0)
    )
    assert StorePublisher("outlive-test").scope == published.stdout.split()[-1]
    stats = ray.get(find_store("outlive-test").stats.remote())
    assert stats.loaded == 2 and stats.dropped == 0
    ray.kill(find_store("outlive-test"))


class ScopeChangingPublisher:
    """A store that is lost (and opened anew) while a request asks what it holds."""

    def __init__(self) -> None:
        self.scope = "old"
        self.published: list[str] = []

    def contains_many(self, keys: list[str]) -> list[bool]:
        self.scope = "new"
        return [False] * len(keys)

    def publish_embeddings(self, entries: list) -> list[bool]:
        self.published += [key for key, _ in entries]
        return [True] * len(entries)

    def stats(self):
        return None


def test_a_request_during_a_store_change_is_published_under_the_new_stores_keys(pool, shipped):
    gateway = Gateway(
        pool, ScopeChangingPublisher(), shipped, "http://unused", dtype=torch.float32, make_item=make_item
    )
    received: list[dict] = []

    async def scenario():
        upstream, client = await serve(gateway, received)
        response = await client.post("/v1/chat/completions", json=chat(png(30)))
        assert response.status == 200
        await client.close()
        await upstream.close()

    run(scenario())
    uuid = received[0]["messages"][0]["content"][0]["uuid"]
    assert uuid == image_key(gateway.prefix, png(30)) and gateway.prefix.endswith("-new")
    assert gateway.publisher.published[-1] == uuid


def test_the_store_takes_pool_results_as_they_are_and_readers_lay_them_out(pool, shipped, reference_encoder):
    """--publish store: the gateway puts the pool's Embeddings into the object store as they are; a
    reader gets the Embedding, and the layout made from it equals the one made from the reference."""
    from PIL import Image as PILImage

    gateway = Gateway(
        pool,
        StorePublisher("by-reference"),
        shipped,
        "http://unused",
        dtype=torch.float32,
        make_item=make_item,
    )
    pictures = [png(20), png(21, 32, 32)]
    received: list[dict] = []

    async def scenario():
        upstream, client = await serve(gateway, received)
        response = await client.post("/v1/chat/completions", json=chat(*pictures))
        assert response.status == 200
        await client.close()
        await upstream.close()

    run(scenario())
    keys = [part["uuid"] for part in received[0]["messages"][0]["content"][:-1]]
    values = StoreReader("by-reference").get_many(keys)
    for value, picture in zip(values, pictures):
        assert not isinstance(value, torch.Tensor)  # an Embedding, laid out by the reader
        [expected] = reference_encoder.encode([make_item(PILImage.open(io.BytesIO(picture)).convert("RGB"))])
        torch.testing.assert_close(
            vllm_embedding(value, "qwen3_vl", torch.float32),
            vllm_embedding(expected, "qwen3_vl", torch.float32),
            rtol=1e-5,
            atol=1e-5,
        )
    stats = gateway.publisher.stats()
    assert (
        stats.entries == 2
        and stats.bytes == sum(sum(t.nbytes for t in v.outputs) for v in values)
        and gateway.stats.encoded == 2
    )
    ray.kill(find_store("by-reference"))


def test_two_gateways_serve_one_vllm_and_either_answers_the_others_requests(pool, shipped, reference_encoder):
    """Gateways side by side, one pool, one store: the keys are the images' (the model's prefix
    and the bytes), so a request that one gateway took before it went down, sent again to the
    other, reaches vLLM under the same keys, and the store holds each entry once."""
    from PIL import Image as PILImage

    gateways = [
        Gateway(
            pool,
            StorePublisher("side-by-side"),
            shipped,
            "http://unused",
            dtype=torch.float32,
            make_item=make_item,
        )
        for _ in range(2)
    ]
    assert gateways[0].prefix == gateways[1].prefix
    pictures = [png(40), png(41, 32, 64)]
    received: list[list[dict]] = [[], []]

    async def scenario():
        first_upstream, first = await serve(gateways[0], received[0])
        second_upstream, second = await serve(gateways[1], received[1])
        assert (await first.post("/v1/chat/completions", json=chat(*pictures))).status == 200
        await first.close()  # the first gateway goes down; its client retries at the other
        await first_upstream.close()
        assert (await second.post("/v1/chat/completions", json=chat(*pictures))).status == 200
        assert (await second.post("/v1/chat/completions", json=chat(pictures[1]))).status == 200
        await second.close()
        await second_upstream.close()

    run(scenario())
    keys = [
        [part["uuid"] for part in body["messages"][0]["content"][:-1]] for body in received[0] + received[1]
    ]
    assert keys[0] == keys[1] and keys[2] == keys[0][1:]  # the same keys from either gateway
    values = StoreReader("side-by-side").get_many(keys[0])
    for value, picture in zip(values, pictures):
        [expected] = reference_encoder.encode([make_item(PILImage.open(io.BytesIO(picture)).convert("RGB"))])
        torch.testing.assert_close(
            vllm_embedding(value, "qwen3_vl", torch.float32),
            vllm_embedding(expected, "qwen3_vl", torch.float32),
            rtol=1e-5,
            atol=1e-5,
        )
    assert gateways[1].publisher.stats().entries == 2  # each image held once, whoever published it
    ray.kill(find_store("side-by-side"))
