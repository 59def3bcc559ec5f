"""The attention hook vitpool installs in Hugging Face towers.

The name contains "flash" so that the towers take their packed-sequence path: they pass
`cu_seq_lens_q/k` and an integer `max_length_q/k` instead of splitting sequences on the host.
On CUDA in half precision it runs PyTorch's own FlashAttention-2 (`varlen_attn`); elsewhere
(CPU, fp32) it runs SDPA with a block-diagonal mask built from `cu_seqlens`. Neither path
synchronises with the host, so both can be captured.

One dense sequence is faster through SDPA's cuDNN backend (1.5x FA2 at the towers' head size 72
on an H100, `benchmarks/attention_backends.py`), but only with no mask, and its packed-sequence
path cannot be captured. So it is used where the batch is known on the host to be one sequence
over all its rows: an eager run at the items' own size declares its boundaries with
`host_boundaries`, and the hook looks them up instead of reading the device.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

ATTENTION_NAME = "vitpool_flash_varlen"

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
# id(device tensor) -> its values, for the 1-D int32 metadata of the batch running now (eager only)
_KNOWN_BOUNDARIES: contextvars.ContextVar[dict[int, tuple[int, ...]] | None] = contextvars.ContextVar(
    "vitpool_known_boundaries", default=None
)
_DENSE_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


@contextlib.contextmanager
def host_boundaries(
    on_host: Mapping[str, torch.Tensor], on_device: Mapping[str, torch.Tensor]
) -> Iterator[None]:
    """While a batch runs eagerly: the host values of its 1-D int32 metadata (`cu_seqlens` and
    the like), keyed by the device tensors the tower will pass to the hook."""
    known = {
        id(on_device[name]): tuple(tensor.tolist())
        for name, tensor in on_host.items()
        if tensor.dim() == 1 and tensor.dtype == torch.int32
    }
    token = _KNOWN_BOUNDARIES.set(known)
    try:
        yield
    finally:
        _KNOWN_BOUNDARIES.reset(token)


def _is_one_sequence(cu_seqlens: torch.Tensor, num_rows: int) -> bool:
    """Whether `cu_seqlens` is known on the host to hold one non-empty sequence of all the rows."""
    known = _KNOWN_BOUNDARIES.get()
    boundaries = known.get(id(cu_seqlens)) if known else None
    if not boundaries or boundaries[0] != 0 or boundaries[-1] != num_rows:
        return False
    return sum(1 for start, end in zip(boundaries, boundaries[1:]) if end > start) == 1


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
    if query.is_cuda and query.dtype in _FLASH_DTYPES:
        if _is_one_sequence(cu_seq_lens_q, query.shape[2]) and _is_one_sequence(cu_seq_lens_k, key.shape[2]):
            with sdpa_kernel(_DENSE_BACKENDS, set_priority=True):
                out = F.scaled_dot_product_attention(query, key, value, scale=scaling)
            return out.transpose(1, 2), None
        from torch.nn.attention.varlen import varlen_attn

        # varlen_attn takes [rows, heads, head_dim]
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        out = varlen_attn(
            q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scale=scaling
        )
        return out.unsqueeze(0), None
    return _block_diagonal_sdpa(query, key, value, cu_seq_lens_q, scaling).transpose(1, 2), None


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
    """Register the hook and make `tower` use it. Registering again is harmless."""
    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    tower.config._attn_implementation = ATTENTION_NAME
