"""What one Ray hop costs on this machine, piece by piece: the floor under the pool's latency.

python benchmarks/studies/ray_overhead.py [--runs 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import numpy as np
import ray
from common import summarize, time_ms


class Echo:
    def empty(self) -> None:
        return None

    def take(self, *arrays: np.ndarray) -> int:
        return sum(a.shape[0] for a in arrays)

    def give(self, num_bytes: int, parts: int) -> tuple:
        return tuple(np.zeros(num_bytes // parts // 2, dtype=np.int16) for _ in range(parts))

    def give_one(self, num_bytes: int) -> np.ndarray:
        return np.zeros(num_bytes // 2, dtype=np.int16)


def measure(function, runs: int) -> str:
    result = summarize(time_ms(function, runs, warmup=20, synchronize=False))
    return f"median {result['median_ms']:.3f} ms, p99 {result['p99_ms']:.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    ray.init(address="local", include_dashboard=False)
    plain = ray.remote(Echo).options(num_cpus=0).remote()
    threaded = ray.remote(Echo).options(num_cpus=0, max_concurrency=4).remote()
    pixels = np.zeros((784, 1536), dtype=np.float32)  # 1x224² in float32: 4.8 MB
    result_bytes = 49 * 4096 * 2 * 4  # 1x224² embeddings, bf16, tokens + 3 deepstack: 1.6 MB
    ray.get([plain.empty.remote(), threaded.empty.remote()])
    rows = {
        "empty call, plain actor": lambda: ray.get(plain.empty.remote()),
        "empty call, threaded actor (max_concurrency=4)": lambda: ray.get(threaded.empty.remote()),
        "empty call, waited through .future()": lambda: plain.empty.remote().future().result(),
        "ray.put 4.8 MB": lambda: ray.put(pixels),
        "call with 4.8 MB arg (put first)": lambda: ray.get(threaded.take.remote(ray.put(pixels))),
        "call with 4.8 MB arg (inline)": lambda: ray.get(threaded.take.remote(pixels)),
        "call returning 1.6 MB in 1 object": lambda: ray.get(threaded.give_one.remote(result_bytes)),
        "call returning 1.6 MB in 4 objects": lambda: ray.get(
            threaded.give.options(num_returns=4).remote(result_bytes, 4)
        ),
        "np.copy 1.6 MB": lambda: np.zeros(result_bytes // 2, dtype=np.int16).copy(),
    }
    for name, function in rows.items():
        print(f"{name}: {measure(function, args.runs)}", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
