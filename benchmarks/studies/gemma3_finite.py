"""Gemma 3 at its flagship size (random bf16 weights): are vitpool's and Hugging Face's outputs
finite, and which side gives NaN where family_latency.py reports a NaN relative error.

    python benchmarks/studies/gemma3_finite.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from family_latency import CONFIGS, PROJECTOR_FIELDS, VISION_MODEL_TYPES, hugging_face_eager, use_sdpa

from vitpool import GraphEncoder, Image


def main() -> None:
    config = {
        **json.loads(CONFIGS.read_text())["gemma3"]["vision_config"],
        **PROJECTOR_FIELDS["gemma3"],
        "model_type": VISION_MODEL_TYPES["gemma3"],
    }
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(config))
        torch.manual_seed(0)
        encoder = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    module = encoder.adapter.tower
    print("parameters finite:", all(bool(torch.isfinite(p).all()) for p in module.parameters()))
    print("largest |parameter|:", max(float(p.abs().max()) for p in module.parameters()))
    items = [Image(torch.randn(1, 3, 896, 896))]
    with torch.no_grad():
        ours = encoder.encode(items)[0].tokens.float()
        hidden = module.vision_tower(
            pixel_values=items[0].pixel_values.to("cuda", torch.bfloat16)
        ).last_hidden_state
        theirs = hugging_face_eager("gemma3", use_sdpa(module), items).float()
    for name, tensor in (
        ("vitpool", ours),
        ("tower hidden (HF)", hidden.float()),
        ("HF get_image_features", theirs),
    ):
        print(
            f"{name}: finite {bool(torch.isfinite(tensor).all())}, "
            f"largest |x| {float(tensor.abs().nan_to_num(0).max()):.3e}, "
            f"nan {int(torch.isnan(tensor).sum())} of {tensor.numel()}"
        )
    print("attention implementation:", getattr(module.vision_tower.config, "_attn_implementation", None))


if __name__ == "__main__":
    main()
