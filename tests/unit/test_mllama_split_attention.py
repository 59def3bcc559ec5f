"""Llama 3.2 Vision's split attention (`vitpool.families.mllama.split_attention`): two unmasked calls
and a gather in place of SDPA with the model's padding-by-padding mask. Against Hugging Face's own
masked attention on random q/k/v and aspect ratio masks (and what fails without call B, or with its
keys misplaced), the host-built indices, and the whole adapter against the model with the split on,
off, on a CPU as shipped (Hugging Face's path: the packed kernel is CUDA's), and the tower called
without the adapter. CPU, fp32, tiny random model. On a CPU, call B's packed kernel
(`flash_varlen`, CUDA only) is stood in for by `reference_varlen`, a loop over its sequences that
reads the two sets of boundaries as the packed kernels do: what the split's indices must get right
is then checked here; the kernel itself on the GPU (tests/gpu/test_mllama_split_attention_gpu.py)."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from family_cases import mllama as case
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.mllama.modeling_mllama import (
    MllamaVisionAttention,
    _prepare_aspect_ratio_attention_mask,
)

from vitpool import GraphEncoder, Image
from vitpool.families.mllama import split_attention as split
from vitpool.families.mllama.adapter import MllamaAdapter, MllamaEncoder

ATTENTION_TOLERANCE = 1e-5
MODEL_TOLERANCE = 1e-4
TILES = case.MAX_NUM_TILES
REAL_PER_TILE = case.TOKENS_PER_TILE  # 64 patches and a class token
LAYOUT = split.SplitLayout(TILES, REAL_PER_TILE, 72)  # padded to a multiple of 8, as the model does
HEADS, HEAD_DIM = 2, 16
TILE_TOKENS = case.TOKENS_PER_TILE


def random_masks(slots: int, rng: random.Random) -> torch.Tensor:
    """[slots, tiles]: 1 to 4 real tiles a slot, usually first (as the processor lays them), at
    times anywhere (the model's mask allows it)."""
    mask = torch.zeros((slots, TILES), dtype=torch.int64)
    for slot in range(slots):
        count = rng.randint(1, TILES)
        places = range(count) if rng.random() < 0.6 else rng.sample(range(TILES), count)
        mask[slot, list(places)] = 1
    return mask


def qkv(slots: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (slots, HEADS, LAYOUT.rows_per_slot, HEAD_DIM)
    return [torch.randn(shape, generator=generator) for _ in range(3)]


def hf_masked_attention(query, key, value, aspect_ratio_mask) -> torch.Tensor:
    """What the model's attention computes: its mask, its SDPA path. [slots, T, heads, head_dim]."""
    module = MllamaVisionAttention(case.full_config().vision_config)
    mask = _prepare_aspect_ratio_attention_mask(
        aspect_ratio_mask, REAL_PER_TILE, LAYOUT.rows_per_tile, torch.float32
    )
    out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](
        module, query, key, value, mask, dropout=0.0, scaling=HEAD_DIM**-0.5
    )
    return out


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_length_q, max_length_k, scaling):
    """Packed attention over [rows, heads, head_dim], one SDPA per sequence: sequence i's queries
    q[cu_q[i]:cu_q[i+1]] against its keys k[cu_k[i]:cu_k[i+1]] (key rows past the last boundary read
    by none); rows of no sequence are NaN."""
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert len(bounds_q) == len(bounds_k) and bounds_q[-1] <= q.shape[0] and bounds_k[-1] <= k.shape[0]
    out = torch.full_like(q, float("nan"))
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(bounds_q), itertools.pairwise(bounds_k)):
        assert 0 < q1 - q0 <= max_length_q and 0 < k1 - k0 <= max_length_k
        rows = [t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1])]
        out[q0:q1] = F.scaled_dot_product_attention(*rows, scale=scaling).transpose(0, 1)
    return out


@pytest.fixture
def cpu_varlen(monkeypatch):
    """The split on a CPU: the packed kernel stood in for by `reference_varlen`; its calls, counted."""
    calls = []

    def counting(*args):
        calls.append(1)
        return reference_varlen(*args)

    monkeypatch.setattr(split, "flash_varlen", counting)
    monkeypatch.setattr(split, "packed_kernel_runs", lambda query: True)
    return calls


def split_rows(query, key, value, indices) -> torch.Tensor:
    return split.split_attention_rows(
        query, key, value, indices, LAYOUT.max_length_q, LAYOUT.max_length_k, HEAD_DIM**-0.5
    )


@pytest.mark.parametrize(("slots", "seed"), [(1, 0), (1, 1), (3, 2), (5, 3), (8, 4)])
def test_the_split_equals_the_models_masked_attention(cpu_varlen, slots, seed):
    mask = random_masks(slots, random.Random(seed))
    query, key, value = qkv(slots, seed)
    want = hf_masked_attention(query, key, value, mask)
    got = split_rows(query, key, value, LAYOUT.build(mask))
    assert got.shape == want.shape == (slots, LAYOUT.rows_per_slot, HEADS, HEAD_DIM)
    padding = ~LAYOUT.real_rows(mask)
    assert padding.any(dim=1).all()  # every slot has padding rows (at least a tile's last 7)
    assert relative_error(got, want) <= ATTENTION_TOLERANCE
    # the padding rows on their own: they are few, so an error there barely moves the whole
    assert relative_error(got[padding], want[padding]) <= ATTENTION_TOLERANCE
    assert torch.isfinite(got).all() and cpu_varlen == [1]


def test_without_call_b_the_padding_rows_are_wrong(cpu_varlen):
    """A mutation the comparison must catch: every row from call A (the padding queries then
    attend to padding keys too)."""
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    query, key, value = qkv(3, 7)
    want = hf_masked_attention(query, key, value, mask)
    indices = LAYOUT.build(mask)
    only_a = {**indices, split.SOURCE: torch.arange(indices[split.SOURCE].numel())}
    got = split_rows(query, key, value, only_a)
    padding = ~LAYOUT.real_rows(mask)
    assert relative_error(got[~padding], want[~padding]) <= ATTENTION_TOLERANCE  # call A serves these
    assert relative_error(got[padding], want[padding]) > 100 * ATTENTION_TOLERANCE
    assert relative_error(got, want) > ATTENTION_TOLERANCE


def test_keys_in_the_wrong_order_are_caught(cpu_varlen):
    """Another: call B's keys in the queries' order (padding first), so its first sequence reads
    padding keys."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    query, key, value = qkv(2, 8)
    indices = LAYOUT.build(mask)
    swapped = {**indices, split.KEY_ORDER: indices[split.QUERY_ORDER]}
    want = hf_masked_attention(query, key, value, mask)
    assert relative_error(split_rows(query, key, value, swapped), want) > ATTENTION_TOLERANCE


@pytest.mark.parametrize("seed", range(4))
def test_the_indices_have_the_budgets_shapes_and_stay_in_their_slots(seed):
    rng = random.Random(seed)
    slots = rng.randint(1, 6)
    mask = random_masks(slots, rng)
    built = LAYOUT.build(mask)
    specs = LAYOUT.metadata_specs(slots)
    assert {name: (tuple(t.shape), t.dtype) for name, t in built.items()} == {
        name: (tuple(spec.shape), spec.dtype) for name, spec in specs.items()
    }
    rows, total = LAYOUT.rows_per_slot, slots * LAYOUT.rows_per_slot
    real = LAYOUT.real_rows(mask)
    query_order, key_order = built[split.QUERY_ORDER], built[split.KEY_ORDER]
    for order in (query_order, key_order):
        assert torch.equal(order.sort().values, torch.arange(total))  # permutations
    bounds_q, bounds_k = built[split.CU_SEQLENS_Q].tolist(), built[split.CU_SEQLENS_K].tolist()
    assert len(bounds_q) == len(bounds_k) == 2 * slots + 1
    assert bounds_q[0] == bounds_k[0] == 0 and bounds_q[-1] == total and bounds_k[-1] <= total
    for slot in range(slots):
        rows_of_slot = torch.arange(slot * rows, (slot + 1) * rows)
        real_of_slot, padding_of_slot = rows_of_slot[real[slot]], rows_of_slot[~real[slot]]
        q0, q1, q2 = bounds_q[2 * slot : 2 * slot + 3]
        k0, k1, k2 = bounds_k[2 * slot : 2 * slot + 3]
        # sequence (s, 1): the slot's padding queries against its real keys, in the model's order
        assert torch.equal(query_order[q0:q1], padding_of_slot)
        assert torch.equal(key_order[k0:k1], real_of_slot)
        # sequence (s, 2): its real queries against one of its padding keys (their output unused)
        assert torch.equal(query_order[q1:q2], real_of_slot) and q2 == (slot + 1) * rows
        assert k2 - k1 == 1 and int(key_order[k1]) in padding_of_slot.tolist()
        for length_q, length_k in ((q1 - q0, k1 - k0), (q2 - q1, k2 - k1)):
            assert 0 < length_q <= LAYOUT.max_length_q and 0 < length_k <= LAYOUT.max_length_k
    source, flat_real = built[split.SOURCE], real.reshape(-1)
    assert torch.equal(source[flat_real], torch.arange(total)[flat_real])  # real rows: call A
    assert (source[~flat_real] >= total).all()  # padding rows: call B, at their query's place
    assert torch.equal(query_order[source[~flat_real] - total], torch.arange(total)[~flat_real])


def test_a_slot_without_a_real_tile_is_refused():
    with pytest.raises(ValueError, match="every image slot needs a real tile"):
        LAYOUT.build(torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"\[slots, 4\]"):
        LAYOUT.build(torch.ones((2, 3), dtype=torch.int64))


# ---- the whole adapter ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=5)


def adapter_of(model, split_on: bool) -> MllamaAdapter:
    inner = model.model
    tower = MllamaEncoder(copy.deepcopy(inner.vision_model), copy.deepcopy(inner.multi_modal_projector))
    adapter = MllamaAdapter(tower)
    adapter.split_attention = split_on
    return adapter


def image(canvas: tuple[int, int], seed: int) -> Image:
    generator = torch.Generator().manual_seed(seed)
    return Image(torch.randn(canvas[0] * canvas[1], *case.ROW_SHAPE, generator=generator), canvas)


CANVASES = ((1, 1), (2, 2), (1, 3), (2, 1), (4, 1), (1, 1))


@pytest.mark.parametrize("split_on", [True, False], ids=["split", "masked"])
def test_the_adapter_gives_the_models_states_with_the_split_on_or_off(model, cpu_varlen, split_on):
    adapter = adapter_of(model, split_on)
    assert adapter.split is not None and adapter.split.layout == LAYOUT
    assert adapter.tower.vision_model.config._attn_implementation == split.ATTENTION_NAME
    budgets = [TILE_TOKENS * tiles for tiles in (4, 16)]  # one and four image slots
    encoder = GraphEncoder(adapter, budgets=budgets, device="cpu", dtype=torch.float32)
    items = [image(canvas, 90 + seed) for seed, canvas in enumerate(CANVASES)]
    embeddings = encoder.encode(items)
    for item, embedding in zip(items, embeddings, strict=True):
        want = case.image_features(model, item)
        assert embedding.tokens.shape == want.shape and torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, want) <= MODEL_TOLERANCE
    layers = model.config.vision_config.num_hidden_layers + model.config.vision_config.num_global_layers
    if split_on:  # every layer of every batch, local and global transformer
        assert len(cpu_varlen) >= layers and len(cpu_varlen) % layers == 0
    else:
        assert cpu_varlen == []


def test_on_a_cpu_as_shipped_the_split_gives_way_to_the_models_path(model, monkeypatch):
    """No packed kernel on a CPU: Hugging Face's masked SDPA runs, the split's indices unread."""
    monkeypatch.setattr(split, "split_attention_rows", lambda *args: pytest.fail("the split ran"))
    adapter = adapter_of(model, True)
    encoder = GraphEncoder(adapter, budgets=[TILE_TOKENS * 8], device="cpu", dtype=torch.float32)
    items = [image((2, 2), 95), image((1, 3), 96)]
    for item, embedding in zip(items, encoder.encode(items), strict=True):
        assert relative_error(embedding.tokens, case.image_features(model, item)) <= MODEL_TOLERANCE


def test_the_tower_called_without_the_adapter_runs_the_models_masked_path(model, cpu_varlen):
    adapter = adapter_of(model, True)
    inputs = case.processor_layout(image((1, 2), 99))
    with torch.no_grad():
        got = adapter.tower.vision_model(**inputs).last_hidden_state
        want = model.model.vision_model(**inputs).last_hidden_state
    assert cpu_varlen == [] and relative_error(got, want) <= MODEL_TOLERANCE
    assert adapter.split.current is None


def test_installing_again_keeps_one_state(model):
    adapter = adapter_of(model, True)
    assert split.install_split_attention(adapter.tower.vision_model) is adapter.split
    assert adapter.split.fallback == "sdpa"  # the model's own, what the split stands in for
