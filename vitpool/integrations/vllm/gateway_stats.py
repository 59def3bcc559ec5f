"""What the vLLM gateway counts of the requests it serves: images encoded, reused or left to vLLM,
and the time spent in each phase of a request (served at `/vitpool/stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PhaseTimes:
    """Seconds spent per phase over all requests (each request's phases, summed)."""

    receive: float = 0.0  # reading and parsing the body, decoding and hashing the images
    process: float = 0.0  # the image processor
    encode: float = 0.0  # waiting for the pool
    publish: float = 0.0  # asking what is published; laying out and publishing the embeddings
    forward: float = 0.0  # from sending the request upstream to the end of its answer


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
