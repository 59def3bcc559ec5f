"""A gateway in front of vLLM's OpenAI-compatible server that encodes a request's images in a
vitpool pool, publishes them where vLLM's encoder-cache connector reads them, and forwards the
request with each image's `uuid` set, relaying the answer (streamed or not) as vLLM gives it.

    python -m vitpool.integrations.vllm.gateway --model CHECKPOINT --upstream http://127.0.0.1:8000 \
        --publish store            # or: --publish files --root /shared/ec_cache

An image's key (its `uuid`) is a 128-bit XXH3 digest of its bytes under a prefix that covers the
model as the pool's embedding cache names it (its config's and weights' content and the LLM's dtype:
`vitpool.pool.cache_keys.model_identity`), its image processor's settings and backend
(torchvision's, as vLLM's, where it imports: `images.processor_backend`), so a
published entry is found again by any request with the same image for the same model; it replaces
a `uuid` the client set (a name the client claims for the bytes must not reach other requests).
The images of all requests in flight go to the pool together (the pool packs concurrent calls into
shared runs), each distinct image once. An image that cannot be encoded or published still goes to
vLLM with its `uuid`: vLLM finds no entry and runs its own tower (counted in `fallbacks`).

The gateway joins Ray as the pool does (`vitpool.pool.cluster.join_ray`, through `EncoderPool.launch`
or `connect`): a cluster that wants an authentication token this process does not send (Ray 2.60's
`ray start --head`) stops it at once with one line saying what to set.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from vitpool.errors import VitpoolError
from vitpool.integrations.vllm.gateway_checks import check_same_dtype, check_same_tower
from vitpool.integrations.vllm.gateway_fetch import url_bytes
from vitpool.integrations.vllm.gateway_model import GatewayModel, read_model
from vitpool.integrations.vllm.gateway_stats import GatewayStats
from vitpool.integrations.vllm.images import (
    FRONT_SETTINGS,
    decode_image,
    image_key,
)
from vitpool.integrations.vllm.layouts import vllm_embedding
from vitpool.items import Embedding, Item

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
STATS_PATH = "/vitpool/stats"


class Publisher(Protocol):
    def contains_many(self, keys: list[str]) -> list[bool]: ...
    def publish_many(self, entries: list[tuple[str, torch.Tensor]]) -> list[bool]: ...


class Encoder(Protocol):
    async def encode_async(
        self, items: list[Item], timeout_s: float | None = None, return_exceptions: bool = False
    ) -> list[Embedding | Exception]: ...


def key_prefix(identity: str, publisher: Any) -> str:
    """The prefix of this gateway's keys: the model's identity, and the publisher's `scope` where it
    has one (the store's: a store opened anew has another). vLLM caches what it was handed under an
    image's uuid; once handed a stand-in for an entry that vanished (only a store's loss does that)
    it would answer later requests for that uuid from it. Keys under a new store are new, so it
    never meets them; a gateway restarted against the same store finds its entries again."""
    scope = getattr(publisher, "scope", "")
    return f"{identity}-{scope}" if scope else identity


@dataclass
class _Image:
    """One image part of a request."""

    part: dict[str, Any]
    data: bytes
    key: str


class Gateway:
    """The gateway's logic, apart from HTTP serving (`app`)."""

    def __init__(
        self,
        pool: Encoder,
        publisher: Publisher,
        checkpoint: str | Path,
        upstream: str,
        dtype: torch.dtype = torch.bfloat16,
        make_item: Callable[[Any], Item] | None = None,
        encode_timeout_s: float | None = FRONT_SETTINGS["timeout_s"][0],
        allowed_media_domains: Sequence[str] | None = None,
        max_download_bytes: int = 64 << 20,
        download_timeout_s: float = 30.0,
        model: GatewayModel | None = None,
    ) -> None:
        """`model`: what `read_model` read of the checkpoint, read here where not given (the
        command line reads it while it joins the pool)."""
        if model is None:
            model = read_model(checkpoint, dtype, make_item)
        self.model_type = model.model_type
        self.pool = pool
        self.publisher = publisher
        self.upstream = upstream.rstrip("/")
        self.dtype = dtype
        self.encode_timeout_s = encode_timeout_s
        # an http(s) image the gateway may not fetch goes on to vLLM as it came (vLLM's own
        # --allowed-media-domains then decides); None: any host, as vLLM's default
        self.allowed_media_domains = (
            None if allowed_media_domains is None else frozenset(allowed_media_domains)
        )
        self.max_download_bytes = max_download_bytes
        self.download_timeout_s = download_timeout_s
        check_same_tower(pool, checkpoint, model.weights)
        check_same_dtype(pool, dtype)
        self.processor = model.processor
        self.identity = model.identity
        self.make_item = model.make_item
        self.stats = GatewayStats()
        self._in_flight: dict[str, asyncio.Future[bool]] = {}
        self._session: Any = None

    @property
    def prefix(self) -> str:
        """The prefix of the keys of a request that starts now (`key_prefix`)."""
        return key_prefix(self.identity, self.publisher)

    # the request's images

    async def _images_of(self, body: dict[str, Any], prefix: str) -> list[_Image]:
        images = []
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else []:  # else vLLM answers the mistake
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "image_url":
                    continue
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else None
                data = (
                    await url_bytes(
                        url,
                        self._client,
                        self.allowed_media_domains,
                        self.max_download_bytes,
                        self.download_timeout_s,
                    )
                    if isinstance(url, str)
                    else None
                )
                if data is None:
                    self.stats.passed_through += 1
                    continue
                if not url.startswith("data:"):
                    # vLLM gets the bytes the gateway encoded, not a second download
                    image_url["url"] = (
                        "data:application/octet-stream;base64," + base64.b64encode(data).decode()
                    )
                # the content's key, also where the client set a uuid: a uuid is a claim about the
                # bytes, and an entry published under a claimed name could answer other clients'
                # requests for that name with this image
                key = image_key(prefix, data)
                part["uuid"] = key
                images.append(_Image(part, data, key))
        return images

    @staticmethod
    def _rekey(images: list[_Image], prefix: str) -> None:
        for image in images:
            image.key = image.part["uuid"] = image_key(prefix, image.data)

    # encoding and publishing

    async def publish_images(self, images: list[_Image]) -> None:
        """Encode and publish every image not yet published, each distinct key once even across
        requests in flight; failures are counted and left to vLLM."""
        mine: dict[str, _Image] = {}
        waits = []
        asked = list(dict.fromkeys(image.key for image in images if image.key not in self._in_flight))
        # one question to the publisher for the request (a Ray call each would add up)
        started = time.perf_counter()
        try:
            known = await asyncio.to_thread(self.publisher.contains_many, asked) if asked else []
        except Exception as error:  # noqa: BLE001 - then nothing counts as published: encoded again
            logger.warning("vitpool gateway: could not ask the publisher what it holds: %s", error)
            known = []
        self.stats.phases.publish += time.perf_counter() - started
        published = {key for key, present in zip(asked, known) if present}
        for image in images:
            if image.key in self._in_flight:  # this request's own repeat, or another request's
                waits.append(self._in_flight[image.key])
                self.stats.reused += 1
            elif image.key in published:
                self.stats.reused += 1
            else:
                mine[image.key] = image
                self._in_flight[image.key] = asyncio.get_running_loop().create_future()
        try:
            if mine:
                await self._encode_and_publish(list(mine.values()))
        finally:
            for key in mine:
                future = self._in_flight.pop(key)
                if not future.done():
                    future.set_result(False)
        for wait in waits:
            await asyncio.shield(wait)

    async def _encode_and_publish(self, images: list[_Image]) -> None:
        started = time.perf_counter()
        # each image on its own thread: decoding and the processor release the GIL for most of it
        items: list[Item | BaseException] = await asyncio.gather(
            *(
                asyncio.to_thread(lambda data=image.data: self.make_item(decode_image(data)))
                for image in images
            ),
            return_exceptions=True,
        )  # a bad image is vLLM's to answer
        encodable = [
            (image, item) for image, item in zip(images, items) if not isinstance(item, BaseException)
        ]
        self.stats.fallbacks += len(images) - len(encodable)
        processed = time.perf_counter()
        self.stats.phases.process += processed - started
        if not encodable:
            return
        encoded: list[float] = []  # when the pool's results came back
        published = await self._publish(encodable, encoded)
        self.stats.phases.encode += encoded[0] - processed
        self.stats.phases.publish += time.perf_counter() - encoded[0]
        for image, _ in encodable:
            ok = published.get(image.key, False)
            if ok:
                self.stats.encoded += 1
            else:
                self.stats.fallbacks += 1
            self._in_flight[image.key].set_result(ok)

    async def _publish(self, encodable: list[tuple[_Image, Item]], encoded: list[float]) -> dict[str, bool]:
        """Encode in the pool and publish: Embeddings as they are to a publisher that takes them
        (the store: vLLM's connector lays them out on the rank's device), else laid out for vLLM
        here (files). Returns whether each key was published."""
        try:
            results = await self.pool.encode_async(
                [item for _, item in encodable], timeout_s=self.encode_timeout_s, return_exceptions=True
            )
        except (VitpoolError, TimeoutError, ValueError) as error:
            logger.warning(
                "vitpool gateway: the pool could not encode %d images (%s); vLLM encodes them",
                len(encodable),
                error,
            )
            results = [error] * len(encodable)
        encoded.append(time.perf_counter())
        entries: list[tuple[str, Embedding]] = []
        for (image, _), result in zip(encodable, results):
            if isinstance(result, Embedding):
                entries.append((image.key, result))
            else:
                logger.warning("vitpool gateway: image %s not encoded: %s", image.key, result)
        if not entries:
            return {}
        try:  # on a thread: laying out and copying a request's embeddings is tens of MB of work
            accepted = await asyncio.to_thread(self._publish_entries, entries)
        except Exception as error:  # noqa: BLE001 - vLLM encodes them instead
            logger.warning("vitpool gateway: publishing %d embeddings failed: %s", len(entries), error)
            return {}
        return {key: ok for (key, _), ok in zip(entries, accepted)}

    def _publish_entries(self, entries: list[tuple[str, Embedding]]) -> list[bool]:
        """Pool results as they are to a publisher that takes them (the store: vLLM's connector lays
        them out on the rank's device), else laid out for vLLM here (files)."""
        if hasattr(self.publisher, "publish_embeddings"):
            return self.publisher.publish_embeddings(entries)
        return self.publisher.publish_many(
            [(key, vllm_embedding(embedding, self.model_type, self.dtype)) for key, embedding in entries]
        )

    # HTTP

    def _client(self) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def chat(self, request: Any) -> Any:
        from aiohttp import web

        started = time.perf_counter()
        try:
            body = await request.json()
        except ValueError:
            return web.json_response(
                {"error": {"message": "the request body is not JSON", "type": "BadRequest"}}, status=400
            )
        if not isinstance(body, dict):
            return web.json_response(
                {"error": {"message": "the request body is not a JSON object", "type": "BadRequest"}},
                status=400,
            )
        self.stats.requests += 1
        prefix = self.prefix
        images = await self._images_of(body, prefix)
        self.stats.images += len(images)
        self.stats.phases.receive += time.perf_counter() - started
        await self.publish_images(images)
        if images and self.prefix != prefix:
            # the store was opened anew meanwhile: vLLM may hold stand-ins under the old keys
            logger.warning(
                "vitpool gateway: the embedding store changed during a request; publishing its "
                "images again under the new store's keys"
            )
            self._rekey(images, self.prefix)
            await self.publish_images(images)
        return await self.forward(request, CHAT_PATH, json.dumps(body).encode())

    async def forward(self, request: Any, path: str, body: bytes | None) -> Any:
        """Send the request upstream and relay the answer, chunk by chunk where it streams."""
        import aiohttp
        from aiohttp import web

        started = time.perf_counter()
        headers = {
            name: value
            for name, value in request.headers.items()
            if name.lower() in ("authorization", "content-type", "accept")
        }
        try:
            async with self._client().request(
                request.method, self.upstream + path, data=body, headers=headers, params=request.query
            ) as upstream:
                content_type = upstream.headers.get("Content-Type", "application/json")
                if content_type.startswith("text/event-stream"):
                    relay = web.StreamResponse(status=upstream.status, headers={"Content-Type": content_type})
                    await relay.prepare(request)
                    try:
                        async for chunk in upstream.content.iter_any():
                            await relay.write(chunk)
                    except aiohttp.ClientError as error:  # the answer has begun: end it, nothing else
                        self.stats.upstream_errors += 1
                        logger.warning("vitpool gateway: vLLM's stream broke off: %s", error)
                        return relay
                    await relay.write_eof()
                    return relay
                return web.Response(
                    status=upstream.status, body=await upstream.read(), headers={"Content-Type": content_type}
                )
        except aiohttp.ClientError as error:
            self.stats.upstream_errors += 1
            return web.json_response(
                {
                    "error": {
                        "message": f"vLLM at {self.upstream} is unreachable: {error}",
                        "type": "BadGateway",
                    }
                },
                status=502,
            )
        finally:
            self.stats.phases.forward += time.perf_counter() - started

    async def proxy(self, request: Any) -> Any:
        body = await request.read() if request.can_read_body else None
        return await self.forward(request, request.path, body)

    def vllm_view(self, publisher_stats: Any) -> dict[str, Any]:
        """What vLLM did with the entries, as far as the publisher can tell: `encoded` counts
        entries published, not entries vLLM loaded (a vLLM that never asks, or was started
        without the connector, runs its own tower and the gateway cannot see it). The store
        counts the entries it handed to vLLM (`loaded`); files are read unseen: None."""
        dtype = str(self.dtype).removeprefix("torch.")  # what the gateway was told vLLM runs (--dtype)
        # the dtype vLLM's connector reported to the store, where the store keeps it
        vllm_dtype = getattr(publisher_stats, "consumer_dtype", None)
        view = {
            "dtype": dtype,
            "vllm_dtype": vllm_dtype,
            "processor": self.processor or "make_item",
            # entries the store handed to vLLM's workers (PublisherStats.loaded); None for files,
            # which vLLM reads unseen
            "loaded": getattr(publisher_stats, "loaded", None) if self._sees_reads() else None,
        }
        if vllm_dtype is not None and str(vllm_dtype).removeprefix("torch.") != dtype:
            view["warning"] = (
                f"vLLM runs {vllm_dtype} and the gateway was given --dtype {dtype}: its keys and "
                f"layouts are for {dtype}; restart it with --dtype {vllm_dtype}"
            )
        return view

    def _sees_reads(self) -> bool:
        return hasattr(self.publisher, "publish_embeddings")  # the store: vLLM's workers fetch through it

    async def stats_view(self, request: Any) -> Any:
        from aiohttp import web

        publisher_stats = await asyncio.to_thread(getattr(self.publisher, "stats", lambda: None))
        return web.json_response(
            {
                "gateway": asdict(self.stats),
                "publisher": asdict(publisher_stats) if publisher_stats else None,
                "vllm": self.vllm_view(publisher_stats),
            }
        )

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=256 << 20)
        app.router.add_post(CHAT_PATH, self.chat)
        app.router.add_get(STATS_PATH, self.stats_view)
        app.router.add_route("*", "/{tail:.*}", self.proxy)

        async def closing(_app: Any) -> None:
            await self.close()

        app.on_cleanup.append(closing)
        return app


if __name__ == "__main__":  # the gateway's public command, kept where the README and tests run it
    from vitpool.integrations.vllm.gateway_cli import main

    main()
