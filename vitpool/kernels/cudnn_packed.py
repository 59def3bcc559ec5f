"""cuDNN's fused attention over packed sequences: the cuDNN frontend's SDPA on THD tensors with
ragged offsets, Hopper's flash kernel for many sequences in one call.

q, k and v are [rows, heads, head_dim] (rows of one sequence after another, as the towers' packed
path hands them over); the sequences are the batch's `cu_seqlens`. The kernel reads each
sequence's start (its ragged offset) and length from device tensors derived from `cu_seqlens` on
the device, so a call never synchronises with the host and captures into a CUDA graph. What the
host must know is the graph's shape: the number of sequences and a bound on their length. A plan
is built for each such shape once (the first call; for a budget's graph, its capture at startup)
and kept; eager batches round both up (`bucketed_shape`) so that their plans stay few.

Where a caller names the kernel it would run instead (`rival`), the first call of a plan outside a
capture times both on that call's own inputs, and a plan slower than its rival declines from then
on: a small graph sized for many sequences (a 224² image in a budget of 64 slots) spends more on
cuDNN's empty slots than FA2 does. The verdict is per shape and kept, so a graph's capture and its
check, and every eager batch of the shape, agree.

Empty sequences (repeated `cu_seqlens` entries: a budget's unused sequence slots) are allowed;
every row inside [cu_seqlens[0], cu_seqlens[-1]) is written.

The frontend (`nvidia-cudnn-frontend`) loads the cuDNN library that torch ships; it does not
import without one (a CPU-only torch), so everything here is imported lazily and
`cudnn_packed_available` says whether it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# cuDNN's fused attention takes head sizes that are multiples of 8 up to 128 (Hopper, bf16/fp16)
MAX_HEAD_DIM = 128
# Eager batches: plans for sequence counts and length bounds rounded up to powers of two (lengths
# at least this many rows), so that a stream of varied batches reuses a few plans. A loose bound
# costs little: the kernel's tiles past a sequence's end exit at once.
MIN_LENGTH_BUCKET = 512
# For shapes of little parallelism (one sequence over few heads) cuDNN picks an engine that splits
# the keys and needs a workspace of megabytes; its capture failed on an H200 (a cudaMemsetAsync
# after an error inside the capture). Plans of the towers' shapes need a few KB. Larger: not used.
MAX_WORKSPACE_BYTES = 1 << 20
# The race between a plan and its rival: calls of each, after one of each to warm up
RACE_CALLS = 5
_DTYPES = (torch.float16, torch.bfloat16)
# Within one forward (`one_forward`): what a plan reads besides q, k and v (the boundaries widened
# to the plan's count, the lengths, the ragged offsets), derived from `cu_seqlens` once and reused
# by every layer; inside a graph, computed once per replay. Recomputed per layer, these small
# kernels cost the smallest images a visible share of their time (`benchmarks/HISTORY.md`, "Packed
# cuDNN attention by default"). Each entry holds its
# `cu_seqlens` tensor, so that its memory cannot be handed to other boundaries during the forward.
_DERIVED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("vitpool_cudnn_derived", default=None)


@dataclass(frozen=True)
class _PlanKey:
    device: int
    dtype: torch.dtype
    sequences: int
    max_length: int
    heads: int
    head_dim: int
    strides: tuple[tuple[int, int], ...]  # (row, head) strides of q, k, v
    scale: float


class _Plan:
    """One built cuDNN graph: its tensors' handles and its workspace size."""

    def __init__(self, cudnn: Any, handle: Any, key: _PlanKey) -> None:
        io_type = cudnn.data_type.BFLOAT16 if key.dtype == torch.bfloat16 else cudnn.data_type.HALF
        graph = cudnn.pygraph(
            io_data_type=io_type,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        b, s, h, d = key.sequences, key.max_length, key.heads, key.head_dim

        def packed(name: str, row_stride: int, head_stride: int) -> Any:
            # (b, h, s, d) over THD memory: the batch stride is unused (ragged offsets place
            # each sequence), rows and heads keep the tensor's own strides
            return graph.tensor(
                name=name,
                dim=[b, h, s, d],
                stride=[s * row_stride, head_stride, row_stride, 1],
                data_type=io_type,
            )

        def ints(name: str, length: int, dtype: Any) -> Any:
            return graph.tensor(name=name, dim=[length, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype)

        (q_rows, q_heads), (k_rows, k_heads), (v_rows, v_heads) = key.strides
        self.q, self.k, self.v = (
            packed("q", q_rows, q_heads),
            packed("k", k_rows, k_heads),
            packed("v", v_rows, v_heads),
        )
        offset_type = cudnn.data_type.INT64
        self.q_offsets = ints("q_offsets", b + 1, offset_type)
        self.k_offsets = ints("k_offsets", b + 1, offset_type)
        self.v_offsets = ints("v_offsets", b + 1, offset_type)
        self.o_offsets = ints("o_offsets", b + 1, offset_type)
        self.lengths = ints("lengths", b, cudnn.data_type.INT32)
        self.q.set_ragged_offset(self.q_offsets)
        self.k.set_ragged_offset(self.k_offsets)
        self.v.set_ragged_offset(self.v_offsets)
        out, _ = graph.sdpa(
            name="packed_attention",
            q=self.q,
            k=self.k,
            v=self.v,
            is_inference=True,
            attn_scale=key.scale,
            use_padding_mask=True,
            seq_len_q=self.lengths,
            seq_len_kv=self.lengths,
        )
        out.set_output(True).set_dim([b, h, s, d]).set_stride([s * h * d, d, h * d, 1]).set_data_type(io_type)
        out.set_ragged_offset(self.o_offsets)
        self.out = out
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace_size = graph.get_workspace_size()
        self.faster: bool | None = None  # than the rival it was raced against (None: not raced)


class _Plans:
    """The plans of one process, per device: built once and kept for the process's life. Never
    dropped: cuDNN compiles its fused kernels at run time and a plan owns what it compiled, which
    the graphs captured with it replay; the shapes are few (one per budget, and eager batches'
    rounded shapes)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._plans: dict[_PlanKey, _Plan] = {}
        self._handles: dict[int, Any] = {}
        self.built = 0

    def handle(self, cudnn: Any, device: int) -> Any:
        if device not in self._handles:
            with torch.cuda.device(device):
                self._handles[device] = cudnn.create_handle()
        return self._handles[device]

    def get(self, cudnn: Any, key: _PlanKey) -> tuple[_Plan, Any]:
        """The plan of `key` (built now if new) and its device's handle; hold `lock` while the
        handle is used: its stream is set per call."""
        with self.lock:
            handle = self.handle(cudnn, key.device)
            plan = self._plans.get(key)
            if plan is None:
                with torch.cuda.device(key.device):
                    plan = _Plan(cudnn, handle, key)
                self._plans[key] = plan
                self.built += 1
                logger.debug("cuDNN packed attention: plan %d built for %s", self.built, key)
                if plan.workspace_size > MAX_WORKSPACE_BYTES:
                    logger.info(
                        "cuDNN packed attention: FlashAttention-2 for %d sequences of at most %d rows over "
                        "%d heads (cuDNN's plan asks %d bytes of workspace)",
                        key.sequences,
                        key.max_length,
                        key.heads,
                        plan.workspace_size,
                    )
            return plan, handle


_PLANS = _Plans()


def _frontend() -> Any:
    import cudnn  # the nvidia-cudnn-frontend package

    return cudnn


@functools.lru_cache(maxsize=8)
def cudnn_packed_available(device: torch.device) -> bool:
    """Whether cuDNN's packed attention runs on `device`: a GPU of compute capability 9.0 or newer
    (Hopper: where its ragged layout runs and was measured), the frontend imports, and a small
    packed call gives what SDPA gives. Logged once per device."""
    if device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        logger.info(
            "attention on %s: FlashAttention-2 (cuDNN's packed attention needs compute capability 9.0+)",
            device,
        )
        return False
    try:
        _frontend()
    except Exception as error:  # noqa: BLE001 - a missing or broken optional kernel must not stop the encoder
        logger.info(
            "attention on %s: FlashAttention-2 (the cuDNN frontend does not import: %s)", device, error
        )
        return False
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn((264, 16, 72), device=device, dtype=torch.bfloat16, generator=generator)
            for _ in range(3)
        )
        cu_seqlens = torch.tensor([0, 64, 64, 264], device=device, dtype=torch.int32)
        got = packed_cudnn_attention(q, k, v, cu_seqlens, 200, None)
        if got is None:
            raise RuntimeError("cuDNN's plan for a probe of the towers' shape needs a large workspace")
        for start, end in ((0, 64), (64, 264)):
            expected = torch.nn.functional.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1).float() for t in (q, k, v))
            ).transpose(0, 1)
            error = (got[start:end].float() - expected).abs().max().item()
            if not error < 5e-2:
                raise RuntimeError(f"a probe call is off by {error:.3g}")
    except Exception as error:  # noqa: BLE001
        logger.warning(
            "attention on %s: FlashAttention-2; cuDNN's packed attention failed a probe: %s", device, error
        )
        return False
    logger.info(
        "attention on %s: cuDNN's packed attention (cuDNN %s)", device, torch.backends.cudnn.version()
    )
    return True


@contextlib.contextmanager
def one_forward() -> Iterator[None]:
    """Inside, the tensors derived from each `cu_seqlens` are computed once and shared by every
    call (the layers of one forward, whose boundaries do not change in between)."""
    token = _DERIVED.set({})
    try:
        yield
    finally:
        _DERIVED.reset(token)


def _derived(
    cu_seqlens: torch.Tensor, sequences: int, row_strides: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """(lengths, then one ragged offset tensor per row stride) for the plan's sequence count."""
    cache = _DERIVED.get()
    key = (cu_seqlens.data_ptr(), cu_seqlens.numel(), sequences, row_strides)
    if cache is not None and key in cache:
        return cache[key][1]
    count = cu_seqlens.numel() - 1
    wide = cu_seqlens.to(torch.int64)
    if sequences > count:
        wide = torch.cat((wide, wide[-1:].expand(sequences - count)))
    lengths = (wide[1:] - wide[:-1]).to(torch.int32)
    offsets = {stride: wide * stride for stride in dict.fromkeys(row_strides)}
    derived = (lengths, *(offsets[stride] for stride in row_strides))
    if cache is not None:
        cache[key] = (cu_seqlens, derived)
    return derived


def cudnn_packed_takes(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this head size and dtype."""
    return dtype in _DTYPES and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM


def bucketed_shape(sequences: int, max_length: int) -> tuple[int, int]:
    """An eager batch's plan shape: the sequence count and the length bound up to powers of two
    (the length at least `MIN_LENGTH_BUCKET`)."""
    return _power_of_two(sequences), max(MIN_LENGTH_BUCKET, _power_of_two(max_length))


def _power_of_two(value: int) -> int:
    return 1 << max(0, (max(int(value), 1) - 1).bit_length())


def packed_cudnn_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_length: int,
    scaling: float | None,
    sequences: int | None = None,
    rival: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Attention within each sequence of `cu_seqlens` (1-D int32, on the device) over [rows,
    heads, head_dim] tensors; returns a fresh [rows, heads, head_dim] tensor, or None (the caller
    runs another kernel) where the plan cuDNN picks for this shape needs more than
    `MAX_WORKSPACE_BYTES` of workspace (the same answer for the shape every time, so a graph's
    capture and its check agree), or inside a capture whose stream the handle was not bound to
    before it began (`bind_stream`).

    `max_length` bounds every sequence's length; `sequences` (at least len(cu_seqlens) - 1, the
    default) is the plan's sequence count: the boundaries are extended by empty sequences up to it.
    Both are fixed for a plan, so a caller with varied batches rounds them up (`bucketed_shape`).
    `rival` runs the caller's other kernel on the same inputs: the plan's first call outside a
    capture races it (`RACE_CALLS` each), and a plan that lost returns None from then on.
    """
    rows, heads, head_dim = q.shape
    count = cu_seqlens.numel() - 1
    sequences = count if sequences is None else sequences
    if sequences < count:
        raise ValueError(f"{sequences} plan sequences for {count} in cu_seqlens")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("packed cuDNN attention needs each head's values contiguous")
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    key = _PlanKey(
        _device_index(q.device),
        q.dtype,
        sequences,
        int(max_length),
        heads,
        head_dim,
        tuple((t.stride(0), t.stride(1)) for t in (q, k, v)),
        scale,
    )
    cudnn = _frontend()
    plan, handle = _PLANS.get(cudnn, key)
    if plan.workspace_size > MAX_WORKSPACE_BYTES or plan.faster is False:
        return None
    lengths, q_offsets, k_offsets, v_offsets, o_offsets = _derived(
        cu_seqlens, sequences, (q.stride(0), k.stride(0), v.stride(0), heads * head_dim)
    )
    offsets = {
        plan.lengths: lengths,
        plan.q_offsets: q_offsets,
        plan.k_offsets: k_offsets,
        plan.v_offsets: v_offsets,
        plan.o_offsets: o_offsets,
    }

    def run() -> torch.Tensor | None:
        out = torch.empty((rows, heads, head_dim), device=q.device, dtype=q.dtype)
        workspace = torch.empty((max(plan.workspace_size, 1),), device=q.device, dtype=torch.uint8)
        pack = {plan.q: q, plan.k: k, plan.v: v, plan.out: out, **offsets}
        stream = torch.cuda.current_stream(q.device).cuda_stream
        with _PLANS.lock:
            if getattr(handle, "stream", None) != stream and torch.cuda.is_current_stream_capturing():
                # binding the handle inside a capture failed (`bind_stream` binds it before): decline
                logger.warning(
                    "cuDNN packed attention: the handle is not bound to the capturing stream; FA2 instead"
                )
                return None
            # the handle runs on the stream current now: the capturing stream during a capture
            cudnn.set_stream(handle=handle, stream=stream)
            plan.graph.execute(pack, workspace, handle=handle)
        return out

    if plan.faster is None and rival is not None and not torch.cuda.is_current_stream_capturing():
        plan.faster = _race(run, rival)
        if not plan.faster:
            logger.info(
                "cuDNN packed attention: the other kernel is faster for %d sequences of at most %d rows over "
                "%d heads; it runs there",
                key.sequences,
                key.max_length,
                key.heads,
            )
            return None
    return run()


def _race(ours: Callable[[], object], rival: Callable[[], object]) -> bool:
    """Whether `ours` takes less GPU time than `rival` over `RACE_CALLS` calls each (one of each
    first, to warm up)."""
    ours(), rival()
    elapsed = []
    for function in (ours, rival):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(RACE_CALLS):
            function()
        end.record()
        end.synchronize()
        elapsed.append(start.elapsed_time(end))
    return elapsed[0] <= elapsed[1]


def bind_stream(device: torch.device, stream: torch.cuda.Stream) -> None:
    """Bind the device's cuDNN handle to `stream` now, where a capture on it is about to begin
    (binding inside a capture failed); a later call on that stream finds it bound. Nothing where
    the kernel was never used on the device."""
    with _PLANS.lock:
        handle = _PLANS._handles.get(_device_index(device))
        if handle is None:
            return
        try:
            _frontend().set_stream(handle=handle, stream=stream.cuda_stream)
        except RuntimeError as error:  # the capture's calls then decline to FA2
            logger.warning("cuDNN packed attention: could not bind the capture stream: %s", error)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def plans_built() -> int:
    """How many plans this process has built (startup cost; eager shapes that were new)."""
    return _PLANS.built
