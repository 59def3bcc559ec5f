"""The in-process encoder alone and beside an idle pool of one actor on the same GPU (issue 30).

The real-size Qwen3-VL-8B vision tower (random bf16 weights), `GraphEncoder.encode` synchronised,
median (and the largest) of 30 calls after 10, for 1×224², 4×224², 1×896² and 8×448²: first alone, then
with a pool of one actor (half of the same GPU) launched and idle, in the same process. Batches of
4 MB of pixels and more pass through pinned staging memory (`vitpool.graphs.buffers.PinnedStaging`),
which is what this watches. Run it from each tree to compare (`TREE` names the tree, for the
record; its `benchmarks/` supplies `common.py`):

    TREE=$PWD python benchmarks/studies/staging_beside_pool.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.environ.get("TREE", "."), "benchmarks"))

import torch
from common import image, save_random_tower

from vitpool import EncoderPool, GraphEncoder


def main() -> None:
    directory = str(save_random_tower(tempfile.mkdtemp()))
    encoder = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)

    def timed(items: list, runs: int = 40, warmup: int = 10) -> str:
        samples = []
        for _ in range(runs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            encoder.encode(items)
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) * 1e3)
        kept = sorted(samples[warmup:])
        return f"{statistics.median(kept):.2f} (max {kept[-1]:.2f})"

    work = {
        "1x224": [image(224)],
        "4x224": [image(224) for _ in range(4)],
        "1x896": [image(896)],
        "8x448": [image(448) for _ in range(8)],
    }
    results = {
        "tree": os.environ.get("TREE", "."),
        "alone": {name: timed(items) for name, items in work.items()},
    }
    pool = EncoderPool.launch(
        model=directory, num_actors=1, dtype="bfloat16", actor_options={"num_gpus": 0.5}
    )
    pool.encode(work["4x224"])
    results["beside an idle pool"] = {name: timed(items) for name, items in work.items()}
    pool.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
