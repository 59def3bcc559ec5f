"""Does Ray Direct Transport work here? The smallest case: one actor returns a CPU tensor through
RDT and another sums it, with a collective group of the two (both created with
enable_tensor_transport=True, as RDT requires of a receiver).

    RAY_rdt_fetch_fail_timeout_milliseconds=15000 python benchmarks/studies/rdt_probe.py \
        [torch_gloo|gloo|nccl] [receivers] [threaded] [receiver_threads]

With nccl, every actor takes a GPU (a share of one) and the tensor lives on it. `receivers` (1)
receive the same reference at once; `threaded` gives the sender max_concurrency=4, as an encoder
actor has; `receiver_threads` (1) is the receivers' max_concurrency.

Found with it: a receiver with one thread waits for ever when it gets the reference before the
sender has made the tensor (Ray 2.60 submits the receive behind the receiver's own task, which
waits for it); with `receiver_threads` 2 the transfer goes through.
"""

from __future__ import annotations

import os
import sys

import ray
import torch
from ray.experimental.collective import create_collective_group


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "torch_gloo"
    receivers = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    threaded = len(sys.argv) > 3 and sys.argv[3] == "threaded"
    receiver_threads = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    transport = "nccl" if backend == "nccl" else "gloo"
    # a share of a GPU each, or a whole one each with RDT_PROBE_WHOLE_GPUS=1 (NCCL wants one
    # device per rank: two actors on one GPU cannot form a communicator)
    gpus = (1 if os.environ.get("RDT_PROBE_WHOLE_GPUS") else 0.3) if backend == "nccl" else 0
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

    sender = Sender.options(enable_tensor_transport=True, max_concurrency=4 if threaded else 1).remote()
    targets = [
        Receiver.options(enable_tensor_transport=True, max_concurrency=receiver_threads).remote()
        for _ in range(receivers)
    ]
    create_collective_group([sender, *targets], backend=backend)
    case = (
        f"RDT over {backend}, {receivers} receivers with {receiver_threads} threads, "
        f"{'threaded' if threaded else 'plain'} sender"
    )
    try:
        reference = sender.make.remote(10)
        totals = ray.get([target.take.remote(reference) for target in targets], timeout=60)
        print(f"{case}: received, sums {totals} (expected 45.0 each)")
    except Exception as error:  # noqa: BLE001 - the probe reports whatever happened
        print(f"{case}: failed: {type(error).__name__}: {str(error)[:200]}")
    ray.shutdown()


if __name__ == "__main__":
    main()
