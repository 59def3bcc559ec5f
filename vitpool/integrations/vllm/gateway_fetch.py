"""The bytes of an image a chat request names by URL, for the vLLM gateway to encode: a `data:`
URL's own, or an http(s) image downloaded within the gateway's host list and limits."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

from vitpool.integrations.vllm.images import data_url_bytes

logger = logging.getLogger(__name__)


async def url_bytes(
    url: str,
    client: Callable[[], Any],
    allowed_hosts: Collection[str] | None,
    max_bytes: int,
    timeout_s: float,
) -> bytes | None:
    """The image's bytes, or None where the gateway leaves the image to vLLM as it came. `client`
    gives the gateway's aiohttp session, asked for only when a download is due (a request of data:
    URLs alone opens none)."""
    if url.startswith("data:"):
        return data_url_bytes(url)  # None for a malformed one: vLLM answers the client's mistake
    if url.startswith(("http://", "https://")) and may_download(url, allowed_hosts):
        import aiohttp

        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with client().get(url, timeout=timeout) as response:
                if response.status != 200 or (response.content_length or 0) > max_bytes:
                    return None
                chunks, size = [], 0
                async for chunk in response.content.iter_chunked(1 << 20):
                    size += len(chunk)
                    if size > max_bytes:
                        return None
                    chunks.append(chunk)
                return b"".join(chunks)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            logger.info("vitpool gateway: %s not downloaded (%s); vLLM fetches it", url[:200], error)
    return None


def may_download(url: str, allowed_hosts: Collection[str] | None) -> bool:
    """Whether the URL's host is one the gateway may fetch from (None: any host, as vLLM's default)."""
    if allowed_hosts is None:
        return True
    from urllib.parse import urlsplit

    return (urlsplit(url).hostname or "") in allowed_hosts
