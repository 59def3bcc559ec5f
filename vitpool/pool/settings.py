"""A pool's settings: one frozen dataclass, checked when it is made, shared with every caller.

Its first fields are an actor's encoder's (`vitpool.encoder_spec.EncoderSpec`: the checkpoint and the
`EncoderOptions`), inherited, so that each is written, documented and checked in one place; the
rest are the pool's own. Each field's flag is made from it (`vitpool.pool.setting_flags`:
`vitpool serve`'s, and those of the pool the vLLM gateway launches).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vitpool.encoder_spec import (  # noqa: F401 - DEFAULT_MAX_ITEM_TOKENS, MAX_BUDGET_TOKENS: read from here too
    ATTENTION_CHOICES,
    DEFAULT_MAX_ITEM_TOKENS,
    DEVICES,
    DTYPE_CHOICES,
    MAX_BUDGET_TOKENS,
    PRECISION_CHOICES,
    ActorSpec,
    EncoderSpec,
    check_bool,
    check_budgets,
    check_int,
)
from vitpool.errors import ConfigError
from vitpool.pool.autoscaler import checked_bounds

if TYPE_CHECKING:
    from typing_extensions import Self

POOL_DEVICES = DEVICES  # an actor holds one GPU (or none): no "cuda:N" (`check_device`)
RANK_TRANSPORTS = ("nccl", "gloo")
LOCAL_CACHE_BYTES = 256 << 20  # each handle's own tier of the embedding cache, by default
# Settings taken out, by name: (what replaced it, how the old value maps onto it). Naming one, as
# a keyword or a flag, is an error that says so (not Python's bare "unexpected keyword argument").
REMOVED_SETTINGS: dict[str, tuple[str, str]] = {
    # the urgent lane's pool setting in 0.1.0, taken with a DeprecationWarning for that release
    "small_first_stream": (
        "urgent_tokens",
        (
            "an urgent lane for batches of at most N output tokens; the old True / on was N = "
            "small_first_tokens, 256 by default"
        ),
    ),
}


@dataclass(frozen=True, kw_only=True)
class PoolSettings(EncoderSpec):
    """How a pool encodes and dispatches. `EncoderPool.launch` takes these as keyword arguments.

    The encoder's options are fields here too, inherited from `EncoderSpec` (`model`) and
    `vitpool.encoder_spec.EncoderOptions` (budgets, max_items_per_batch, max_frames_per_batch,
    capacity_limits, device, dtype, attention, fused_ops, compiled_blocks, compile_cache_dir,
    urgent_tokens, precision, max_item_tokens), documented there; every actor's encoder gets them
    (`encoder_spec`). A pool adds to them:

    Attributes:
        budgets: in a pool, at most MAX_BUDGET_TOKENS (65536) tokens each, checked as the settings
            are made (`vitpool.encoder_spec.check_budgets`) so that a mistyped budget costs no actor start.
        device: in a pool, None (the actor's GPU if it has one), "cuda" or "cpu": "cpu" runs every
            actor on its CPU even where it was given a GPU (tests, debugging). No "cuda:N": the
            pool gives each actor a GPU of its own (`vitpool.encoder_spec.check_device`).
        max_batches_in_flight_per_actor: batches sent to an actor and not yet answered. Two keep
            a GPU busy: the next batch is already there when one finishes.
        batch_window_s: how long items wait for others to share a batch while every actor is
            busy. Items never wait while an actor is idle.
        actor_threads: torch CPU threads per actor; None: all of the actor's share of the
            node's CPUs on a CPU actor, up to 4 on a GPU actor (host-side work only).
        startup_timeout_s: how long launch and scale wait for actors to load and capture.
        metrics_interval_s: how often the pool's counters are recorded as Ray metrics (exported
            on each node's Prometheus endpoint; `vitpool.pool.metrics` lists them): by a thread of
            each handle and from the controller's reader of the actors, never on a call's path.
            None: no metrics.
        autoscale: (min_actors, max_actors): the controller adds an actor while the actors stay
            busy and retires one while they stay idle (`vitpool.pool.autoscaler`), within these
            bounds, through `scale`; launch starts `min_actors` unless told otherwise. None: the
            pool keeps the actors it is given.
        autoscale_interval_s: how often the autoscaler reads the actors' busy fractions (it
            scales up after 3 busy readings in a row, down after 12 idle ones).
        detached: the pool outlives the process that launched it (its controller is a detached
            Ray actor, and its encoder actors are the controller's); it runs until a handle's
            `shutdown()` (any handle's, or `vitpool stop`). It needs a Ray cluster that outlives
            the launching process (`ray start --head`, or `address=`). False: the pool stops
            when the launching process ends.
        retire_timeout_s: how long a removed actor may take to finish its batches.
        max_attempts_per_item: how often an item is sent again after its actor left or died.
        batch_timeout_s: a batch unanswered for this long counts as failed: its items go to
            another actor and the silent actor is replaced.
        max_actor_restarts: how many dead (or silent) actors the pool replaces over its life.
        warm_standby: keep one process per node of the pool's actors with the engine imported and
            the checkpoint read, holding no GPU in Ray's accounting (`vitpool.actors.standby`): an
            actor there that dies is replaced by it, without the imports that take most of a fresh
            process's start (benchmarks/RESULTS.md, "Startup: build, capture, memory"). It costs a
            process's host memory per node (how much: "Figures the code's design rests on", there),
            and GPU memory with `standby_graphs`; a node's standby starts after its first actor is
            ready, and again after each take-over. None (the default): on for actors given GPUs
            (`num_gpus` in their options) that run on them, off for CPU actors. Not for pools
            colocated with a placement group.
        standby_graphs: a node's warm standby also builds the encoder, its graphs captured and
            checked, as soon as it starts, on the GPU of the ready actor that made it start (the
            node's first, or the one that took over last), beside that actor: a take-over is then
            a switch, the standby serving at once from there; where that was not the dead actor's
            GPU, a fresh actor starts on the freed one and the standby retires when it is ready
            (`vitpool.pool.replacement`). It costs that GPU a second encoder's memory, weights and
            graphs (`StandbyState.device_bytes`; benchmarks/RESULTS.md, "Replacing a killed
            actor"), outside Ray's accounting. False: the standby holds no GPU memory and loads
            and captures at take-over, on the GPU the dead actor freed.
        max_queued_items, max_queued_bytes: bounds on the items (and their pixel bytes) that wait
            in one caller process; a call that would pass them waits for room.
        max_tokens_per_run: the most output tokens that several items share in one replay: the
            dispatcher's batches and an actor's combined runs stop there (a larger item still
            runs, alone). Under load a small call waits behind the run in progress and then its
            own, so shorter runs cut its wait, at some cost in throughput. None: the largest
            budget.
        overlap_runs: an actor queues its next run on the GPU before it collects the run in
            flight, so the GPU does not wait while the host hands out one run's results and
            prepares the next (`vitpool.actors.combining`). False: one run at a time (debugging,
            comparisons).
        small_first_tokens: calls of at most this many output tokens in all are small: their items
            go in batches of their own, which have a lane of `max_batches_in_flight_per_actor`
            extra slots at each actor, and an actor runs waiting batches of at most this many
            tokens first (a batch passed over 4 times goes first, so none waits for ever). So a
            small call does not wait behind large batches queued before it: under load this more
            than halved the small calls' p99 at no cost in saturated throughput
            (benchmarks/RESULTS.md, "Small calls under load"); `urgent_tokens` (the urgent lane, on
            GPU actors) lets small batches interrupt large runs too. None: one lane, oldest first.
        channel_spin_s: on the same-node channel, how long a waiting thread polls before it
            sleeps: an actor after each answer, for the connection's next batch; a caller from
            shortly before its reply is due (learnt from its earlier batches of the same size).
            Each batch costs at most about this much CPU time per side; a thread that sleeps
            instead pays a wake-up (benchmarks/HISTORY.md, "Fourth pass: one call's phases,
            results viewed in place, brief polling (issue 3)"). 0: never poll.
        rank_transport: "nccl" (GPU actors) or "gloo" (CPU actors): the encoder actors can also
            hand a call's embeddings to tensor-parallel ranks over Ray Direct Transport
            (`EncoderPool.deliver_to`; see `vitpool.pool.rank_delivery` for what the ranks need).
            None: deliveries go through the object store.
        same_node_channel: callers on an actor's node send it batches through shared memory and
            a Unix socket instead of Ray's object store (Linux; less time per call:
            benchmarks/RESULTS.md, "Figures the code's design rests on"). Results of `encode_refs`
            always go through the object store.
        embedding_cache_bytes: bound on the pool's embedding cache (`vitpool.pool.embedding_cache`),
            shared by every caller of the pool: an item whose content (pixels, grid, model, dtype)
            was encoded before is served from it. Least recently used entries go first. 0 (the
            default): off, since each call then pays a round trip to the cache's actor, more than
            the pool's whole cost per call on a small image, which a workload without repeats
            would pay for nothing.
        embedding_cache_local_bytes: with the cache on, bound on what each handle keeps of it in
            its own process (what it served or encoded), served without asking the shared cache.
            None (the default): the smaller of `embedding_cache_bytes` and 256 MiB; 0: none.
    """

    max_batches_in_flight_per_actor: int = 2
    batch_window_s: float = 0.002
    actor_threads: int | None = None
    startup_timeout_s: float = 900.0
    detached: bool = False
    autoscale: tuple[int, int] | None = None
    autoscale_interval_s: float = 5.0
    metrics_interval_s: float | None = 5.0
    retire_timeout_s: float = 120.0
    max_attempts_per_item: int = 3
    batch_timeout_s: float = 300.0
    max_actor_restarts: int = 3
    warm_standby: bool | None = None
    standby_graphs: bool = True
    max_queued_items: int = 4096
    max_queued_bytes: int = 2 << 30
    max_tokens_per_run: int | None = None
    overlap_runs: bool = True
    small_first_tokens: int | None = 256
    channel_spin_s: float = 0.002
    rank_transport: str | None = None
    same_node_channel: bool = True
    embedding_cache_bytes: int = 0
    embedding_cache_local_bytes: int | None = None

    _IN_POOL = True  # the encoder's options as a pool narrows them: no "cuda:N", bounded budgets

    def __post_init__(self) -> None:
        # the checkpoint and the encoder's options, each checked once there, the budgets and the
        # device by a pool's rules (`check_budgets`, `check_device`: an actor allocates every
        # budget's buffers as it starts, and holds one GPU, or none)
        super().__post_init__()
        if self.precision == "fp8" and self.device == "cpu":
            raise ConfigError("precision 'fp8' needs GPU actors (FP8 tensor cores), not device='cpu'")
        check_bool("warm_standby", self.warm_standby, none="on for GPU actors")
        for name in ("overlap_runs", "same_node_channel", "detached", "standby_graphs"):
            check_bool(name, getattr(self, name))
        for name in ("max_batches_in_flight_per_actor", "max_attempts_per_item", "max_queued_items"):
            check_int(name, getattr(self, name))
        check_int("max_queued_bytes", self.max_queued_bytes, counts="bytes")
        check_int("embedding_cache_bytes", self.embedding_cache_bytes, minimum=0, counts="bytes")
        check_int(
            "embedding_cache_local_bytes",
            self.embedding_cache_local_bytes,
            minimum=0,
            counts="bytes",
            none="the smaller of embedding_cache_bytes and 256 MiB",
        )
        check_int(
            "max_tokens_per_run", self.max_tokens_per_run, counts="output tokens", none="the largest budget"
        )
        check_int(
            "small_first_tokens",
            self.small_first_tokens,
            counts="output tokens",
            none="one lane, oldest first",
        )
        check_int("max_actor_restarts", self.max_actor_restarts, minimum=0)
        _non_negative_seconds("batch_timeout_s", self.batch_timeout_s, positive=True)
        _non_negative_seconds("channel_spin_s", self.channel_spin_s)
        check_int("actor_threads", self.actor_threads, none="all of the actor's CPUs, up to 4 on a GPU actor")
        if self.rank_transport not in (None, *RANK_TRANSPORTS):
            raise ConfigError(
                f"rank_transport {self.rank_transport!r}: use 'nccl' (GPU actors), 'gloo' (CPU actors) or "
                "None"
            )
        if self.rank_transport == "nccl" and self.device == "cpu":
            raise ConfigError(
                "rank_transport='nccl' moves embeddings GPU to GPU; it needs GPU actors, not device='cpu'"
            )
        _non_negative_seconds("batch_window_s", self.batch_window_s)
        _non_negative_seconds("startup_timeout_s", self.startup_timeout_s, positive=True)
        object.__setattr__(self, "autoscale", checked_bounds(self.autoscale))
        _non_negative_seconds("autoscale_interval_s", self.autoscale_interval_s, positive=True)
        if self.metrics_interval_s is not None:
            _non_negative_seconds("metrics_interval_s", self.metrics_interval_s, positive=True)
        _non_negative_seconds("retire_timeout_s", self.retire_timeout_s, positive=True)

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        removed = [name for name in kwargs if name in REMOVED_SETTINGS]
        if removed:
            raise ConfigError(removed_setting(removed[0]))
        return super().__new__(cls)

    def __getattr__(self, name: str) -> Any:  # only for names that are no attribute
        if name in REMOVED_SETTINGS:
            raise AttributeError(removed_setting(name))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def encoder_spec(self) -> EncoderSpec:
        """What each actor's encoder is built from: these settings' `EncoderSpec` fields."""
        return EncoderSpec(
            **{field.name: getattr(self, field.name) for field in dataclasses.fields(EncoderSpec)}
        )

    @property
    def local_cache_bytes(self) -> int:
        """What each handle keeps of the embedding cache in its own process (see the setting)."""
        if self.embedding_cache_local_bytes is not None:
            return self.embedding_cache_local_bytes
        return min(self.embedding_cache_bytes, LOCAL_CACHE_BYTES)

    def uses_warm_standby(self, actor_options: Mapping[str, Any]) -> bool:
        """Whether actors launched with `actor_options` get warm standbys (see `warm_standby`)."""
        if self.warm_standby is not None:
            return self.warm_standby
        return bool(actor_options.get("num_gpus")) and self.device != "cpu"

    def actor_spec(self, num_threads: int) -> ActorSpec:
        """What each encoder actor is built from."""
        return ActorSpec(
            self.encoder_spec(),
            num_threads=num_threads,
            serve_channel=self.same_node_channel,
            channel_spin_s=self.channel_spin_s,
            max_tokens_per_run=self.max_tokens_per_run,
            overlap_runs=self.overlap_runs,
            small_first_tokens=self.small_first_tokens,
        )


def removed_setting(name: str, flag: bool = False) -> str:
    """What to say of removed setting `name` (REMOVED_SETTINGS): that it is gone and what to use,
    as keywords or (`flag`) as `vitpool serve`'s flags."""
    replacement, meaning = REMOVED_SETTINGS[name]
    if flag:
        old, new = setting_flag(name), setting_flag(replacement)
        return f"{old} was removed after vitpool 0.1.0: use {new} N ({meaning})"
    return f"{name} was removed after vitpool 0.1.0: use {replacement}=N ({meaning})"


def _non_negative_seconds(name: str, value: Any, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a number of seconds; got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{name} must be {'positive' if positive else '>= 0'}; got {value!r}")


def setting_flag(name: str) -> str:
    """The flag of setting `name`."""
    return "--" + (name.removesuffix("_s") if name.endswith("_s") else name).replace("_", "-")
