"""A gateway in front of vLLM's OpenAI-compatible server that encodes a request's images in a
vitpool pool, publishes them where vLLM's encoder-cache connector reads them, and forwards the
request with each image's `uuid` set, relaying the answer (streamed or not) as vLLM gives it.

    python -m vitpool.integrations.vllm.gateway --model CHECKPOINT --upstream http://127.0.0.1:8000 \
        --publish store            # or: --publish files --root /shared/ec_cache

An image's key (its `uuid`) is a 128-bit XXH3 digest of its bytes under a prefix that covers the
model as the pool's embedding cache names it (its config's and weights' content and the LLM's dtype:
`vitpool.pool.embedding_cache.model_identity`), its image processor's settings and backend
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

import argparse
import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from vitpool.dtypes import dtype_from_name
from vitpool.errors import ConfigError, VitpoolError
from vitpool.integrations.vllm.images import (
    FRONT_SETTINGS,
    checkpoint_family,
    data_url_bytes,
    decode_image,
    image_key,
    model_prefix,
    processor_backend,
    processor_items,
)
from vitpool.integrations.vllm.layouts import vllm_embedding, vllm_layout
from vitpool.items import Embedding, Item
from vitpool.models.loading import vision_weights_digest
from vitpool.pool.setting_flags import add_pool_setting_flags, given_settings
from vitpool.pool.settings import setting_flag

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


@dataclass
class PhaseTimes:
    """Seconds spent per phase over all requests (each request's phases, summed)."""

    receive: float = 0.0  # reading and parsing the body, decoding and hashing the images
    process: float = 0.0  # the image processor
    encode: float = 0.0  # waiting for the pool
    publish: float = 0.0  # asking what is published; laying out and publishing the embeddings
    forward: float = 0.0  # from sending the request upstream to the end of its answer


def key_prefix(identity: str, publisher: Any) -> str:
    """The prefix of this gateway's keys: the model's identity, and the publisher's `scope` where it
    has one (the store's: a store opened anew has another). vLLM caches what it was handed under an
    image's uuid; once handed a stand-in for an entry that vanished (only a store's loss does that)
    it would answer later requests for that uuid from it. Keys under a new store are new, so it
    never meets them; a gateway restarted against the same store finds its entries again."""
    scope = getattr(publisher, "scope", "")
    return f"{identity}-{scope}" if scope else identity


@dataclass
class GatewayStats:
    """What the gateway itself knows. Whether vLLM then loaded an entry, or ran its own tower
    anyway, only the store sees (`Gateway.vllm_view`)."""

    requests: int = 0
    images: int = 0
    encoded: int = 0  # encoded in the pool and published by this request
    reused: int = 0  # already published (or being published for a request in flight)
    fallbacks: int = 0  # left to vLLM's own tower: not encodable or not publishable
    passed_through: int = 0  # media the gateway does not read (not a data: or http(s) URL)
    upstream_errors: int = 0
    phases: PhaseTimes = field(default_factory=PhaseTimes)


@dataclass
class _Image:
    """One image part of a request."""

    part: dict[str, Any]
    data: bytes
    key: str


def check_same_tower(pool: Any, checkpoint: str | Path, weights_digest: str) -> None:
    """Refuse a pool whose checkpoint has other vision weights than `checkpoint` (vLLM's): its
    embeddings would answer vLLM's requests silently wrong. A pool whose checkpoint this process
    cannot read (another node's path) is trusted, with a warning.

    Raises:
        ConfigError: the pool's vision weights differ from the checkpoint's.
    """
    settings = getattr(pool, "settings", None)
    if settings is None:  # not an EncoderPool (a test's stand-in): nothing to compare
        return
    pool_model = settings.model
    if pool_model is not None and Path(pool_model).resolve() == Path(checkpoint).resolve():
        return
    try:
        theirs = vision_weights_digest(pool_model)
    except (VitpoolError, OSError) as error:
        logger.warning(
            "vitpool gateway: cannot read the pool's checkpoint %s here (%s); trusting that its "
            "vision weights are those of %s",
            pool_model,
            error,
            checkpoint,
        )
        return
    if theirs != weights_digest:
        raise ConfigError(
            f"the pool runs {pool_model or 'the shipped tiny checkpoint'}, whose vision weights differ from "
            f"those of {checkpoint} (the model vLLM serves): its embeddings would be wrong for it"
        )


def check_same_dtype(pool: Any, dtype: torch.dtype) -> None:
    """Warn where the pool runs its tower in another dtype than the LLM's (`dtype`, vLLM's
    `--dtype`): vLLM's own tower runs in the LLM's, so answers then match it more loosely (a
    float32 pool under a bfloat16 vLLM: ~1e-2 in logprobs instead of ~1e-4)."""
    settings = getattr(pool, "settings", None)
    pool_dtype = getattr(settings, "dtype", None)
    if pool_dtype is not None and pool_dtype != str(dtype).removeprefix("torch."):
        logger.warning(
            "vitpool gateway: the pool runs its tower in %s and the LLM in %s (--dtype): answers "
            "differ from vLLM's own tower's by up to ~1e-2; launch the pool with dtype=%s",
            pool_dtype,
            str(dtype).removeprefix("torch."),
            str(dtype).removeprefix("torch."),
        )


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
    ) -> None:
        self.model_type = checkpoint_family(checkpoint)
        vllm_layout(self.model_type)  # refuse a family vLLM's layout is not known for, now
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
        weights = vision_weights_digest(checkpoint)  # reads the vision weights once
        check_same_tower(pool, checkpoint, weights)
        check_same_dtype(pool, dtype)
        # a function given decides its own pixels; the checkpoint's processor, on vLLM's backend where it can
        self.processor = "" if make_item is not None else processor_backend()
        self.identity = model_prefix(checkpoint, dtype, self.processor)
        if make_item is None:
            make_item = processor_items(checkpoint, self.model_type)
        self.make_item = make_item
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
                data = await self._bytes_of(url) if isinstance(url, str) else None
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

    async def _bytes_of(self, url: str) -> bytes | None:
        if url.startswith("data:"):
            return data_url_bytes(url)  # None for a malformed one: vLLM answers the client's mistake
        if url.startswith(("http://", "https://")) and self._may_download(url):
            import aiohttp

            try:
                timeout = aiohttp.ClientTimeout(total=self.download_timeout_s)
                async with self._client().get(url, timeout=timeout) as response:
                    if response.status != 200 or (response.content_length or 0) > self.max_download_bytes:
                        return None
                    chunks, size = [], 0
                    async for chunk in response.content.iter_chunked(1 << 20):
                        size += len(chunk)
                        if size > self.max_download_bytes:
                            return None
                        chunks.append(chunk)
                    return b"".join(chunks)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
                logger.info("vitpool gateway: %s not downloaded (%s); vLLM fetches it", url[:200], error)
        return None

    def _may_download(self, url: str) -> bool:
        if self.allowed_media_domains is None:
            return True
        from urllib.parse import urlsplit

        return (urlsplit(url).hostname or "") in self.allowed_media_domains

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


def _dtype(name: str) -> torch.dtype:
    try:
        return dtype_from_name(name)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# Pool settings the gateway has no pool-setting flag for, and why: its own flags set them
GATEWAY_OWN_SETTINGS = {
    "model": "--model, the checkpoint vLLM serves, is the launched pool's",
    "dtype": "--dtype, the LLM's dtype, is the launched pool's",
    "detached": "a pool the gateway launches stops with it",
}


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    from vitpool.integrations.vllm.publisher import FilePublisher
    from vitpool.integrations.vllm.store import StorePublisher
    from vitpool.pool import EncoderPool

    parser = argparse.ArgumentParser(
        prog="python -m vitpool.integrations.vllm.gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="the checkpoint directory vLLM serves")
    parser.add_argument("--upstream", required=True, help="vLLM's OpenAI server, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        setting_flag("pool"),
        default=FRONT_SETTINGS["pool"][0],
        help=f"{FRONT_SETTINGS['pool'][1]} (default vitpool)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray cluster (default RAY_ADDRESS, else the one `ray start` last started here)",
    )
    parser.add_argument(
        "--launch-actors",
        type=int,
        default=0,
        help="launch a pool of this many actors in this process instead of connecting to one; "
        "its settings are `vitpool serve`'s flags, below",
    )
    parser.add_argument("--publish", choices=("store", "files"), default="store")
    parser.add_argument("--root", help="with --publish files: the directory vLLM's connector reads")
    parser.add_argument(
        "--max-bytes", type=float, default=8 << 30, help="bytes of embeddings kept (default 8 GiB)"
    )
    parser.add_argument(
        setting_flag("dtype"),
        type=_dtype,
        default=_dtype(FRONT_SETTINGS["dtype"][0]),
        help=f"{FRONT_SETTINGS['dtype'][1]} (default bfloat16)",
    )
    parser.add_argument(
        setting_flag("timeout_s"),
        type=float,
        default=FRONT_SETTINGS["timeout_s"][0],
        metavar="S",
        dest="timeout_s",
        help=f"{FRONT_SETTINGS['timeout_s'][1]}; past it vLLM encodes them itself (default 60)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="hosts whose http(s) images the gateway downloads (default any); others go to "
        "vLLM as they came, under vLLM's own --allowed-media-domains",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    add_pool_setting_flags(
        parser, leave_out=GATEWAY_OWN_SETTINGS, of=", for a pool launched here (--launch-actors)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.publish == "files" and not args.root:
        parser.error("--publish files needs --root")
    settings = given_settings(args, leave_out=GATEWAY_OWN_SETTINGS)
    if settings and not args.launch_actors:
        given = ", ".join(setting_flag(name) for name in settings)
        parser.error(
            f"{given}: pool settings are for a pool the gateway launches (--launch-actors N); a running "
            "pool keeps those it was started with (vitpool serve)"
        )
    try:
        processor_backend()  # a torchvision that cannot load stops the gateway here, before a pool starts
        # both join Ray through join_ray: a cluster that wants a token this process lacks is a one-line error
        if args.launch_actors:
            pool = EncoderPool.launch(
                args.model,
                num_actors=args.launch_actors,
                name=args.pool,
                address=args.address,
                dtype=str(args.dtype).removeprefix("torch."),
                **settings,
            )
        else:
            pool = EncoderPool.connect(args.pool, address=args.address)
        if args.publish == "files":
            publisher: Publisher = FilePublisher(args.root, max_bytes=int(args.max_bytes))
        else:
            publisher = StorePublisher(args.pool, max_bytes=int(args.max_bytes))
        gateway = Gateway(
            pool,
            publisher,
            args.model,
            args.upstream,
            dtype=args.dtype,
            encode_timeout_s=args.timeout_s,
            allowed_media_domains=args.allowed_media_domains,
        )
    except (VitpoolError, ValueError, ConnectionError) as error:
        raise SystemExit(f"vitpool gateway: {error}") from None
    dtype = str(args.dtype).removeprefix("torch.")
    logger.info(
        "vitpool gateway for %s (pool %r, %s, %s image processor) on http://%s:%d, forwarding to %s, "
        "whose --dtype must be %s",
        args.model,
        args.pool,
        args.publish,
        gateway.processor,
        args.host,
        args.port,
        args.upstream,
        dtype,
    )
    try:
        web.run_app(gateway.app(), host=args.host, port=args.port, print=None)
    finally:
        if args.launch_actors:
            pool.shutdown()


if __name__ == "__main__":
    main()
