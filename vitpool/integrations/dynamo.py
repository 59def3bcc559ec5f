"""vitpool behind NVIDIA Dynamo's custom encoder hook (ai-dynamo 1.6's `VisionEncoderBackend`):

    python -m dynamo.vllm --model CHECKPOINT --enable-multimodal \
        --custom-encoder-class vitpool.integrations.dynamo.VitpoolEncoderBackend

Dynamo creates the backend with no arguments, so it reads its settings from the environment, the
vLLM gateway's under one prefix (`vitpool.integrations.vllm.images.FRONT_SETTINGS`, defined once for
both): VITPOOL_POOL (the pool's name, default "vitpool"; the gateway's --pool), VITPOOL_DTYPE (the
LLM's dtype, default bfloat16; --dtype), VITPOOL_TIMEOUT_S (how long a call's images may wait for
the pool, default 60; --timeout), and, the backend's own, VITPOOL_ALLOWED_LOCAL_MEDIA_PATH (a
directory whose files requests may name, as vLLM's --allowed-local-media-path; unset: none);
RAY_ADDRESS names the cluster (default the one `ray start` last started on this machine, joined as
the pool joins: `vitpool.pool.cluster.join_ray`). `build` connects to the running pool;
`preprocess` (on Dynamo's thread pool) reads an image URL and runs the checkpoint's image processor,
refusing a bad image alone; `forward_batch` encodes the batch in the pool, where it is packed with
every other caller's items. The artifacts are what Dynamo's Qwen3-VL / Qwen3.5 adapter takes.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any

from dynamo.vllm.multimodal_utils.custom_encoder import (
    Preprocessed,
    Qwen3VLImageEncoding,
    VisionEncoderBackend,
)

from vitpool.dtypes import dtype_from_name
from vitpool.errors import InvalidItemError
from vitpool.integrations.vllm.images import (
    ENVIRONMENT_PREFIX,
    checkpoint_family,
    data_url_bytes,
    decode_image,
    front_setting,
    processor_items,
)
from vitpool.integrations.vllm.layouts import vllm_embedding
from vitpool.items import Item
from vitpool.models.registry import RECORDS

# Dynamo's native adapter for these decoders takes Qwen3VLImageEncoding (embeddings and grid)
DYNAMO_FAMILIES = frozenset(
    model_type for record in RECORDS if record.dynamo for model_type in record.model_types
)


def image_bytes(url: str, allowed_local_path: str | Path | None = None) -> bytes:
    """An image URL's bytes: a base64 data: URL, http(s), or file:// or a local path inside
    `allowed_local_path` (a request may not read other files of the server)."""
    if url.startswith("data:"):
        data = data_url_bytes(url)
        if data is None:
            raise ValueError("the image's data URL is not base64")
        return data
    if url.startswith(("http://", "https://")):
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.read()
    path = Path(url.removeprefix("file://")).resolve()
    if allowed_local_path is None or not path.is_relative_to(Path(allowed_local_path).resolve()):
        raise ValueError("local image files are refused outside VITPOOL_ALLOWED_LOCAL_MEDIA_PATH")
    return path.read_bytes()


class VitpoolEncoderBackend(VisionEncoderBackend):
    """Dynamo's encoder, answered by a vitpool pool."""

    preprocess_concurrency = 4
    max_batch_cost = None  # pass-through: the pool packs into its own budgets

    def __init__(self, pool: Any = None) -> None:
        self._pool = pool
        self.family = ""
        self.dtype = dtype_from_name(front_setting("dtype"))  # ConfigError naming it
        self.timeout_s = front_setting("timeout_s")
        self.allowed_local_path = os.environ.get(ENVIRONMENT_PREFIX + "ALLOWED_LOCAL_MEDIA_PATH")
        self._make_item: Any = None

    def build(self, model_id: str) -> None:
        self.family = checkpoint_family(model_id)
        if self.family not in DYNAMO_FAMILIES:
            raise RuntimeError(
                f"vitpool's Dynamo backend answers {', '.join(sorted(DYNAMO_FAMILIES))} "
                f"(Dynamo's Qwen adapter); {model_id} is {self.family!r}"
            )
        self._make_item = processor_items(model_id, self.family)
        if self._pool is None:
            from vitpool.pool import EncoderPool

            # joins as the pool does (RAY_ADDRESS, else the `ray start` cluster): a cluster that
            # wants a token this process lacks is a one-line ConnectionError, not Ray's retries
            self._pool = EncoderPool.connect(front_setting("pool"))

    def preprocess(self, raw: str) -> Preprocessed:
        try:
            picture = decode_image(image_bytes(raw, self.allowed_local_path))
        except (OSError, ValueError) as error:
            raise ValueError(f"the image cannot be read: {error}") from None
        item = self._make_item(picture)
        t, h, w = (int(v) for v in item.grid_thw)
        return Preprocessed(item=item, cost=max(1, t * h * w // 4))

    def forward_batch(
        self, items: list[Item], target_bucket: int | None = None
    ) -> list[Qwen3VLImageEncoding]:
        try:
            embeddings = self._pool.encode(items, timeout_s=self.timeout_s)
        except InvalidItemError as error:  # checked in preprocess's processor output; an engine fault here
            raise RuntimeError(str(error)) from error
        return [
            Qwen3VLImageEncoding(
                vllm_embedding(embedding, self.family, self.dtype), tuple(int(v) for v in item.grid_thw)
            )
            for item, embedding in zip(items, embeddings)
        ]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
