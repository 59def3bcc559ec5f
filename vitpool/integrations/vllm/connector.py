"""vLLM encoder-cache connectors that read vitpool's published embeddings; loaded by vLLM by module
path, so vLLM itself is unchanged:

    --ec-transfer-config '{"ec_connector": "VitpoolECConnector", "ec_role": "ec_consumer",
        "ec_connector_module_path": "vitpool.integrations.vllm.connector",
        "ec_connector_extra_config": {"pool": "vitpool", "ray_address": "auto"}}'

`VitpoolECConnector` reads the pool's embedding store through Ray (no shared disk): the scheduler
asks the store whether an item is there, each worker fetches the items the scheduler chose and puts
them on its own device. `VitpoolFileConnector` reads `FilePublisher`'s files as vLLM's
`ECExampleConnector` does, but takes an entry only if it is whole and matches its digest.

Both only consume: an item that is not there (or not valid) is encoded by vLLM's own tower from the
request's media, as if no connector were set.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

from vitpool.integrations.vllm.layouts import vllm_embedding, vllm_layout
from vitpool.integrations.vllm.publisher import read_entry
from vitpool.integrations.vllm.store import StoreReader
from vitpool.items import Embedding

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _device() -> torch.device:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(current_platform.device_type, current_platform.current_device())
    return torch.device(current_platform.device_type)


@dataclass
class VitpoolECMetadata(ECConnectorMetadata):
    keys: list[str] = field(default_factory=list)


class VitpoolECConnector(ECConnectorBase):
    """An EC consumer over the pool's embedding store (`vitpool.integrations.vllm.store`).

    Extra config: "pool" (the pool's name, default "vitpool"), "ray_address" (default RAY_ADDRESS,
    else "auto"), "timeout_s" (the bound of a worker's fetch, default 10), "ask_timeout_s" (the
    bound of the scheduler's "is it here", default 1; past it the answer is no).
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer:
            raise ValueError("VitpoolECConnector only consumes (ec_role 'ec_consumer'): vitpool's gateway publishes")
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config or {}
        self._reader = StoreReader(
            pool_name=extra.get("pool", "vitpool"),
            address=extra.get("ray_address") or os.environ.get("RAY_ADDRESS"),
            timeout_s=float(extra.get("timeout_s", 10.0)),
            ask_timeout_s=float(extra.get("ask_timeout_s", 1.0)),
        )
        self._to_load: list[str] = []
        self._present: set[str] = set()  # this scheduling step's "yes" answers
        model_config = vllm_config.model_config
        self._family = getattr(model_config.hf_config, "model_type", "")
        vllm_layout(self._family)  # a family vitpool cannot lay out fails here, at vLLM's start
        self._dtype = model_config.dtype

    # scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        present = self._reader.contains(identifier)
        if present:
            self._present.add(identifier)
        return present

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        # Called for every item the step allocates, also those vLLM encodes itself: load the ones
        # this step was told are here. Not asked again: a second answer could differ (the store
        # slow or gone), and vLLM, having skipped its encoder for the item, would miss it.
        key = request.mm_features[index].identifier
        if key in self._present:
            self._to_load.append(key)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        metadata = VitpoolECMetadata(keys=self._to_load)
        self._to_load = []
        self._present = set()
        return metadata

    # worker side

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, VitpoolECMetadata)
        keys = [key for key in dict.fromkeys(metadata.keys) if key not in encoder_cache]
        if not keys:
            return
        device = _device()
        for key, value in zip(keys, self._reader.get_many(keys)):
            if value is None:
                raise RuntimeError(f"vitpool: embedding {key!r} left the store between scheduling and loading; "
                                   "raise the store's min_age_s")
            if isinstance(value, Embedding):  # a pool result: laid out here, joined on the device
                value = vllm_embedding(value, self._family, self._dtype, device)
            # on a CPU rank the layout may still view the object store's memory (tokens alone, in
            # the LLM's dtype): vLLM's cache would keep it pinned after the store let it go
            encoder_cache[key] = value.to(device, copy=True) if value.device.type == "cpu" else value

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return None


class VitpoolFileConnector(ECExampleConnector):
    """vLLM's `ECExampleConnector` that takes an entry only if it is whole and matches the digest
    `FilePublisher` wrote into it (a truncated, foreign or corrupted file is "not there"). A
    checked file is remembered by its size and modification time, so it is read once here."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        self._checked: dict[str, tuple[int, int, int]] = {}

    def _found_match_for_mm_data(self, mm_hash: str) -> bool:
        path = os.path.join(self._storage_path, mm_hash, "encoder_cache.safetensors")
        try:
            stat = os.stat(path)
        except OSError:
            return False
        signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if self._checked.get(mm_hash) == signature:
            return True
        if read_entry(path) is None:
            logger.warning("vitpool: ignoring the invalid encoder-cache entry %s", path)
            return False
        self._checked[mm_hash] = signature
        return True
