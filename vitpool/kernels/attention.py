"""The attention hook vitpool installs in Hugging Face towers, and the choice of kernel behind it.

The name contains "flash" so that the towers take their packed-sequence path: they pass
`cu_seq_lens_q/k` and an integer `max_length_q/k` instead of splitting sequences on the host.
On a CPU (fp32) it runs SDPA with a block-diagonal mask built from `cu_seqlens`. On CUDA in half
precision it runs one of these kernels (all free of host synchronisation, so all capturable):

- CUDNN_PACKED: cuDNN's fused attention over the packed sequences, through the cuDNN frontend
  (`vitpool.kernels.cudnn_packed`; Hopper and newer, head sizes multiples of 8 up to 128). It is
  Hopper's flash kernel for many sequences in one call: the default wherever it runs, in every
  budget's graph and in eager batches, except for shapes where FA2 wins the race each shape's
  plan runs against it once (small graphs sized for many sequences). User choice "cudnn"
  (CUDNN_PACKED_ONLY: no race);
- "fa2": PyTorch's own FlashAttention-2, `varlen_attn` (always there: the fallback);
- "cudnn": SDPA's cuDNN kernel, dense, for the GPUs and installs without the packed form
  (`vitpool.kernels.dense_cudnn`). It has no packed form that can be captured, a padding mask
  takes its gain away, and it builds a plan for every new shape, too slow for a call's path. So
  it runs where one dense call serves a whole sequence: in an eager batch, whose boundaries are
  known on the host, one call per long sequence, padded to a multiple of `DENSE_BUCKET_ROWS` rows
  so that the plans stay few (`dense_attention`); and in a budget's second graph, for a batch of
  one sequence and its padding (`LEADING_SEQUENCE`, `leading_sequence_attention`). Padding keys
  are masked by one extra head dimension, not by a mask tensor;
- "fa4": FlashAttention-4 (the optional `flash-attn-4` package, CuTe DSL; Hopper and newer). At
  the towers' head size 72 it is much faster than FA2 on long sequences but slower on many short
  ones.

The encoder picks per graph (`use_attention` around capture: FA4 for graphs whose sequences
may be long where it is installed, packed cuDNN for the rest, FA2 where neither runs, and dense
cuDNN for the second graph `wants_dense_graph` asks for only on that FA2 fallback) and, for an
eager run at the items' own size, lets the hook pick from the batch's boundaries, which it
declares on the host with `host_boundaries` (`benchmarks/studies/packed_attention.py`,
`attention_backends.py` and `dense_attention.py` measure them; figures: `benchmarks/HISTORY.md`,
"Packed cuDNN attention by default" and the sections it follows).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from vitpool.kernels.compiled import install_compiled_blocks
from vitpool.kernels.cudnn_packed import (
    bucketed_shape,
    cudnn_packed_available,
    cudnn_packed_takes,
    one_forward,
    packed_cudnn_attention,
)
from vitpool.kernels.dense_cudnn import DENSE_BUCKET_ROWS, dense_attention, leading_sequence_attention
from vitpool.kernels.fused import install_fused_ops
from vitpool.kernels.scoped import scoped_value

if TYPE_CHECKING:
    from vitpool.specs import TensorSpec

logger = logging.getLogger(__name__)

ATTENTION_NAME = "vitpool_flash_varlen"
# FA4 wins on long sequences and loses on short ones, so a graph takes it only from this many rows
# per sequence it may hold (a few-sequence variant from 544 tokens: 2176 rows in at most 4
# sequences). An eager batch pays FA4's host-side set-up again at each new size
# (`benchmarks/studies/new_sizes.py`): from FA4_MIN_ROWS_PER_SEQUENCE rows per sequence FA4 wins
# every call at a size seen before and loses only the first call at a new size, up to a side
# measured in benchmarks/HISTORY.md, "Compiled blocks, eager FA4 threshold, same-run parts off /
# on". Sizes repeat in real traffic (a processor's resize targets), so the threshold favours the
# repeat.
FA4_MIN_ROWS_PER_GRAPH_SEQUENCE = 512
FA4_MIN_ROWS_PER_SEQUENCE = 4096
# An eager batch whose sequences are all at least this long (and at most CUDNN_MAX_SEQUENCES of
# them) runs cuDNN, one call per sequence, where FA4 is not taken. For one eager call cuDNN's padded
# path loses to FA2 on short sequences, where its extra launches weigh most, and wins more the
# longer they get (`benchmarks/studies/dense_attention.py`; benchmarks/HISTORY.md, "Attention where
# compute dominates: cuDNN on the default install").
CUDNN_MIN_ROWS_PER_SEQUENCE = 2048
CUDNN_MAX_SEQUENCES = 16
# the extra head dimension must keep cuDNN's head size at 128 or below (GLM's 128 stays on FA2)
CUDNN_MAX_HEAD_DIM = 120
# A graph of this many rows or more gets a second capture for batches of one sequence (an image)
# and padding: cuDNN over all its rows, the padding keys masked (`leading_sequence_attention`). Its
# cost grows with rows², FA2's with the sequence's: the dense graph wins where the sequence fills
# DENSE_MIN_FILL of the rows (at cuDNN's measured speed-up over FA2 they break even just above it,
# HISTORY.md as above; FA2 also pays for the padding's own sequence).
DENSE_GRAPH_MIN_ROWS = 1024
DENSE_MIN_FILL = 0.8
LEADING_SEQUENCE = "leading_sequence"  # the backend of such a graph
CUDNN_PACKED = (
    "cudnn_packed"  # cuDNN's fused attention over the packed sequences, where it wins its race with FA2
)
CUDNN_PACKED_ONLY = "cudnn_packed_only"  # the same without the race: the user's choice "cudnn"
# While recording (capture): the memory of the boundaries each leading-sequence call read
_LEADING_SEQUENCE_READS: contextvars.ContextVar[list[tuple[int, int]] | None] = contextvars.ContextVar(
    "vitpool_leading_sequence_reads", default=None
)

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
# The kernel the batch running now must use ("fa2", "fa4", LEADING_SEQUENCE); None: the hook decides
_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("vitpool_attention", default=None)
# (data_ptr, numel) of a device tensor -> its values, for the 1-D int32 metadata of the batch
# running now (eager only)
_KNOWN_BOUNDARIES: contextvars.ContextVar[dict[tuple[int, int], tuple[int, ...]] | None] = (
    contextvars.ContextVar("vitpool_known_boundaries", default=None)
)


@functools.lru_cache(maxsize=8)
def fa4_available(device: torch.device) -> bool:
    """Whether FlashAttention-4 can run on `device`: the package imports and the GPU is Hopper
    (compute capability 9.0) or newer. Logged once per device."""
    if device.type != "cuda":
        return False
    major, _ = torch.cuda.get_device_capability(device)
    if importlib.util.find_spec("flash_attn") is None:
        logger.info("attention on %s: FlashAttention-2 (flash-attn-4 is not installed)", device)
        return False
    try:
        importlib.import_module("flash_attn.cute")
    except Exception as error:  # noqa: BLE001 - a broken optional install must not stop the encoder
        logger.warning("attention on %s: FlashAttention-2; flash-attn-4 does not import: %s", device, error)
        return False
    if major < 9:
        logger.info(
            "attention on %s: FlashAttention-2 (FlashAttention-4 needs compute capability 9.0+)", device
        )
        return False
    logger.info(
        "attention on %s: FlashAttention-4 for long sequences, FlashAttention-2 for short ones", device
    )
    return True


@functools.lru_cache(maxsize=8)
def cudnn_available(device: torch.device) -> bool:
    """Whether SDPA's cuDNN kernel runs on `device`: Hopper (compute capability 9.0) or newer,
    where it was measured to beat FA2, and a tiny dense call succeeds. Logged once per device."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        probe = torch.zeros((DENSE_BUCKET_ROWS, 1, 72), device=device, dtype=torch.bfloat16)
        dense_attention(probe, probe, probe, (0, DENSE_BUCKET_ROWS), None)
    except RuntimeError as error:
        logger.warning("attention on %s: no cuDNN attention for eager batches (%s)", device, error)
        return False
    logger.info(
        "attention on %s: cuDNN for eager batches of at most %d sequences of %d rows or more, and for "
        "one image filling a graph of %d rows or more",
        device,
        CUDNN_MAX_SEQUENCES,
        CUDNN_MIN_ROWS_PER_SEQUENCE,
        DENSE_GRAPH_MIN_ROWS,
    )
    return True


def graph_backend(choice: str, device: torch.device, num_rows: int, max_sequences: int) -> str:
    """The kernel a graph of `num_rows` rows and at most `max_sequences` sequences is captured with
    (a tower whose head size packed cuDNN cannot take runs FA2 under CUDNN_PACKED)."""
    if choice == "fa4":
        return "fa4"
    if choice == "cudnn":
        return CUDNN_PACKED_ONLY
    if (
        choice == "auto"
        and fa4_available(device)
        and num_rows >= FA4_MIN_ROWS_PER_GRAPH_SEQUENCE * max_sequences
    ):
        return "fa4"
    if choice == "auto" and cudnn_packed_available(device):
        return CUDNN_PACKED
    return "fa2"


def eager_backend(
    boundaries: tuple[int, ...], num_rows: int, fa4: bool, cudnn: bool, cudnn_packed: bool = False
) -> str:
    """The kernel for a batch run at its own rows whose `cu_seqlens` are `boundaries`, where FA4,
    dense cuDNN and packed cuDNN can run or not."""
    lengths = [end - start for start, end in itertools.pairwise(boundaries) if end > start]
    if not lengths or boundaries[0] != 0 or boundaries[-1] != num_rows:
        return "fa2"
    if fa4 and sum(lengths) >= FA4_MIN_ROWS_PER_SEQUENCE * len(lengths):
        return "fa4"
    if cudnn_packed:
        return CUDNN_PACKED
    if cudnn and len(lengths) <= CUDNN_MAX_SEQUENCES and min(lengths) >= CUDNN_MIN_ROWS_PER_SEQUENCE:
        return "cudnn"
    return "fa2"


@contextlib.contextmanager
def use_attention(backend: str | None) -> Iterator[None]:
    """Run the towers' attention with `backend` ("fa2", "fa4", CUDNN_PACKED(_ONLY), LEADING_SEQUENCE; None:
    the hook decides). Under CUDNN_PACKED and LEADING_SEQUENCE a tower whose head size cuDNN cannot
    take runs FA2. One forward of a tower each: the inputs packed cuDNN derives from the boundaries
    are shared by its layers (`cudnn_packed.one_forward`)."""
    with scoped_value(_BACKEND, backend), one_forward():
        yield


def wants_dense_graph(choice: str, device: torch.device, num_rows: int, max_sequences: int) -> bool:
    """Whether a graph of `num_rows` rows gets a second capture for one leading sequence: only where
    the graph runs FA2 (packed cuDNN already runs Hopper's kernel on the one sequence, and its
    padding costs only the padding's own attention, not rows² as a dense graph's does)."""
    return (
        choice == "auto"
        and num_rows >= DENSE_GRAPH_MIN_ROWS
        and graph_backend(choice, device, num_rows, max_sequences) == "fa2"
        and cudnn_available(device)
    )


@contextlib.contextmanager
def recording_leading_sequence_reads() -> Iterator[list[tuple[int, int]]]:
    """While inside, the memory (`boundary_key`) of the `cu_seqlens` each attention call that took
    the leading-sequence kernel read, in a list. None taken: the tower's head size is one cuDNN
    cannot take. A key that is not one of the batch's own metadata buffers: the tower derived its
    boundaries itself (windows, say), which a dense graph would get wrong."""
    reads: list[tuple[int, int]] = []
    token = _LEADING_SEQUENCE_READS.set(reads)
    try:
        yield reads
    finally:
        _LEADING_SEQUENCE_READS.reset(token)


def is_boundary(tensor: torch.Tensor | TensorSpec) -> bool:
    """Whether a metadata tensor (or its spec) holds sequence boundaries: 1-D int32, as the packed
    kernels take `cu_seqlens`."""
    return len(tensor.shape) == 1 and tensor.dtype == torch.int32


def cudnn_takes(head_dim: int) -> bool:
    """Whether cuDNN takes this head size with the extra masking column."""
    return head_dim <= CUDNN_MAX_HEAD_DIM


@contextlib.contextmanager
def host_boundaries(
    on_host: Mapping[str, torch.Tensor], on_device: Mapping[str, torch.Tensor]
) -> Iterator[None]:
    """While a batch runs eagerly: the host values of its 1-D int32 metadata (`cu_seqlens` and
    the like), keyed by the memory of the device tensors the tower will pass to the hook."""
    known = {
        boundary_key(on_device[name]): tuple(tensor.tolist())
        for name, tensor in on_host.items()
        if is_boundary(tensor)
    }
    token = _KNOWN_BOUNDARIES.set(known)
    try:
        yield
    finally:
        _KNOWN_BOUNDARIES.reset(token)


def _backend_for(
    query: torch.Tensor, cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor
) -> tuple[str, tuple[int, ...] | None]:
    """The kernel, and the boundaries on the host where the batch declared them (an eager batch)."""
    known = _KNOWN_BOUNDARIES.get()
    key = boundary_key(cu_seq_lens_q)
    boundaries = known.get(key) if known and boundary_key(cu_seq_lens_k) == key else None
    backend = _BACKEND.get()
    if backend is not None:
        return backend, boundaries
    if boundaries is None:
        return "fa2", None
    device = query.device
    packed = cudnn_packed_takes(query.shape[-1], query.dtype) and cudnn_packed_available(device)
    cudnn = not packed and cudnn_takes(query.shape[-1]) and cudnn_available(device)
    return eager_backend(boundaries, query.shape[0], fa4_available(device), cudnn, packed), boundaries


def forced_backend(choice: str) -> str | None:
    """The backend an encoder's `attention` choice imposes on an eager batch (None: "auto", the
    hook picks from the batch's boundaries)."""
    return None if choice == "auto" else CUDNN_PACKED_ONLY if choice == "cudnn" else choice


def boundary_key(tensor: torch.Tensor) -> tuple[int, int]:
    """Names a metadata tensor by its memory (data_ptr, numel), not its Python object: compiled
    code may hand the hook another tensor object over the same memory."""
    return tensor.data_ptr(), tensor.numel()


PACKED_HEAD_MULTIPLE = 8


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query/key/value: [1, heads, rows, head_dim] -> ([1, rows, heads, head_dim], None)."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise RuntimeError(f"{ATTENTION_NAME} needs cu_seqlens and max_seqlen from the tower")
    # the packed kernels (FA2, cuDNN) take head sizes in multiples of 8 only; every released tower's
    # is one, and a tower whose is not runs the masked SDPA, slower but right (and capturable)
    if not (query.is_cuda and query.dtype in _FLASH_DTYPES) or query.shape[-1] % PACKED_HEAD_MULTIPLE:
        return _block_diagonal_sdpa(query, key, value, cu_seq_lens_q, scaling).transpose(1, 2), None
    # the packed kernels take [rows, heads, head_dim]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    cu_seq_lens_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    max_length_k = max_length_q if max_length_k is None else max_length_k
    out = flash_varlen(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scaling)
    return out.unsqueeze(0), None


# An opaque op to torch.compile (`vitpool.kernels.compiled`): the kernel is chosen when it runs,
# from the encoder's context, not baked in when a block is traced.
@torch.library.custom_op("vitpool::flash_varlen", mutates_args=(), device_types="cuda")
def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    max_length_q: int,
    max_length_k: int,
    scaling: float | None,
) -> torch.Tensor:
    """Packed attention over [rows, heads, head_dim] with the kernel `_backend_for` picks."""
    backend, boundaries = _backend_for(q, cu_seq_lens_q, cu_seq_lens_k)
    same_keys = boundary_key(cu_seq_lens_k) == boundary_key(cu_seq_lens_q) and max_length_k == max_length_q
    if (
        backend in (CUDNN_PACKED, CUDNN_PACKED_ONLY)
        and same_keys
        and cudnn_packed_takes(q.shape[-1], q.dtype)
    ):
        from torch.nn.attention.varlen import varlen_attn

        def race_fa2() -> torch.Tensor:
            return varlen_attn(
                q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scale=scaling
            )

        fa2 = race_fa2 if backend == CUDNN_PACKED else None  # the rival a shape's plan is raced against once

        if boundaries is None:  # a graph: the plan of its own shape, built at capture
            out = packed_cudnn_attention(q, k, v, cu_seq_lens_q, max_length_q, scaling, rival=fa2)
        else:  # an eager batch: its plan's shape rounded up, so that varied batches share few plans
            longest = max((end - start for start, end in itertools.pairwise(boundaries)), default=1)
            sequences, max_length = bucketed_shape(len(boundaries) - 1, max(longest, 1))
            out = packed_cudnn_attention(q, k, v, cu_seq_lens_q, max_length, scaling, sequences, rival=fa2)
        if out is not None:  # (None: no plan for this shape that captures, or FA2 won its race: FA2 below)
            return out
    if backend == "cudnn" and boundaries is not None:
        return dense_attention(q, k, v, boundaries, scaling)
    if backend == LEADING_SEQUENCE and cudnn_takes(q.shape[-1]):
        reads = _LEADING_SEQUENCE_READS.get()
        if reads is not None:
            reads.append(boundary_key(cu_seq_lens_q))
        return leading_sequence_attention(q, k, v, cu_seq_lens_q, scaling)
    if backend == "fa4":
        from flash_attn.cute import flash_attn_varlen_func

        # FA4 picks (and compiles) a kernel configuration from max_seqlen: a captured graph has a
        # fixed one, but eager batches come in every size, so their bound is rounded up to a power
        # of two (an upper bound is all varlen needs), keeping the configurations few.
        max_q, max_k = (
            (max_length_q, max_length_k) if _BACKEND.get() else (_bucket(max_length_q), _bucket(max_length_k))
        )
        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu_seq_lens_q,
            cu_seqlens_k=cu_seq_lens_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            softmax_scale=scaling,
        )
        return out[0] if isinstance(out, tuple) else out
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scale=scaling)


@flash_varlen.register_fake
def _flash_varlen_shape(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scaling):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _bucket(length: int) -> int:
    return 1 << max(0, (int(length) - 1).bit_length())


def _block_diagonal_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """SDPA over packed sequences: a row attends only to rows of its own sequence."""
    num_rows = query.shape[2]
    rows = torch.arange(num_rows, device=query.device, dtype=cu_seqlens.dtype)
    # Repeated cu_seqlens entries (empty sequences) do not matter: each row gets the index
    # of the first boundary after it, which is unique to its sequence.
    sequence_of_row = torch.searchsorted(cu_seqlens, rows, right=True)
    mask = sequence_of_row[:, None] == sequence_of_row[None, :]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)


def install_packed_attention(tower: torch.nn.Module) -> None:
    """Register the hook and make `tower` use it, and install the fused rotary embedding, patch
    embedding and MLP GELU (`vitpool.kernels.fused`; in effect under `use_fused_ops`) and the
    compiled blocks (`vitpool.kernels.compiled`; under `use_compiled_blocks`). Doing it again is
    harmless."""
    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    tower.config._attn_implementation = ATTENTION_NAME
    install_fused_ops(tower)
    install_compiled_blocks(tower)
