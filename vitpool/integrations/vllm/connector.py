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

vLLM's connector API lets only the scheduler choose vLLM's own tower for an item: once it answered
"here", the worker must put the item in the encoder cache, or vLLM's model runner fails its whole
engine. The store owns its entries' bytes, so an entry it holds stays loadable after its gateway
exits; a worker that still cannot load one (the store lost with its node, or an entry that does
not parse) puts a placeholder of zeros and reports it: the scheduler fails that one request
(vLLM's `take_unavailable_requests`), and vLLM keeps serving. vLLM keeps that placeholder under the
item's uuid until it is evicted; the gateway's keys name the store (`StorePublisher.scope`), so a
store opened anew never meets it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

from vitpool.integrations.vllm.images import KEY_MARK
from vitpool.integrations.vllm.layouts import vllm_embedding, vllm_layout
from vitpool.integrations.vllm.publisher import read_entry
from vitpool.integrations.vllm.store import StoreReader
from vitpool.items import Embedding

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

LOG_EVERY_S = 60.0  # the connector's counters, logged at most this often when they changed
MAX_PROMISED = 4096  # keys the scheduler remembers it promised (to fail their requests if lost)


def _device() -> torch.device:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(current_platform.device_type, current_platform.current_device())
    return torch.device(current_platform.device_type)


@dataclass
class VitpoolECMetadata(ECConnectorMetadata):
    keys: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(
        default_factory=dict
    )  # key -> embeddings vLLM expects (a placeholder's size)


@dataclass
class VitpoolECWorkerMetadata(ECConnectorWorkerMetadata):
    """What workers could not load this step (the scheduler fails those requests)."""

    lost: set[str] = field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, VitpoolECWorkerMetadata)
        return VitpoolECWorkerMetadata(self.lost | other.lost)


@dataclass
class ConnectorCounters:
    """Scheduler: `hits` (told "here"), `misses` (not published: vLLM encodes), `fallbacks` (the
    store unreachable or not yet found: vLLM encodes), `foreign` (not a gateway's key, a request
    sent to vLLM directly: vLLM encodes, the store not asked). Worker: `loaded`, `lost` (promised
    but not loadable: its request failed, vLLM kept serving)."""

    hits: int = 0
    misses: int = 0
    fallbacks: int = 0
    foreign: int = 0
    loaded: int = 0
    lost: int = 0


class VitpoolECConnector(ECConnectorBase):
    """An EC consumer over the pool's embedding store (`vitpool.integrations.vllm.store`).

    Extra config: "pool" (the pool's name, default "vitpool"), "ray_address" (default RAY_ADDRESS,
    else "auto"), "timeout_s" (the bound of a worker's fetch, default 10), "ask_timeout_s" (the
    bound of the scheduler's "is it here", default 1; past it the answer is no), "log_every_s" (how
    often the counters are logged, default 60).
    """

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer:
            raise ValueError(
                "VitpoolECConnector only consumes (ec_role 'ec_consumer'): vitpool's gateway publishes"
            )
        _log_with_vllm()
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config or {}
        self._reader = StoreReader(
            pool_name=extra.get("pool", "vitpool"),
            address=extra.get("ray_address") or os.environ.get("RAY_ADDRESS"),
            timeout_s=float(extra.get("timeout_s", 10.0)),
            ask_timeout_s=float(extra.get("ask_timeout_s", 1.0)),
            consumer_dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        )
        self._to_load: list[str] = []
        self._rows: dict[str, int] = {}
        self._present: set[str] = set()  # this scheduling step's "yes" answers
        self._promised: OrderedDict[str, set[str]] = OrderedDict()  # key -> ids of requests told "here"
        self._unavailable: set[str] = set()  # requests whose promised item a worker could not load
        self._lost: set[str] = set()  # this step's keys a worker could not load
        self.counters = ConnectorCounters()
        self._logged = ConnectorCounters()
        self._log_every_s = float(extra.get("log_every_s", LOG_EVERY_S))
        self._next_log = time.monotonic() + self._log_every_s
        model_config = vllm_config.model_config
        self._family = getattr(model_config.hf_config, "model_type", "")
        vllm_layout(self._family)  # a family vitpool cannot lay out fails here, at vLLM's start
        self._dtype = model_config.dtype
        self._width = _embedding_width(model_config)
        self._reader.connect_in_background()  # joining Ray never runs on vLLM's engine loop

    # scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        if not identifier.startswith(KEY_MARK):  # no gateway published it: no store to wait for
            self.counters.foreign += 1
            return False
        present = self._reader.contains(identifier)
        if present is None:
            self.counters.fallbacks += 1
        elif present:
            self.counters.hits += 1
            self._present.add(identifier)
        else:
            self.counters.misses += 1
        return bool(present)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        # Called for every item the step allocates, also those vLLM encodes itself: load the ones
        # this step was told are here. Not asked again: a second answer could differ (the store
        # slow or gone), and vLLM, having skipped its encoder for the item, would miss it.
        feature = request.mm_features[index]
        key = feature.identifier
        if key in self._present:
            self._to_load.append(key)
            self._rows[key] = feature.mm_position.get_num_embeds()
            self._promised.setdefault(key, set()).add(request.request_id)
            self._promised.move_to_end(key)
            while len(self._promised) > MAX_PROMISED:
                self._promised.popitem(last=False)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        metadata = VitpoolECMetadata(keys=self._to_load, rows=self._rows)
        self._to_load = []
        self._rows = {}
        self._present = set()
        self._log_counters()
        return metadata

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        lost = connector_output.ec_connector_worker_meta
        if isinstance(lost, VitpoolECWorkerMetadata):
            for key in lost.lost:
                self._unavailable |= self._promised.pop(key, set())

    def take_unavailable_requests(self) -> set[str]:
        unavailable, self._unavailable = self._unavailable, set()
        if unavailable:
            logger.warning(
                "vitpool: failing %d requests whose published images could not be loaded "
                "after the store said they were there",
                len(unavailable),
            )
        return unavailable

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
                # promised, not loadable (the store lost, or the entry unreadable): vLLM's
                # runner needs an entry; zeros stand in and the scheduler fails the request
                logger.warning(
                    "vitpool: embedding %r could not be loaded; its request fails, vLLM keeps serving", key
                )
                self.counters.lost += 1
                self._lost.add(key)
                encoder_cache[key] = torch.zeros(
                    metadata.rows.get(key, 0), self._width, dtype=self._dtype, device=device
                )
                continue
            self.counters.loaded += 1
            if isinstance(value, Embedding):  # a pool result: laid out here, joined on the device
                value = vllm_embedding(value, self._family, self._dtype, device)
            # on a CPU rank the layout may still view the object store's memory (tokens alone, in
            # the LLM's dtype): vLLM's cache would keep it pinned after the store let it go
            encoder_cache[key] = value.to(device, copy=True) if value.device.type == "cpu" else value

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        self._log_counters()
        if not self._lost:
            return None
        lost, self._lost = self._lost, set()
        return VitpoolECWorkerMetadata(lost)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return None

    def _log_counters(self) -> None:
        """The counters at INFO, at most every LOG_EVERY_S, when they changed."""
        now = time.monotonic()
        if now < self._next_log or self.counters == self._logged:
            return
        self._next_log = now + self._log_every_s
        self._logged = ConnectorCounters(**asdict(self.counters))
        logger.info(
            "vitpool connector (%s): %s",
            self.role.name.lower(),
            ", ".join(f"{name} {value}" for name, value in asdict(self.counters).items()),
        )


def _log_with_vllm() -> None:
    """vitpool's loggers write where vLLM's do, at vLLM's level (VLLM_LOGGING_LEVEL): the connector's
    counters and the store's connection problems belong in vLLM's log."""
    vitpool_logger, vllm_logger = logging.getLogger("vitpool"), logging.getLogger("vllm")
    if vitpool_logger.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        vitpool_logger.addHandler(handler)
    vitpool_logger.setLevel(vllm_logger.level)
    vitpool_logger.propagate = False


def _embedding_width(model_config: Any) -> int:
    """The width of an item in vLLM's encoder cache: the LLM's hidden size, times 1 + the deepstack
    layers for the families that keep them beside the tokens (`layouts.py`)."""
    hf_config = model_config.hf_config
    vision = getattr(hf_config, "vision_config", None)
    deepstack = getattr(vision, "deepstack_visual_indexes", None) or []
    return model_config.get_hidden_size() * (1 + len(deepstack))


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
