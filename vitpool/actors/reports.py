"""Plain data an encoder actor sends back: who it is and what it has done. Importing it loads no
model code and no torch: a pool's callers unpickle these.

A batch's receipt (`BatchReceipt`, `OK`, `RETIRED`) belongs to the transport seam:
`vitpool.transport.link`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vitpool.packing import Budget
from vitpool.specs import ItemRules, OutputLayout

if TYPE_CHECKING:
    from vitpool.transport.channel import ChannelInfo


@dataclass(frozen=True)
class ActorInfo:
    """What an actor reports once its graphs are captured and checked."""

    actor_index: int
    device: str  # "cuda:0 (NVIDIA H200)" or "cpu"
    node_id: str
    gpu_ids: list[str]
    item_rules: ItemRules  # the model's, for callers to check and size items in their process
    budgets: list[Budget]  # every budget, captured or not
    output_layout: OutputLayout  # the tensors each item gets back
    disabled_budgets: list[tuple[int, int]]
    startup_seconds: float  # load, capture and check
    pid: int = 0  # the actor's process
    placement_group_id: str | None = None  # set for an actor colocated in a placement group
    channel: ChannelInfo | None = None  # the same-node fast path, where the actor serves one
    dtype_name: str = ""  # of its outputs, as they travel ("bfloat16", ...)


@dataclass
class ActorStats:
    """Counters of one encoder actor since it started."""

    actor_index: int = 0
    device: str = ""
    batches: int = 0
    items: int = 0
    runs: int = 0  # encoder runs: batches that waited together ran as one
    combined_batches: int = 0  # batches that shared a run with others
    graph_items: int = 0
    eager_items: int = 0
    rejected_items: int = 0  # items whose pixels were not finite
    oom_splits: int = 0  # batches (or halves) split after running out of GPU memory
    padding_waste: float = 0.0  # share of budgeted rows that were padding
    busy_seconds: float = 0.0  # wall time with at least one batch running
    uptime_seconds: float = 0.0

    @property
    def captures_graphs(self) -> bool:
        """A GPU actor; a CPU actor runs its static forward without capture (no hit rate)."""
        return not self.device.startswith("cpu")

    @property
    def graph_hit_rate(self) -> float:
        encoded = self.graph_items + self.eager_items
        return self.graph_items / encoded if encoded else 0.0

    @property
    def utilization(self) -> float:
        return self.busy_seconds / self.uptime_seconds if self.uptime_seconds else 0.0

    def busy_fraction_since(self, earlier: ActorStats | None) -> float | None:
        """The share of the time since `earlier` (this actor's stats read before; None: since it
        started) that it had a batch running, at most 1; None where its uptime did not advance.
        What the autoscaler decides on and the metrics export, each against its own last reading."""
        busy_before, uptime_before = (earlier.busy_seconds, earlier.uptime_seconds) if earlier else (0.0, 0.0)
        if self.uptime_seconds <= uptime_before:
            return None
        return min(1.0, (self.busy_seconds - busy_before) / (self.uptime_seconds - uptime_before))


@dataclass(frozen=True)
class StandbyState:
    """What a warm standby holds once ready (`vitpool.actors.standby`)."""

    seconds: float  # from its start to ready: imports, checkpoint read, and the build if ahead
    built_ahead: bool  # its encoder is built and captured: a take-over is a switch
    device: str  # where it built ("cuda:0", "cpu"); "" without an encoder
    gpu_ids: list[str]  # the node's GPUs it built on (shared with the actor that runs there)
    device_bytes: int  # GPU memory its process holds for that encoder (0 on a CPU or without one)
