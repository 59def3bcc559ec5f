"""Requests of the tests against a real vLLM: random pictures vLLM does not resize, chat bodies,
the answer's tokens and logprobs, and their comparison."""

from __future__ import annotations

import base64
import io
import math

import numpy as np
from vllm_servers import post_json

TOLERANCE = 1e-4


def png(seed: int, height: int, width: int, multiple: int = 32) -> bytes:
    """A random picture whose sides are multiples of `multiple` (the family's merged token: 32
    pixels for Qwen3-VL, 28 for Qwen2-VL and Qwen2.5-VL) and within the processor's pixel range: no
    resizing, so the gateway's processor and vLLM's see the same pixels."""
    from PIL import Image as PILImage

    assert height % multiple == 0 and width % multiple == 0, (height, width, multiple)
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    PILImage.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def chat(images: list[bytes], uuids: list[str] | None = None, text: str = "describe") -> dict:
    parts = []
    for index, data in enumerate(images):
        part = {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()},
        }
        if uuids is not None:
            part["uuid"] = uuids[index]
        parts.append(part)
    parts.append({"type": "text", "text": text})
    return {
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 4,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 5,
    }


def answer(url: str, body: dict, model) -> list[tuple[str, float, list[float]]]:
    response = post_json(url + "/v1/chat/completions", {"model": str(model), **body})
    return [
        (token["token"], token["logprob"], [top["logprob"] for top in token["top_logprobs"]])
        for token in response["choices"][0]["logprobs"]["content"]
    ]


def assert_same_answer(actual, expected, tolerance=TOLERANCE) -> None:
    assert [token for token, _, _ in actual] == [token for token, _, _ in expected]
    for (_, logprob, tops), (_, expected_logprob, expected_tops) in zip(actual, expected):
        assert math.isclose(logprob, expected_logprob, abs_tol=tolerance)
        assert np.allclose(tops, expected_tops, atol=tolerance)


def largest_difference(actual, expected) -> float:
    return max(
        abs(a - b) for (_, _, tops_a), (_, _, tops_b) in zip(actual, expected) for a, b in zip(tops_a, tops_b)
    )
