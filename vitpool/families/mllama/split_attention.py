"""Llama 3.2 Vision's vision attention, exact, as two unmasked attention calls instead of SDPA with
Hugging Face's dense float mask.

`MllamaVisionModel` marks a row as padding if its tile is a padding tile (`aspect_ratio_mask` 0)
or it is one of the rows that pad a tile's `num_patches` real rows to a multiple of 8. Its mask
(`_prepare_aspect_ratio_attention_mask`) masks only padding against padding: a real query
attends to every key of its image, a padding query to the real keys alone. Both kinds matter (the
real queries read the padding rows as keys in the next layer), and the masked SDPA is slow: a
dense float mask takes the flash kernels away (issues 52 and 55). So, per image slot of T rows of
which R are real:

- call A: every query against every key of its slot, unmasked (dense SDPA: flash, cuDNN or the
  efficient kernel). Right for the real queries;
- call B: a packed (varlen) call over rows gathered per slot, the queries as [padding, real], the
  keys and values as [real, one padding row] per slot (the other padding rows after all of them,
  read by no sequence): sequence (s, 1) is the padding queries against the real keys (wanted),
  sequence (s, 2) the real queries against that one padding key (ignored, nearly free);
- the output in the model's order: one gather from cat(A, B) by a source index (a real row from
  A, a padding row from its place in B).

The orders, boundaries and source index are host-built per batch from its aspect ratio mask
(`SplitLayout.build`) into metadata buffers of fixed shape per budget (T and the slots are fixed;
only their values change), and the maximum lengths are Python ints fixed per layout, so a graph
replays with new values. The adapter's forward hands them to the installed attention for the
duration of the vision model's forward (`SplitState.running`).

The split runs where call B's packed kernel does: CUDA, fp16 or bf16, a head size a multiple of 8
(the released model's is 80): vitpool's `flash_varlen` (FA2, or FA4 where a graph takes it; packed
cuDNN needs one set of boundaries for queries and keys, so it hands such a call to FA2). vitpool's
`packed_attention` cannot be the entry point: its CPU path (`_block_diagonal_sdpa`) reads the
query boundaries alone. Elsewhere (a CPU, fp32), with the switch off, or with the tower called
outside the adapter, the attention is Hugging Face's masked SDPA, unchanged.

What it saves, and where the packed call still waits on latency: benchmarks/RESULTS.md, "Llama 3.2
Vision's attention, split".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from vitpool.kernels.attention import flash_varlen
from vitpool.specs import TensorSpec

# Whether new adapters run the split (`MllamaAdapter.split_attention` copies it; a benchmark sets
# the adapter's attribute before its encoder captures, to time both paths in one run).
SPLIT_ATTENTION = True
ATTENTION_NAME = "vitpool_mllama_split"
STATE_ATTRIBUTE = "_vitpool_split_attention"  # on each MllamaVisionAttention: its tower's SplitState
# metadata names (`MllamaAdapter.metadata_specs`); int32 boundaries, as the packed kernels take them
QUERY_ORDER = "split_query_order"
KEY_ORDER = "split_key_order"
CU_SEQLENS_Q = "split_cu_seqlens_q"
CU_SEQLENS_K = "split_cu_seqlens_k"
SOURCE = "split_source"
METADATA_NAMES = (QUERY_ORDER, KEY_ORDER, CU_SEQLENS_Q, CU_SEQLENS_K, SOURCE)
_PACKED_DTYPES = (torch.float16, torch.bfloat16)
_PACKED_HEAD_MULTIPLE = 8


@dataclass(frozen=True)
class SplitLayout:
    """The rows of an image slot: `tiles` tiles of `rows_per_tile` rows, the first `real_per_tile`
    of a real tile real (its patches and class token), the rest the model's padding to 8."""

    tiles: int
    real_per_tile: int
    rows_per_tile: int

    @property
    def rows_per_slot(self) -> int:
        return self.tiles * self.rows_per_tile

    @property
    def max_length_q(self) -> int:
        """A bound on call B's query sequences whatever the mask (1 to `tiles` real tiles a slot):
        the padding rows T - R, or the real rows R."""
        return max(self.rows_per_slot - self.real_per_tile, self.tiles * self.real_per_tile)

    @property
    def max_length_k(self) -> int:
        """Likewise for its key sequences: the real rows R, or the one padding key."""
        return self.tiles * self.real_per_tile

    def metadata_specs(self, slots: int) -> dict[str, TensorSpec]:
        rows = slots * self.rows_per_slot
        return {
            QUERY_ORDER: TensorSpec((rows,), torch.int64),
            KEY_ORDER: TensorSpec((rows,), torch.int64),
            CU_SEQLENS_Q: TensorSpec((2 * slots + 1,), torch.int32),
            CU_SEQLENS_K: TensorSpec((2 * slots + 1,), torch.int32),
            SOURCE: TensorSpec((rows,), torch.int64),
        }

    def real_rows(self, aspect_ratio_mask: torch.Tensor) -> torch.Tensor:
        """[slots, T] bool: the rows the model's mask treats as real."""
        within = torch.arange(self.rows_per_tile) < self.real_per_tile
        real = aspect_ratio_mask.bool()[:, :, None] & within[None, None, :]
        return real.reshape(aspect_ratio_mask.shape[0], self.rows_per_slot)

    def build(self, aspect_ratio_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Call B's orders and boundaries and the output's source index, on the host, from the
        slots' aspect ratio mask [slots, tiles] (1: a real tile; each slot at least one).

        Raises:
            ValueError: a mask not [slots, tiles], or a slot without a real tile (the model's
                mask would leave its padding queries no key).
        """
        if aspect_ratio_mask.dim() != 2 or aspect_ratio_mask.shape[1] != self.tiles:
            raise ValueError(
                f"aspect_ratio_mask must be [slots, {self.tiles}]; got {tuple(aspect_ratio_mask.shape)}"
            )
        slots, rows = aspect_ratio_mask.shape[0], self.rows_per_slot
        if not bool(aspect_ratio_mask.bool().any(dim=1).all()):
            raise ValueError("every image slot needs a real tile (the model's first tile of a padding image)")
        real = self.real_rows(aspect_ratio_mask.cpu())
        base = torch.arange(slots)[:, None] * rows
        # stable sorts keep the model's row order within each part
        padding_first = torch.argsort(real.to(torch.int8), dim=1, stable=True) + base
        real_first = torch.argsort((~real).to(torch.int8), dim=1, stable=True) + base
        real_count = real.sum(dim=1)
        ends = torch.arange(1, slots + 1) * rows
        cu_q = torch.stack([ends - real_count, ends], dim=1).reshape(-1)
        # keys: each slot's real rows and its first padding row (what its real queries read in call
        # B, ignored), then the other padding rows, read by no sequence (a permutation all the same)
        counts = real_count.tolist()
        read = [real_first[slot, : count + 1] for slot, count in enumerate(counts)]
        unread = [real_first[slot, count + 1 :] for slot, count in enumerate(counts)]
        cu_k = torch.stack([real_count, torch.ones_like(real_count)], dim=1).reshape(-1).cumsum(0)
        zero = torch.zeros(1, dtype=torch.int64)
        flat_real = real.reshape(-1)
        place_in_b = torch.empty(slots * rows, dtype=torch.int64)
        place_in_b[padding_first.reshape(-1)] = torch.arange(slots * rows)
        source = torch.where(flat_real, torch.arange(slots * rows), slots * rows + place_in_b)
        return {
            QUERY_ORDER: padding_first.reshape(-1),
            KEY_ORDER: torch.cat(read + unread),
            CU_SEQLENS_Q: torch.cat([zero, cu_q]).to(torch.int32),
            CU_SEQLENS_K: torch.cat([zero, cu_k]).to(torch.int32),
            SOURCE: source,
        }


class SplitState:
    """A tower's split attention: its layout, the attention it replaced (Hugging Face's, the
    fallback) and, while the adapter's forward runs, the batch's index tensors."""

    def __init__(self, layout: SplitLayout, fallback: str) -> None:
        self.layout = layout
        self.fallback = fallback
        self.current: dict[str, torch.Tensor] | None = None

    @contextlib.contextmanager
    def running(self, metadata: Mapping[str, torch.Tensor] | None) -> Iterator[None]:
        """While inside, the attention reads `metadata`'s split tensors (static buffers under
        capture, so a replay reads the new batch's values); None: Hugging Face's masked path."""
        previous = self.current
        self.current = None if metadata is None else {name: metadata[name] for name in METADATA_NAMES}
        try:
            yield
        finally:
            self.current = previous


def install_split_attention(vision_model: torch.nn.Module) -> SplitState | None:
    """Make `vision_model` (a MllamaVisionModel) run its attention through `split_attention`;
    returns the state its adapter hands the batch's indices to, or None where the split does not
    apply: a tile of patches already a multiple of 8 rows (which no square patch grid gives), whose
    mask in Hugging Face's code is then not the padding-by-padding one above. Again: the same state
    (a tower unpickled elsewhere keeps its state; unpickling it imports this module, which registers
    the attention)."""
    for module in vision_model.modules():
        state = getattr(module, STATE_ATTRIBUTE, None)
        if state is not None:
            return state
    config = vision_model.config
    real = int(vision_model.num_patches)
    padding = (8 - real % 8) % 8
    if padding == 0:
        return None
    layout = SplitLayout(int(config.max_num_tiles), real, real + padding)
    state = SplitState(layout, config._attn_implementation)
    from transformers.models.mllama.modeling_mllama import MllamaVisionAttention

    for module in vision_model.modules():
        if isinstance(module, MllamaVisionAttention):
            setattr(module, STATE_ATTRIBUTE, state)
    config._attn_implementation = ATTENTION_NAME
    return state


# Opaque to torch.compile (`vitpool.kernels.compiled`): a compiled block breaks around it rather
# than tracing the state object it reads.
@torch.compiler.disable
def split_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query/key/value: [slots, heads, T, head_dim] -> ([slots, T, heads, head_dim], None), as
    Hugging Face's attention functions; `attention_mask` is the model's, read only on its path."""
    state: SplitState | None = getattr(module, STATE_ATTRIBUTE, None)
    indices = None if state is None else state.current
    if indices is None or not packed_kernel_runs(query):
        from transformers.models.mllama.modeling_mllama import eager_attention_forward

        fallback = "sdpa" if state is None else state.fallback
        hf_attention = ALL_ATTENTION_FUNCTIONS.get_interface(fallback, eager_attention_forward)
        return hf_attention(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    slots, rows = query.shape[0], query.shape[2]
    if rows != state.layout.rows_per_slot or indices[SOURCE].numel() != slots * rows:
        raise RuntimeError(
            f"split attention got {slots} slots of {rows} rows; the batch's indices are for "
            f"{indices[SOURCE].numel()} rows in slots of {state.layout.rows_per_slot}"
        )
    layout = state.layout
    return split_attention_rows(
        query, key, value, indices, layout.max_length_q, layout.max_length_k, scaling
    ), None


# at import: the name a tower's config holds resolves wherever its state's class can be unpickled
AttentionInterface.register(ATTENTION_NAME, split_attention)


def packed_kernel_runs(query: torch.Tensor) -> bool:
    """Whether call B's packed kernel takes `query` (the split runs only where it does)."""
    return query.is_cuda and query.dtype in _PACKED_DTYPES and query.shape[-1] % _PACKED_HEAD_MULTIPLE == 0


def split_attention_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    indices: Mapping[str, torch.Tensor],
    max_length_q: int,
    max_length_k: int,
    scaling: float | None,
) -> torch.Tensor:
    """The two calls and the gather: [slots, heads, T, head_dim] in, [slots, T, heads, head_dim] out."""
    slots, heads, rows, _ = query.shape

    def by_row(tensor: torch.Tensor) -> torch.Tensor:  # [slots * T, heads, head_dim]
        return tensor.transpose(1, 2).reshape(slots * rows, heads, tensor.shape[-1])

    whole = F.scaled_dot_product_attention(query, key, value, scale=scaling)  # call A
    q_b = by_row(query)[indices[QUERY_ORDER]]
    k_b, v_b = (by_row(t)[indices[KEY_ORDER]] for t in (key, value))
    padding = flash_varlen(  # call B
        q_b, k_b, v_b, indices[CU_SEQLENS_Q], indices[CU_SEQLENS_K], max_length_q, max_length_k, scaling
    )
    out = torch.cat([by_row(whole), padding])[indices[SOURCE]]
    return out.view(slots, rows, heads, value.shape[-1])
