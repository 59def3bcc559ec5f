"""Write the tiny Qwen3-VL-shaped vision tower that vitpool ships (random weights, fp32).

It keeps the real model's input layout (16x16 patches, temporal patch 2, 2x2 merge, so rows of
1536 features) and deepstack outputs, with a few narrow layers so that CPU tests run in seconds.

    python scripts/make_tiny_checkpoint.py [output_dir]
"""

import sys
from pathlib import Path

import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionConfig, Qwen3VLVisionModel

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "vitpool/models/checkpoints/tiny-qwen3-vl"

TINY_CONFIG = {
    "depth": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "out_hidden_size": 128,
    "num_position_embeddings": 144,  # a 12x12 learned position grid
    "deepstack_visual_indexes": [1, 2],
}


def main() -> None:
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUTPUT
    torch.manual_seed(0)
    tower = Qwen3VLVisionModel._from_config(Qwen3VLVisionConfig(**TINY_CONFIG), dtype=torch.float32)
    tower.save_pretrained(output)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
