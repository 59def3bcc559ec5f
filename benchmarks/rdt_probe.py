"""Does Ray Direct Transport work here? The smallest case: one actor returns a CPU tensor through
RDT and another sums it, with a collective group of the two (both created with
enable_tensor_transport=True, as RDT requires of a receiver).

    RAY_rdt_fetch_fail_timeout_milliseconds=15000 python benchmarks/rdt_probe.py [torch_gloo|gloo|nccl]

With nccl, both actors take a GPU and the tensor lives on it.
"""

from __future__ import annotations

import os
import sys

import ray
import torch
from ray.experimental.collective import create_collective_group


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "torch_gloo"
    transport = "nccl" if backend == "nccl" else "gloo"
    gpus = 1 if backend == "nccl" else 0
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(include_dashboard=False)

    @ray.remote(num_gpus=gpus)
    class Sender:
        @ray.method(tensor_transport=transport)
        def make(self, n: int) -> torch.Tensor:
            return torch.arange(n, dtype=torch.float32, device="cuda" if gpus else "cpu")

    @ray.remote(num_gpus=gpus)
    class Receiver:
        def take(self, tensor: torch.Tensor) -> float:
            return float(tensor.sum())

    sender = Sender.options(enable_tensor_transport=True).remote()
    receiver = Receiver.options(enable_tensor_transport=True).remote()
    create_collective_group([sender, receiver], backend=backend)
    try:
        total = ray.get(receiver.take.remote(sender.make.remote(10)), timeout=60)
        print(f"RDT over {backend}: received, sum {total} (expected 45.0)")
    except Exception as error:  # noqa: BLE001 - the probe reports whatever happened
        print(f"RDT over {backend}: failed: {type(error).__name__}: {str(error)[:200]}")
    ray.shutdown()


if __name__ == "__main__":
    main()
