"""An encoder's settings as plain values (its options, its checkpoint, its actor's serving) and the
one check of each setting, shared by an in-process encoder, a pool and the command line.

Plain Python, like `vitpool.specs`: a pool's caller builds and checks these without torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from vitpool.errors import ConfigError
from vitpool.packing import SEQUENCES, Needs, make_budgets
from vitpool.packing.budgets import check_token_budgets


def capacity_limits(max_frames_per_batch: int | None, limits: Mapping[str, int] | None) -> dict[str, int]:
    """The user's per-batch bounds by capacity name: `limits`, with `max_frames_per_batch` (the
    long-standing setting) as the bound on attention sequences."""
    merged = dict(limits or {})
    if max_frames_per_batch is not None:
        merged[SEQUENCES] = max_frames_per_batch
    return merged


def check_capacity_limits(limits: Mapping[str, int], capacities: Sequence[str]) -> None:
    """ValueError for a bound on a capacity the model does not have, or one that is not positive."""
    for name, value in limits.items():
        if name not in capacities:
            setting = "max_frames_per_batch" if name == SEQUENCES else f"capacity_limits[{name!r}]"
            raise ValueError(
                f"{setting}: this model bounds no {name!r} per batch; its capacities are {tuple(capacities)}"
            )
        check_int(f"capacity_limits[{name!r}]", value)  # a ConfigError, which is a ValueError


def check_int(name: str, value: Any, *, minimum: int = 1, counts: str = "", none: str | None = None) -> None:
    """The one check of an integer setting, an encoder's option's or a pool's: a ConfigError naming
    `name` unless `value` is an int of at least `minimum` (a bool is not one, though True == 1 in
    Python), or None where `none` says what None means.

    Args:
        counts: what the integer counts, for the message ("output tokens": "a positive number of
            output tokens"); "": "a positive integer".
        none: what None means, where the setting may be None ("no bound"); None: it may not.
    """
    if value is None and none is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = f"number of {counts}" if counts else "integer"
        if minimum == 1:
            what = f"a positive {kind}"
        else:
            what = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} >= {minimum}"
        if none is not None:
            what += f" or None ({none})"
        raise ConfigError(f"{name} must be {what}; got {value!r}")


def check_bool(name: str, value: Any, none: str | None = None) -> None:
    """The one check of a True/False setting: a ConfigError naming `name` unless `value` is True or
    False, or None where `none` says what None means (1 and "yes" are refused: a mistake here)."""
    if value is None and none is not None:
        return
    if not isinstance(value, bool):
        either = "True or False" if none is None else f"True, False or None ({none})"
        raise ConfigError(f"{name} must be {either}; got {value!r}")


def _limit_pairs(limits: Any) -> Needs:
    """Capacity limits (a mapping, or pairs) as sorted (name, limit) pairs, each limit a positive
    integer; which names the model has is checked by the encoder, which knows the model."""
    if limits is None:
        return ()
    pairs = limits.items() if isinstance(limits, Mapping) else limits
    try:
        checked = tuple(sorted((str(name), value) for name, value in pairs))
    except (TypeError, ValueError):
        raise ConfigError(
            f"capacity_limits must map capacity names to limits, e.g. {{'windows': 64}}; got {limits!r}"
        ) from None
    for name, value in checked:
        check_int(f"capacity_limits[{name!r}]", value)
    return checked


# What an encoder's `attention` option takes (see `EncoderOptions`): "auto" picks per batch.
ATTENTION_CHOICES = ("auto", "cudnn", "fa2", "fa4")
# What an encoder's `precision` option takes: "fp8" runs the blocks' GEMMs in FP8 on a GPU.
PRECISION_CHOICES = ("bf16", "fp8")
# What an encoder's `dtype` option takes, by name (`vitpool.dtypes` turns a name into torch's).
DTYPE_CHOICES = ("bfloat16", "float16", "float32")

# The default bound on one item's output tokens, a pool's and an in-process encoder's
# (`max_item_tokens`): the most any supported family's released processor settings give one image.
# Qwen2-VL / Qwen2.5-VL (max_pixels 16384·28·28) and Qwen3-VL / Qwen3.5 (longest_edge 16384·32·32)
# resize an image to at most 65 536 patches, 16 384 tokens; GLM-4.1V's processor stops at 15 000,
# Qwen3-VL's videos at 12 288, Kimi-K2.5's images at 4 096, PaddleOCR-VL's at about 3 000. So no
# image a processor made is refused, while an item built by mistake (a raw frame, a grid off by a
# factor) is refused before it runs instead of holding an encoder for minutes or exhausting its
# memory (an item 100x the largest default budget, 102 400 tokens, failed in an actor's allocator
# in bf16; in-process on a CPU it ran 19.5 s, then asked for 156 GiB at once). Longer videos
# (Qwen2-VL-style total pixel budgets) can pass it: raise the bound, or set None.
DEFAULT_MAX_ITEM_TOKENS = 16384
# With no budgets given, the item bound is checked against a budget this large: the defaults
# depend on the device and the family, which are not known here (the encoder checks them again).
_ANY_BUDGET_TOKENS = 1 << 30
# The largest token budget a pool captures. Each actor allocates every budget's static buffers
# before it takes work (pixel rows alone: budget x merge² rows of C·T·P·P values, 24 KiB a token in
# float32 for Qwen3-VL), so a mistyped budget fails only inside the actor, after its start
# (5 000 000 tokens ask 122 GB). 65 536 tokens is 4x the largest item a processor makes
# (DEFAULT_MAX_ITEM_TOKENS) and 64x the largest default GPU budget (GRAPH_MAX_TOKENS); graphs stop
# paying long before (a larger item runs eager at its own rows), so no useful budget is refused.
MAX_BUDGET_TOKENS = 4 * DEFAULT_MAX_ITEM_TOKENS
# A pool given no budgets captures its device's defaults, from 64 tokens on a GPU: its batch bounds
# are checked against that budget.
SMALLEST_DEFAULT_BUDGET = 64
# What vitpool computes on: an encoder takes "cuda:N" too (`check_device`).
DEVICES = ("cuda", "cpu")


def check_budgets(
    budgets: Any, max_items_per_batch: Any, max_frames_per_batch: Any = None, in_pool: bool = False
) -> tuple[int, ...] | None:
    """Every bound on the budget settings, checked here and nowhere else before the model is known
    (an encoder's options, a pool's settings and `vitpool serve --budgets` call it; the family's
    rules check the budgets against the model as the encoder is built): budgets, a non-empty list
    of distinct positive token counts, and the item bound, at most the smallest budget
    (`vitpool.packing.check_token_budgets`); the frame bound, a positive integer or None.

    `in_pool`: a pool's settings, whose mistakes would otherwise cost an actor start (each actor
    allocates every budget's buffers as it starts): also each budget at most MAX_BUDGET_TOKENS; with
    no budgets, the bounds checked against the smallest a pool captures by default
    (SMALLEST_DEFAULT_BUDGET); and the frame bound at least the item bound (every item has a frame).

    Returns:
        the budgets as a tuple (None: the defaults).

    Raises:
        ConfigError: naming the setting and what to change.
    """
    if budgets is not None:
        try:
            budgets = tuple(budgets) if not isinstance(budgets, (str, bytes)) else None
        except TypeError:
            budgets = None
        if budgets is None:
            raise ConfigError("budgets must be a list of token budgets, e.g. [64, 256], or None (defaults)")
    smallest_default = SMALLEST_DEFAULT_BUDGET if in_pool else _ANY_BUDGET_TOKENS
    tokens = [smallest_default] if budgets is None else list(budgets)
    try:
        check_token_budgets(tokens, max_items_per_batch)
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from None
    check_int("max_frames_per_batch", max_frames_per_batch, none="the family's default")
    if not in_pool:
        return budgets
    if budgets is not None and max(budgets) > MAX_BUDGET_TOKENS:
        raise ConfigError(
            f"budgets: {max(budgets)} tokens is above the largest budget a pool captures "
            f"({MAX_BUDGET_TOKENS} tokens, MAX_BUDGET_TOKENS); budgets count output tokens, not patches "
            "or pixels"
        )
    try:
        make_budgets(tokens, max_items_per_batch, max_frames_per_batch)  # the frame bound against the items'
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return budgets


def check_device(device: Any, in_pool: bool = False) -> None:
    """The one rule for the `device` setting: None (the current GPU if there is one), "cuda",
    "cuda:N" (GPU N) or "cpu".

    `in_pool`: a pool's settings, which take no "cuda:N": a pool places each actor on a GPU itself
    (Ray gives an actor its own, the only one it sees, as cuda:0), so an index would name a GPU the
    actor does not have, or the same one in every actor.

    Raises:
        ConfigError: any other value, saying what to give instead.
    """
    if device is None or device in DEVICES:
        return
    kind, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    if kind == "cuda" and index.isascii() and index.isdigit():
        if not in_pool:
            return
        raise ConfigError(
            f"device {device!r}: a pool places each actor on a GPU of its own (Ray gives it one), so a "
            "pool takes no GPU index; use device='cuda' (or None), and choose the GPUs through "
            "actor_options (num_gpus), placement_group= or the cluster's CUDA_VISIBLE_DEVICES"
        )
    use = (
        "None (the actor's GPU if any), 'cuda' or 'cpu'"
        if in_pool
        else "'cuda', 'cuda:N' (GPU N), 'cpu' or None (the current GPU if any)"
    )
    raise ConfigError(f"device {device!r} is not a torch device vitpool runs on; use {use}")


@dataclass(frozen=True, kw_only=True)
class EncoderOptions:
    """How a `GraphEncoder` captures and runs its tower: the one place its options are written
    out, documented and checked (`GraphEncoder(adapter, **options)`,
    `GraphEncoder.from_pretrained(path, **options)`; a pool's `PoolSettings` has them too).
    Plain values only, so that a pool's caller builds and checks them without torch.

    Attributes:
        budgets: token budgets (output tokens per batch) to capture. None: the family's budget
            range where its adapter states one (`budget_range`), else derived from the device
            (a ladder up to `GRAPH_MAX_TOKENS` = 1536 tokens on a GPU, larger batches run eager
            at their own rows; up to 1024 on a CPU).
        max_items_per_batch: most items in one batch (default min(32, smallest budget)).
        max_frames_per_batch: for families with one attention sequence per frame (or tile), most
            sequences (video frames / temporal patches / tiles) in one batch (default 64); it
            sizes `cu_seqlens`. The long-standing name of `capacity_limits["sequences"]`.
        capacity_limits: most per batch of other capacities the family declares, by name (its
            item rules' `capacities`, e.g. {"windows": 64}); kept as sorted (name, limit) pairs.
            Empty: the family's defaults. A bound on a capacity the model lacks is a ConfigError.
        device: "cuda", "cuda:N" or "cpu" (`check_device`). None: the current GPU if there is one.
        dtype: the compute dtype, "bfloat16", "float16" or "float32" (`GraphEncoder` also takes
            a torch dtype). None: bfloat16 on a GPU, float32 on a CPU.
        attention: the attention kernel on a GPU (`vitpool.kernels.attention`). "auto" (default):
            FlashAttention-4 where the optional `flash-attn-4` package is installed and the GPU
            is Hopper or newer, for graphs and eager batches whose sequences are long; cuDNN's
            fused attention over the packed sequences (the cuDNN frontend, installed with
            vitpool on Linux) for the rest on Hopper or newer; FlashAttention-2 (`varlen_attn`)
            where neither runs. "cudnn": packed cuDNN always (ConfigError where it cannot run).
            "fa2": FlashAttention-2 always (debugging, the path before packed cuDNN). "fa4":
            FlashAttention-4 always (ConfigError where it cannot run). A tower whose head size
            cuDNN cannot take (not a multiple of 8, or over 128) runs FA2 instead.
        fused_ops: on a GPU, run every family's rotary embedding as one Triton kernel per tensor,
            its patch embedding as a GEMM, and the first bias and tanh GELU of its two-layer MLPs
            in the GEMM's epilogue (`vitpool.kernels.fused`). False: Hugging Face's own code
            (debugging).
        compiled_blocks: on a GPU, run the tower's repeated blocks through one `torch.compile` per
            block class (`vitpool.kernels.compiled`), before capture, so the graphs replay fused
            elementwise kernels. False (default): no compile (debugging, faster first start).
        compile_cache_dir: where compiled kernels are kept between starts, shared by the actors of
            a node (a pool's: on each actor's node). None: TORCHINDUCTOR_CACHE_DIR if set, else
            ~/.cache/vitpool/inductor.
        urgent_tokens: the urgent lane, for batches of at most this many output tokens: on a GPU,
            for a one-path family, a second copy of the buffers and graphs of the budgets up to
            the smallest one of at least this many tokens (`start_plans(..., urgent=True)`), and
            the larger budgets captured in segments of a few blocks (`vitpool.graphs.segments`).
            One thread queues both lanes' work; an urgent batch goes between two segments of the
            run being queued, so it waits for the few segments already on the GPU, not for the
            large runs. Costs those graphs' capture time and memory. In a pool, each actor sends
            its batches of at most this many tokens to the lane: under load that cut the small
            calls' median and p99 sharply, but cost a few percent of saturated throughput and
            raised the medium calls' p99 (benchmarks/RESULTS.md, "Small calls under load"); 256,
            the pool's `small_first_tokens`, is the size measured. None (default): no urgent lane.
        precision: the GEMMs' precision, "bf16" or "fp8" (an opt-in to try, on a GPU of compute
            capability 8.9 or newer). "bf16" (default): every GEMM in `dtype`. "fp8": in bfloat16,
            the Linears of the tower's blocks run as FP8 GEMMs (per-row activation and per-channel
            weight scales, `vitpool.kernels.fp8`); attention, the patch embedding and the
            projector stay bf16. Each graph is still checked against the eager
            forward of the same precision. ConfigError elsewhere, with `compiled_blocks`, and for
            a family whose adapter refuses it (`fp8_refused`: DeepSeek-OCR-2). No faster than
            bf16 with torch 2.11 (benchmarks/RESULTS.md, "FP8 GEMMs").
        max_item_tokens: the largest item (output tokens) a call may carry; a larger one is an
            InvalidItemError naming its index, before any work (in a pool: in the caller). Default
            16384 (`DEFAULT_MAX_ITEM_TOKENS`): the most a supported family's processor gives one
            image at its released settings; raise it for longer videos. None: no bound (an item
            too large for the device's memory is still refused on its own, once it has run out
            of memory).

    Raises:
        ConfigError: a value of the wrong kind or out of range, naming the option. What needs
            the model or the device (budgets against the family's rules, a capacity's name, "fa4"
            and "fp8" on this GPU) is checked by the encoder as it is built.
    """

    budgets: tuple[int, ...] | None = None
    max_items_per_batch: int | None = None
    max_frames_per_batch: int | None = None
    capacity_limits: Needs = ()
    device: str | None = None
    dtype: str | None = None
    attention: str = "auto"
    fused_ops: bool = True
    compiled_blocks: bool = False
    compile_cache_dir: str | None = None
    urgent_tokens: int | None = None
    precision: str = "bf16"
    max_item_tokens: int | None = DEFAULT_MAX_ITEM_TOKENS

    # Whether these are a pool's settings (`PoolSettings`), whose budget and device rules are
    # narrower (`check_budgets`, `check_device`); each option is still checked once, here.
    _IN_POOL: ClassVar[bool] = False

    def __post_init__(self) -> None:
        budgets = check_budgets(
            self.budgets, self.max_items_per_batch, self.max_frames_per_batch, in_pool=self._IN_POOL
        )
        object.__setattr__(self, "budgets", budgets)
        object.__setattr__(self, "capacity_limits", _limit_pairs(self.capacity_limits))
        check_device(self.device, in_pool=self._IN_POOL)
        if self.dtype is not None:
            name = str(self.dtype).removeprefix("torch.")
            if name not in DTYPE_CHOICES:
                raise ConfigError(
                    f"dtype {self.dtype!r} is not supported; use one of {DTYPE_CHOICES} (or None for the "
                    "device's default)"
                )
            object.__setattr__(self, "dtype", name)
        if self.attention not in ATTENTION_CHOICES:
            raise ConfigError(f"attention {self.attention!r} is not one of {ATTENTION_CHOICES}")
        if self.precision not in PRECISION_CHOICES:
            raise ConfigError(f"precision {self.precision!r} is not one of {PRECISION_CHOICES}")
        if self.precision == "fp8" and self.compiled_blocks is True:
            raise ConfigError("precision 'fp8' runs outside torch.compile: use it with compiled_blocks=False")
        for name in ("fused_ops", "compiled_blocks"):
            check_bool(name, getattr(self, name))
        if self.compile_cache_dir is not None:
            object.__setattr__(self, "compile_cache_dir", str(self.compile_cache_dir))
        check_int("urgent_tokens", self.urgent_tokens, counts="output tokens", none="no urgent lane")
        check_int("max_item_tokens", self.max_item_tokens, counts="output tokens", none="no bound")


@dataclass(frozen=True, kw_only=True)
class EncoderSpec(EncoderOptions):
    """What an actor's `GraphEncoder` is built from (`GraphEncoder.from_spec`): its checkpoint
    and its options. `EncoderActor` gets it inside its `ActorSpec`.

    Attributes:
        model: local checkpoint directory. None: the tiny model shipped with vitpool.
    """

    model: str | None = None

    def __post_init__(self) -> None:
        if self.model is not None:
            object.__setattr__(self, "model", str(self.model))
        super().__post_init__()

    def options(self) -> EncoderOptions:
        """The encoder's options, without the checkpoint."""
        return EncoderOptions(**{f.name: getattr(self, f.name) for f in fields(EncoderOptions)})


@dataclass(frozen=True)
class ActorSpec:
    """What an `EncoderActor` is built from, besides its index in the pool.

    Attributes:
        encoder: its encoder.
        num_threads: torch's CPU threads (Ray starts actors with OMP_NUM_THREADS=1).
        serve_channel: also take batches from same-node callers through shared memory.
        channel_spin_s: after answering on the channel, poll this long for the next batch.
        max_tokens_per_run: the most output tokens of batches combined into one run; None: the
            largest budget.
        overlap_runs: queue the next run on the device before collecting the one in flight.
        small_first_tokens: run waiting batches of at most this many tokens first
            (`vitpool.actors.combining`); None: oldest first.
        embedding_cache: the pool's embedding cache actor (`vitpool.pool.embedding_cache`), to
            which the actor publishes the results of plans that carry cache keys; None: no cache.
    """

    encoder: EncoderSpec = EncoderSpec()
    num_threads: int = 1
    serve_channel: bool = True
    channel_spin_s: float = 0.0
    max_tokens_per_run: int | None = None
    overlap_runs: bool = True
    small_first_tokens: int | None = None
    embedding_cache: Any = None
