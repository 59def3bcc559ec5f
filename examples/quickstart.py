"""Start a local pool on the shipped model and encode images and a video from several threads.

    python examples/quickstart.py [--checkpoint DIR] [--actors N] [--threads 4]

With GPUs, one encoder actor per GPU captures its graphs first (progress is logged); without
GPUs, one CPU actor runs the same static-buffer forward. The pool joins the Ray cluster running
on this machine (`ray start --head`) or at RAY_ADDRESS, and leaves it running; without one, it
starts a cluster here and stops it at the end.
"""

from __future__ import annotations

import argparse
import logging
import threading

import torch

from vitpool import EncoderPool, Image, Video

ROW_WIDTH = 3 * 2 * 16 * 16  # Qwen3-VL: channels * temporal patch * patch * patch


def items_for(caller: int) -> list:
    """grid_thw is in 16-pixel patches: (1, 14, 14) is a 224x224 image; a video of 8 frames has t = 4."""
    generator = torch.Generator().manual_seed(caller)
    return [
        Image(torch.randn(14 * 14, ROW_WIDTH, generator=generator), (1, 14, 14)),
        Image(torch.randn(28 * 20, ROW_WIDTH, generator=generator), (1, 28, 20)),
        Video(torch.randn(4 * 14 * 14, ROW_WIDTH, generator=generator), (4, 14, 14)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--checkpoint", default=None, help="local Hugging Face directory (default: shipped model)"
    )
    parser.add_argument("--actors", type=int, default=None, help="default: one per GPU, or one CPU actor")
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    with EncoderPool.launch(model=args.checkpoint, num_actors=args.actors, name="quickstart") as pool:
        results: dict[int, list] = {}

        def caller(number: int) -> None:
            results[number] = pool.encode(items_for(number))

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        for number in sorted(results):
            for item, embedding in zip(items_for(number), results[number]):
                print(
                    f"caller {number}: {type(item).__name__:5} grid {item.grid_thw}: tokens "
                    f"{tuple(embedding.tokens.shape)} {embedding.tokens.dtype}, deepstack "
                    f"{[tuple(d.shape) for d in embedding.deepstack]}"
                )
        print(pool.stats().summary())


if __name__ == "__main__":
    main()
