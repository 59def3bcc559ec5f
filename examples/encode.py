"""Encode a mixed batch of images and a video with GraphEncoder on the shipped tiny model.

    python examples/encode.py [--checkpoint DIR] [--device cuda|cpu]

On a GPU it captures one CUDA graph per token budget first (a progress line per budget); on a
CPU it runs the same static-buffer forward without capture.
"""

from __future__ import annotations

import argparse
import logging

import torch

from vitpool import GraphEncoder, Image, Video


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--checkpoint", default=None, help="local Hugging Face directory (default: shipped model)"
    )
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    encoder = GraphEncoder.from_pretrained(args.checkpoint, device=args.device)
    row_width = encoder.adapter.row_width  # channels * temporal patch * patch * patch
    # grid_thw is in patches of 16 px: 14x14 is a 224x224 image; a video of 8 frames has t = 4
    items = [
        Image(torch.randn(14 * 14, row_width), (1, 14, 14)),
        Image(torch.randn(28 * 20, row_width), (1, 28, 20)),
        Video(torch.randn(4 * 14 * 14, row_width), (4, 14, 14)),
        Image(torch.randn(8 * 8, row_width), (1, 8, 8)),
    ]
    embeddings = encoder.encode(items)
    for item, embedding in zip(items, embeddings):
        print(
            f"{type(item).__name__:5} grid {item.grid_thw}: tokens {tuple(embedding.tokens.shape)} "
            f"{embedding.tokens.dtype}, deepstack {[tuple(d.shape) for d in embedding.deepstack]}"
        )
    stats = encoder.stats()
    print(
        f"graph items {stats.graph_items}, eager items {stats.eager_items}, replays per budget "
        f"{stats.replays_per_budget}, padding waste {stats.padding_waste:.0%}"
    )


if __name__ == "__main__":
    main()
