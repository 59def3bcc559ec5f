"""A tensor-parallel LLM deployment served by a colocated encoder pool.

Two Ray worker actors stand for two tensor-parallel ranks of a small Qwen3-VL language model
(random weights, the same in both ranks). They sit in a placement group of one bundle per GPU;
the encoder pool puts one actor in each bundle, on a quarter of that GPU (or, with
`--encoder own-gpu`, one actor on a GPU of its own). A request with images flows:
`pool.deliver_to(ranks).encode(items)` (one encode) -> both ranks receive the embeddings, over
Ray Direct Transport (NCCL between GPUs, gloo between CPU actors) where it works, else from the
node's object store (no copy per rank) -> each rank generates with them. Both ranks check that they received
identical embeddings and produce the same tokens (there is no tokenizer offline, so the tokens
are printed as ids).

    python examples/tp_llm.py                       # CPU: two fake GPUs, CPU actors
    python examples/tp_llm.py --device cuda --model DIR --benchmark 50

On the CPU it starts a Ray cluster of its own (its fake GPUs), beside any cluster already running
on the machine; with `--device cuda` it joins the running one (`ray start --head`, RAY_ADDRESS),
else starts one, and needs two GPUs in it (three with `--encoder own-gpu`).

`--benchmark N` times, N times after warm-up, the delivery of 8 images of 448² onto both ranks'
devices (median and p99), against the same encode with `pool.encode` fetched by the caller alone.
NCCL cannot put two members of one group on one GPU, so RDT from a colocated pool falls back to
the object store: use `--encoder own-gpu` (a third GPU) for NCCL.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import statistics
import time

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vitpool import DeliveryLayout, EncoderPool, Image, received_embeddings

ROW_WIDTH = 3 * 2 * 16 * 16
TP_RANKS = 2


@ray.remote
class Rank:
    """One tensor-parallel rank: here the whole small model, so that it can generate alone."""

    def __init__(self, rank: int, vision_model: str | None, device: str) -> None:
        from transformers import AutoConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

        from vitpool.models.loading import SHIPPED_CHECKPOINT

        self.rank, self.device = rank, device
        vision = AutoConfig.from_pretrained(vision_model or SHIPPED_CHECKPOINT).to_dict()
        config = Qwen3VLConfig(
            vision_config=vision,
            text_config={
                "hidden_size": vision["out_hidden_size"],
                "intermediate_size": 256,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "vocab_size": 151936,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [6, 5, 5],
                    "mrope_interleaved": True,
                },
            },
        )
        torch.manual_seed(0)  # the same weights in every rank
        self.model = Qwen3VLForConditionalGeneration(config).eval().to(device)
        self.config = config

    def receive(self, outputs: list, layout: DeliveryLayout) -> str:
        """Take a delivered encode (Ray resolved the reference to `outputs`); return its digest."""
        self.embeddings = received_embeddings(outputs, layout)
        digest = hashlib.sha256()
        for embedding in self.embeddings:
            for tensor in (embedding.tokens, *embedding.deepstack):
                digest.update(tensor.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def generate(self, grids: list, max_new_tokens: int) -> list[int]:
        """Generate with the received embeddings standing in for the vision tower."""
        from vitpool.integrations.transformers import replace_vision_tower

        config = self.config
        ids = [1, 2, 3]
        for t, h, w in grids:
            ids += (
                [config.vision_start_token_id]
                + [config.image_token_id] * (t * h * w // 4)
                + [config.vision_end_token_id]
            )
        ids += [4, 5]
        input_ids = torch.tensor([ids], device=self.device)
        rows = sum(t * h * w for t, h, w in grids)
        replace_vision_tower(self.model, Delivered(self.embeddings))
        with torch.no_grad():
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                pixel_values=torch.zeros(rows, ROW_WIDTH, device=self.device),  # the tower ignores them
                image_grid_thw=torch.tensor(grids, device=self.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        return output[0, len(ids) :].tolist()

    def fetch(self, outputs: list, layout: DeliveryLayout) -> int:
        """Take a delivered encode onto this rank's device (where the LLM needs it)."""
        embeddings = [
            e.tokens.to(self.device, non_blocking=True) for e in received_embeddings(outputs, layout)
        ]
        if self.device == "cuda":
            torch.cuda.synchronize()
        return len(embeddings)


class Delivered:
    """An encoder that answers with embeddings already received (the pool ran them once)."""

    def __init__(self, embeddings: list) -> None:
        self.embeddings = embeddings

    def encode(self, items: list) -> list:
        assert len(items) == len(self.embeddings), (len(items), len(self.embeddings))
        return self.embeddings


def images(count: int, side: int, seed: int) -> list[Image]:
    generator = torch.Generator().manual_seed(seed)
    patches = side // 16
    return [
        Image(torch.randn(patches * patches, ROW_WIDTH, generator=generator), (1, patches, patches))
        for _ in range(count)
    ]


def timed(function, runs: int) -> dict:
    for _ in range(max(3, runs // 10)):
        function()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return {
        "median_ms": statistics.median(samples),
        "p99_ms": samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", default=None, help="vision checkpoint directory (default: the shipped tiny model)"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "object_store", "rdt"],
        help="auto: Ray Direct Transport (NCCL on GPUs, gloo on CPUs) where it works, else the object store",
    )
    parser.add_argument(
        "--encoder",
        default="colocated",
        choices=["colocated", "own-gpu"],
        help="an encoder actor on a quarter of each rank's GPU, or one encoder actor on a GPU of its own",
    )
    parser.add_argument(
        "--benchmark", type=int, default=0, help="time the delivery of 8 x 448² this many times"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    own_gpu = args.encoder == "own-gpu"
    num_gpus = TP_RANKS + own_gpu
    if args.device == "cpu":
        # A cluster of this process's own, beside any other on the machine (`ray start`, RAY_ADDRESS):
        # Ray fakes its GPUs (and enough CPUs) so that the same placement works everywhere.
        ray.init(
            address="local", include_dashboard=False, num_gpus=num_gpus, num_cpus=max(4, os.cpu_count() or 1)
        )
    else:
        ray.init(include_dashboard=False)  # the running cluster (`ray start`, RAY_ADDRESS), else a local one
        if ray.cluster_resources().get("GPU", 0) < num_gpus:
            raise SystemExit(
                f"the Ray cluster at {ray.get_runtime_context().gcs_address} has "
                f"{ray.cluster_resources().get('GPU', 0):g} GPUs; "
                f"this needs {num_gpus} (or run with --device cpu)"
            )
    group = placement_group([{"GPU": 1, "CPU": 1}] * TP_RANKS, strategy="PACK")
    ray.get(group.ready(), timeout=300)
    ranks = [
        # enable_tensor_transport and a second thread: what Ray Direct Transport needs of a receiver
        Rank.options(
            num_gpus=0.75,
            num_cpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, r),
            enable_tensor_transport=True,
            max_concurrency=2,
        ).remote(r, args.model, args.device)
        for r in range(TP_RANKS)
    ]
    settings = {} if args.device == "cuda" else {"device": "cpu", "budgets": [64, 256]}
    if args.transport != "object_store":
        settings["rank_transport"] = "nccl" if args.device == "cuda" else "gloo"
    placement = (
        {"num_actors": 1, "actor_options": {"num_gpus": 1}}
        if own_gpu
        else {"placement_group": group, "actor_options": {"num_gpus": 0.25}}
    )
    pool = EncoderPool.launch(model=args.model, name="tp-llm-encoder", **placement, **settings)
    try:
        delivery = pool.deliver_to(ranks, transport="auto" if args.transport == "rdt" else args.transport)
        if args.transport == "rdt" and delivery.transport == "object_store":
            raise SystemExit("Ray Direct Transport cannot work here (the warning above says why)")
        print(f"delivering through {delivery.transport} from encoder actor {delivery.actor_index}")
        request = images(2, 224, seed=1)
        reference, layout = delivery.encode(request)  # one encode for every rank
        digests = ray.get([rank.receive.remote(reference, layout) for rank in ranks])
        assert len(set(digests)) == 1, f"the ranks received different embeddings: {digests}"
        print(f"both ranks received identical embeddings (sha256 {digests[0][:16]}...)")
        grids = [tuple(item.grid_thw) for item in request]
        tokens = ray.get([rank.generate.remote(grids, args.new_tokens) for rank in ranks])
        assert tokens[0] == tokens[1], tokens
        print(f"both ranks generated the same {len(tokens[0])} tokens: {tokens[0]}")

        if args.benchmark:
            batch = images(8, 448, seed=2)

            def to_ranks() -> None:
                reference, layout = delivery.encode(batch)
                ray.get([rank.fetch.remote(reference, layout) for rank in ranks])

            delivered = timed(to_ranks, args.benchmark)
            to_caller = timed(lambda: pool.encode(batch), args.benchmark)
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
            print(f"\n{gpu}; encoder {args.encoder}; 8 x 448² images, {args.benchmark} runs, median (p99) ms")
            print("| path | median | p99 |\n|---|---|---|")
            print(
                f"| delivered to both ranks' {args.device} ({delivery.transport}) "
                f"| {delivered['median_ms']:.2f} | {delivered['p99_ms']:.2f} |"
            )
            print(
                f"| encode, fetched by the caller "
                f"| {to_caller['median_ms']:.2f} | {to_caller['p99_ms']:.2f} |"
            )
    finally:
        pool.shutdown()
        for rank in ranks:
            ray.kill(rank)
        remove_placement_group(group)
        ray.shutdown()


if __name__ == "__main__":
    main()
