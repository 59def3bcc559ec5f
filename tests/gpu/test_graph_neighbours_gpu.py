"""GPU: an encoder's graphs stay right beside other CUDA-graph users in the same process.

The sequence of `shared/repro/compile_then_encode.py` (issue 27): an encoder built and dropped, a
second one built, a Hugging Face model run under `torch.compile(mode="reduce-overhead")` (CUDA-graph
trees) beside it; then the second encoder's results are compared with eager. Before the fix its
graphs used a cuBLAS workspace left in the dropped encoder's pool, which the graph trees freed:
replays slowed down, then faulted ("unspecified launch failure") on an H100.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from conftest import image, reference_outputs, relative_error

import vitpool
from vitpool import GraphEncoder

pytestmark = pytest.mark.gpu

# Qwen3-VL-8B's vision config (real size), as in the repro; a one-layer LLM of the real width.
VISION = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 4096,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
    "hidden_act": "gelu_pytorch_tanh",
}
TEXT = {
    "hidden_size": 4096,
    "num_hidden_layers": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 1024,
    "vocab_size": 512,
    "head_dim": 128,
}
# bf16, 27 random layers: vitpool against Hugging Face's eager sdpa tower measured 1.5e-2 on an H100
REAL_SIZE_TOLERANCE = 3e-2


def _pixels(count: int, side: int, seed: int) -> list[tuple[tuple[int, int, int], torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    h = w = side // 16
    return [((1, h, w), torch.randn(h * w, 3 * 2 * 16 * 16, generator=generator)) for _ in range(count)]


@torch.no_grad()
def _hf_features(model, batch):
    pixels = torch.cat([p for _, p in batch]).to("cuda", torch.bfloat16)
    grid = torch.tensor([g for g, _ in batch], device="cuda")
    return model.model.get_image_features(pixels, grid)


def _concatenated(features) -> list[torch.Tensor]:
    """Tokens, then each deepstack layer, over all images (transformers splits them per image, and
    from 5.24 the deepstack features too)."""

    def whole(output):
        return torch.cat(list(output)) if isinstance(output, (tuple, list)) else output

    return [whole(features.pooler_output), *(whole(layer) for layer in features.deepstack_features)]


def test_a_dropped_encoder_and_compiled_graphs_beside_it_leave_encodes_right(tmp_path):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(text_config=TEXT, vision_config=VISION)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration(config)
    model = model.to(torch.bfloat16).eval()
    model.config.save_pretrained(tmp_path / "config-only")
    GraphEncoder.from_pretrained(
        tmp_path / "config-only", device="cuda", dtype=torch.bfloat16
    )  # dropped at once
    model.save_pretrained(tmp_path / "full", safe_serialization=True)
    encoder = GraphEncoder.from_pretrained(tmp_path / "full", device="cuda", dtype=torch.bfloat16)

    workloads = {"1x224": _pixels(1, 224, 1), "4x224": _pixels(4, 224, 2), "1x1024": _pixels(1, 1024, 3)}
    for name, batch in workloads.items():
        expected = _hf_features(model, batch)
        if name == "1x224":
            torch._dynamo.reset()
            original = model.model.get_image_features
            model.model.get_image_features = torch.compile(original, mode="reduce-overhead")
            for _ in range(3):  # warm-up, record, replay
                _hf_features(model, batch)
            model.model.get_image_features = original
        for _ in range(3):  # repeated: the fault came a few calls after the compiled runs
            embeddings = encoder.encode([vitpool.Image(pixels, grid) for grid, pixels in batch])
        torch.cuda.synchronize()
        assert all(bool(torch.isfinite(e.tokens).all()) for e in embeddings), name
        got = [torch.cat([e.outputs[i] for e in embeddings]) for i in range(len(embeddings[0].outputs))]
        for got_output, want_output in zip(got, _concatenated(expected), strict=True):
            assert relative_error(got_output, want_output) <= REAL_SIZE_TOLERANCE, name
    assert encoder.stats().eager_items == 0  # every batch replayed a graph


def test_graphs_own_the_memory_they_write_when_cublas_workspaces_are_cleared():
    """The mechanism without torch.compile: whatever cuBLAS cached is freed and the freed memory
    is taken by a tensor of sentinels; the replays must neither read it nor write into it."""
    GraphEncoder.from_pretrained(None, budgets=[64, 128], device="cuda", dtype=torch.bfloat16)  # dropped
    gc.collect()
    encoder = GraphEncoder.from_pretrained(None, budgets=[64, 128], device="cuda", dtype=torch.bfloat16)
    reference = copy.deepcopy(encoder.adapter.tower)
    reference.config._attn_implementation = "sdpa"
    torch._C._cuda_clearCublasWorkspaces()  # what CUDA-graph trees do around each recording
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    sentinel = torch.full((256 << 20,), 7.0, device="cuda", dtype=torch.float32)  # 1 GiB
    generator = torch.Generator().manual_seed(0)
    items = [image(10, 12, generator), image(14, 14, generator)]
    for _ in range(3):
        embeddings = encoder.encode(items)
    torch.cuda.synchronize()
    assert bool((sentinel == 7.0).all()), "a replay wrote into memory the encoder does not own"
    assert encoder.stats().eager_items == 0
    for item, embedding in zip(items, embeddings):
        tokens, deepstack = reference_outputs(reference, item)
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, tokens) <= 1e-2
        for got, want in zip(embedding.deepstack, deepstack):
            assert relative_error(got, want) <= 1e-2
