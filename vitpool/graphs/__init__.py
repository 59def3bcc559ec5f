"""GraphEncoder: static buffers per budget, capture, replay, eager fallback."""

from vitpool.graphs.encoder import GraphEncoder
from vitpool.graphs.in_flight import PlansInFlight
from vitpool.graphs.stats import EncoderStats

__all__ = ["EncoderStats", "GraphEncoder", "PlansInFlight"]
