"""A pool's settings: one frozen dataclass, checked when it is made, shared with every caller.

Its first fields are an actor's encoder's (`vitpool.specs.EncoderSpec`: the checkpoint and the
`EncoderOptions`), inherited, so that each is written, documented and checked in one place; the
rest are the pool's own. Each field's flag is made from it here too (`add_pool_setting_flags`:
`vitpool serve`'s, and those of the pool the vLLM gateway launches).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vitpool.errors import ConfigError
from vitpool.pool.autoscaler import checked_bounds
from vitpool.specs import (  # noqa: F401 - DEFAULT_MAX_ITEM_TOKENS, MAX_BUDGET_TOKENS: read from here too
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
    `vitpool.specs.EncoderOptions` (budgets, max_items_per_batch, max_frames_per_batch,
    capacity_limits, device, dtype, attention, fused_ops, compiled_blocks, compile_cache_dir,
    urgent_tokens, precision, max_item_tokens), documented there; every actor's encoder gets them
    (`encoder_spec`). A pool adds to them:

    Attributes:
        budgets: in a pool, at most MAX_BUDGET_TOKENS (65536) tokens each, checked as the settings
            are made (`vitpool.specs.check_budgets`) so that a mistyped budget costs no actor start.
        device: in a pool, None (the actor's GPU if it has one), "cuda" or "cpu": "cpu" runs every
            actor on its CPU even where it was given a GPU (tests, debugging). No "cuda:N": the
            pool gives each actor a GPU of its own (`vitpool.specs.check_device`).
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
            the checkpoint read, holding no GPU (`vitpool.actors.standby`): an actor there that
            dies is replaced by it on the GPU the dead one freed, without the imports that take
            most of a fresh process's start (benchmarks/RESULTS.md, "Startup: build, capture,
            memory"). It costs a process's host memory per node (how much: "Figures the code's
            design rests on", there) and no GPU memory; a node's standby starts after its first
            actor is ready, and again after each take-over. None (the default): on for actors
            given GPUs (`num_gpus` in their options) that run on them, off for CPU actors. Not for
            pools colocated with a placement group.
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
        for name in ("overlap_runs", "same_node_channel", "detached"):
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


# ---- each setting's flag ------------------------------------------------------------------------
# `vitpool serve`'s flags and those of the vLLM gateway's pool: one per field, its help from the
# field's docstring entry, its value parsed by the field's type, so a new setting needs no
# hand-written flag; and the parsers of the values a type cannot describe (budgets, MIN,MAX, NAME=N
# pairs, on/off).


def budget_list(text: str) -> list[int]:
    """`--budgets`: comma-separated token budgets, checked by the pool's own rule
    (`vitpool.specs.check_budgets`: each at most MAX_BUDGET_TOKENS) before anything starts (an
    actor allocates every budget's buffers as it starts).

    Raises:
        argparse.ArgumentTypeError: which budget is wrong and why (argparse names --budgets).
    """
    budgets = []
    for part in text.split(","):
        try:
            budgets.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not a whole number; give output-token budgets such as 64,256,1024"
            ) from None
    try:
        check_budgets(budgets, None, in_pool=True)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return budgets


def autoscale_bounds(text: str) -> tuple[int, int]:
    """`--autoscale`: MIN,MAX actors (the pool checks the bounds themselves)."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use MIN,MAX, e.g. 1,4") from None
    return low, high


def capacity_limit_list(text: str) -> dict[str, int]:
    """`--capacity-limits`: NAME=N pairs, comma-separated, e.g. windows=64 (the model's capacities
    are checked by its actors)."""
    limits = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            limits[name.strip()] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r}: use NAME=N pairs, e.g. windows=64") from None
    return limits


def on_off(text: str) -> bool:
    """A True/False setting's flag value: on or off."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r}: use on or off")
    return text == "on"


# A setting's flag is its name with dashes, but a number of seconds drops its `_s`
# (autoscale_interval_s: --autoscale-interval S); its help is the field's entry in the settings'
# docstrings (PoolSettings, EncoderSpec, EncoderOptions); its value is parsed by the field's type:
# on/off for True/False, a number, a string, and "none" (NONE_GIVEN) for None where None is not
# the default. A flag left out is None in the parsed arguments, and the pool's own default stands.
# What the types cannot say:
SETTING_CHOICES: dict[str, tuple[str, ...]] = {
    "device": POOL_DEVICES,
    "dtype": DTYPE_CHOICES,
    "attention": ATTENTION_CHOICES,
    "precision": PRECISION_CHOICES,
    "rank_transport": RANK_TRANSPORTS,
}
SETTING_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {  # values of several parts: (parser, metavar)
    "budgets": (budget_list, "B,B,..."),
    "autoscale": (autoscale_bounds, "MIN,MAX"),
    "capacity_limits": (capacity_limit_list, "NAME=N,..."),
}
METAVARS = {"_s": "S", "_bytes": "BYTES", "_tokens": "TOKENS"}  # by the name's unit; else N or X
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z(\"'`])")


def setting_flag(name: str) -> str:
    """The flag of setting `name`."""
    return "--" + (name.removesuffix("_s") if name.endswith("_s") else name).replace("_", "-")


def setting_docs(settings_class: type = PoolSettings) -> dict[str, list[str]]:
    """Each field's entries in the `Attributes:` sections of the class's docstring and its
    bases', base first (an entry "a, b: text" documents both)."""
    docs: dict[str, list[str]] = {}
    for klass in reversed(settings_class.__mro__):
        _, _, section = inspect.cleandoc(vars(klass).get("__doc__") or "").partition("\nAttributes:\n")
        names: list[str] = []
        for line in section.splitlines():
            if line and not line.startswith("    "):
                break  # the next section
            if line.startswith("        "):  # an entry's next line
                for name in names:
                    docs[name][-1] += " " + line.strip()
            elif line.strip():
                listed, _, text = line.strip().partition(": ")
                names = [name.strip() for name in listed.split(",")]
                for name in names:
                    docs.setdefault(name, []).append(text)
    return docs


def setting_help(field: dataclasses.Field, entries: Sequence[str], optional: bool) -> str:
    """A flag's help: the first sentence of each docstring entry, then its default where that
    sentence does not say it (for a default of None or empty: what that means, where the entry
    says)."""
    sentences = [SENTENCE_END.split(entry) for entry in entries]
    text = " ".join(each[0].rstrip(".") + "." for each in sentences)
    text = text[:1] + re.sub(
        r"\. ([a-z])", lambda match: ". " + match[1].upper(), text[1:]
    )  # entries start lowercase
    said = [s.partition(": ")[2] for each in sentences for s in each if re.match(r"(None|Empty)\b.*?: ", s)]
    unset = said[0].rstrip(".") if said else ""
    if field.default in (None, ()):
        default = "" if "None" in text or "default" in text else f"(default: {unset or 'None'})"
    elif "default" in text:
        default = f"(none: {unset or 'None'})" if optional else ""
    else:
        shown = ("on" if field.default else "off") if isinstance(field.default, bool) else field.default
        default = f"(default: {shown}; none: {unset or 'None'})" if optional else f"(default: {shown})"
    return f"{text} {default}".strip().replace("%", "%%")


def add_pool_setting_flags(
    parser: argparse.ArgumentParser, leave_out: Collection[str] = (), of: str = ""
) -> None:
    """A flag for every PoolSettings field but those in `leave_out`, in two groups: the encoder's
    options and the pool's own settings (`of`: added to the groups' titles, what the settings
    are for); and a hidden one for each of REMOVED_SETTINGS, refused naming its replacement. Read
    what was given with `given_settings`.

    Raises:
        TypeError: a field of a type no flag parses (a new one goes in SETTING_PARSERS).
    """
    docs = setting_docs()
    hints = typing.get_type_hints(PoolSettings)
    encoder_fields = {field.name for field in dataclasses.fields(EncoderSpec)}
    groups = {
        True: parser.add_argument_group(f"the encoder's options (vitpool.specs.EncoderOptions){of}"),
        False: parser.add_argument_group(f"the pool's settings (vitpool.PoolSettings){of}"),
    }
    for field in dataclasses.fields(PoolSettings):
        if field.name in leave_out:
            continue
        hint = hints[field.name]
        parts = [part for part in typing.get_args(hint) if part is not type(None)]
        optional = typing.get_origin(hint) in (types.UnionType, typing.Union) and len(parts) == 1
        kind = parts[0] if optional else hint
        flag: dict[str, Any] = {
            "dest": field.name,
            "default": None,
            "help": setting_help(field, docs.get(field.name, []), optional),
        }
        if field.name in SETTING_PARSERS:
            flag["type"], flag["metavar"] = SETTING_PARSERS[field.name]
        elif field.name in SETTING_CHOICES:
            flag["choices"] = SETTING_CHOICES[field.name]
        elif kind is bool:
            flag["type"], flag["metavar"] = on_off, "{on,off}"
        elif kind in (int, float, str):
            unit = next(
                (metavar for suffix, metavar in METAVARS.items() if field.name.endswith(suffix)), None
            )
            flag["metavar"] = unit or {int: "N", float: "X", str: field.name.upper()}[kind]
            flag["type"] = _or_none(kind) if optional and field.default is not None else kind
        else:
            raise TypeError(
                f"PoolSettings.{field.name} ({hint}): no flag parses it; add it to SETTING_PARSERS"
            )
        groups[field.name in encoder_fields].add_argument(setting_flag(field.name), **flag)
    for name in REMOVED_SETTINGS:  # hidden: naming one is an error that names its replacement
        parser.add_argument(
            setting_flag(name), nargs="?", action=_Removed, dest=f"removed_{name}", help=argparse.SUPPRESS
        )


class _Removed(argparse.Action):
    """A removed setting's flag (REMOVED_SETTINGS): refused, naming what replaced it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None):
        parser.error(removed_setting(self.dest.removeprefix("removed_"), flag=True))


class _NoneGiven:
    """A flag's value "none": the setting set to None, where a flag left out is None too."""

    def __repr__(self) -> str:
        return "none"


NONE_GIVEN = _NoneGiven()


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, but "none" is NONE_GIVEN."""

    def parse_or_none(text: str) -> Any:
        return NONE_GIVEN if text == "none" else parse(text)

    parse_or_none.__name__ = parse.__name__  # argparse names it in its error: "invalid int value"
    return parse_or_none


def given_settings(args: argparse.Namespace, leave_out: Collection[str] = ()) -> dict[str, Any]:
    """The pool settings that flags of `add_pool_setting_flags` (given the same `leave_out`) set, by
    field name: those given (a flag left out is None, and the pool's own default stands; "none"
    sets None)."""
    given = {
        field.name: getattr(args, field.name, None)
        for field in dataclasses.fields(PoolSettings)
        if field.name not in leave_out
    }
    return {
        name: None if value is NONE_GIVEN else value for name, value in given.items() if value is not None
    }
