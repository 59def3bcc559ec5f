"""Run by the vLLM environment's Python (where ai-dynamo is installed): vitpool's Dynamo backend
driven as Dynamo drives it (`AsyncVisionEncoder`: load, then encode(image URLs)), its artifacts
taken by Dynamo's Qwen3-VL adapter, and compared with `pool.encode` of the same items. Prints JSON.

    python tests/vllm/dynamo_check.py CHECKPOINT IMAGE.png...   (VITPOOL_POOL and RAY_ADDRESS set)
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from dynamo.vllm.multimodal_utils.custom_encoder import AsyncVisionEncoder
from dynamo.vllm.multimodal_utils.custom_encoder.adapter.qwen3_vl import Qwen3VLNativeAdapter

from vitpool.integrations.dynamo import VitpoolEncoderBackend, image_bytes
from vitpool.integrations.vllm.images import decode_image
from vitpool.integrations.vllm.layouts import vllm_embedding


def main(checkpoint: str, pictures: list[str]) -> dict:
    urls = ["data:image/png;base64," + base64.b64encode(Path(p).read_bytes()).decode() for p in pictures]
    backend = VitpoolEncoderBackend()
    encoder = AsyncVisionEncoder(backend)
    encoder.load(checkpoint)
    try:
        artifacts = asyncio.run(encoder.encode(urls))
        try:
            asyncio.run(encoder.encode([urls[0], "data:image/png;base64,bm90IGFuIGltYWdl"]))
            bad_image = "accepted"
        except ValueError as error:
            bad_image = str(error)
        items = [backend._make_item(decode_image(image_bytes(url))) for url in urls]
        expected = backend._pool.encode(items)
        differences = [
            float(
                (artifact.embeddings - vllm_embedding(embedding, backend.family, backend.dtype)).abs().max()
            )
            for artifact, embedding in zip(artifacts, expected)
        ]
        config = SimpleNamespace(
            hf_config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
        )
        prompt = Qwen3VLNativeAdapter(config).prepare_prompt([1, 2, 3], artifacts)
        image = prompt["multi_modal_data"]["image"]
        return {
            "differences": differences,
            "grids": [list(a.grid_thw) for a in artifacts],
            "rows": [a.embeddings.shape[0] for a in artifacts],
            "widths": [a.embeddings.shape[1] for a in artifacts],
            "prompt_rows": int(image["image_embeds"].shape[0]),
            "bad_image": bad_image,
            "dtype": str(artifacts[0].embeddings.dtype),
            "finite": bool(torch.isfinite(image["image_embeds"]).all()),
        }
    finally:
        encoder.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2:])))
