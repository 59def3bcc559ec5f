"""Where a pool call's time goes on the same-node channel, piece by piece, in one run.

For 1x224² and 4x224² on the real-size Qwen3-VL-8B tower (random bf16 weights), median of many
calls after warm-up:
- in_process: GraphEncoder.encode, results on the GPU, synchronised (the pool's baseline);
- actor_in_process: EncoderActor.run_batch in this process (the actor's own work: pixels from
  NumPy, outputs to pinned host memory), no transport;
- echo_channel: the channel to a server in another process that answers at once with
  precomputed outputs of the right size (transport only: copies, socket, thread hand-offs);
- actor_channel: the channel to an EncoderActor in another (non-Ray) process;
- pool: EncoderPool.encode with one actor (Ray actor, channel, dispatcher).

    python benchmarks/studies/channel_overhead.py [--runs 200] [--warmup 30] [--out channel_overhead.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

import numpy as np
import torch
from common import image, once_ms, save_random_tower, summarize

from vitpool import EncoderPool, GraphEncoder
from vitpool.actors.encoder_actor import EncoderActor
from vitpool.encoder_spec import ActorSpec, EncoderSpec
from vitpool.items import Embedding, prepare_items
from vitpool.packing import pack
from vitpool.specs import BatchPlan, OutputLayout
from vitpool.transport.channel import ChannelClient, ChannelInfo, ChannelServer
from vitpool.transport.link import OK, BatchReceipt
from vitpool.transport.wire import to_array

WORKLOADS = {"1x224": lambda: [image(224)], "4x224": lambda: [image(224) for _ in range(4)]}


def actor_spec(directory: str, serve_channel: bool = True) -> ActorSpec:
    return ActorSpec(
        EncoderSpec(model=directory, dtype="bfloat16", device="cuda"),
        num_threads=4,
        serve_channel=serve_channel,
    )


def serve_echo(connection, layout: OutputLayout) -> None:
    def zeros(shape: tuple[int, ...]) -> torch.Tensor:  # NumPy's: torch's would wake a CPU thread pool
        return torch.from_numpy(np.zeros(shape, dtype=np.int16)).view(torch.bfloat16)

    def run_batch(plan, pixels, output_device):
        values = [
            Embedding.from_outputs([zeros(s) for s in layout.shapes(spec.num_tokens)]) for spec in plan.specs
        ]
        return values, BatchReceipt(OK)

    server = ChannelServer(run_batch, "echo", None, 0.0, layout)
    connection.send(server.info)
    connection.recv()  # until told to stop


def serve_actor(connection, directory: str) -> None:
    actor = EncoderActor(0, actor_spec(directory))
    connection.send(actor.info().channel)
    connection.recv()


def planned(items, actor) -> tuple[BatchPlan, list]:
    """The items as the pool's dispatcher would send them: one plan, their pixels as arrays."""
    prepared = prepare_items(items, actor.encoder.adapter.item_rules)
    [batch] = pack([p.spec for p in prepared], actor.encoder.budgets)
    return BatchPlan(batch.budget, tuple(prepared[i].spec for i in batch.item_indices)), [
        to_array(prepared[i].pixels) for i in batch.item_indices
    ]


def channel_call(client: ChannelClient, plan: BatchPlan, pixels: list) -> None:
    future: concurrent.futures.Future = concurrent.futures.Future()
    client.submit(plan, pixels, future.set_result)
    reply = future.result(60)
    assert not isinstance(reply, BaseException), reply


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--paths", default=None, help="comma-separated subset of the paths to time")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads in this process")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = torch.cuda.get_device_name()
    directory = str(save_random_tower(tempfile.mkdtemp(prefix="vitpool-bench-")))
    encoder = GraphEncoder.from_pretrained(directory, device="cuda", dtype=torch.bfloat16)
    actor = EncoderActor(0, actor_spec(directory, serve_channel=False))

    context = multiprocessing.get_context("spawn")
    clients, children = {}, []
    for name, target, target_args in (
        ("echo_channel", serve_echo, (actor.encoder.output_layout,)),
        ("actor_channel", serve_actor, (directory,)),
    ):
        parent_end, child_end = context.Pipe()
        child = context.Process(target=target, args=(child_end, *target_args), daemon=True)
        child.start()
        children.append((child, parent_end))
        info: ChannelInfo = parent_end.recv()
        clients[name] = ChannelClient(info)
    pool = EncoderPool.launch(
        model=directory, num_actors=1, dtype="bfloat16", actor_options={"num_gpus": 0.5}
    )

    results = {
        "gpu": gpu,
        "torch": torch.__version__,
        "runs": args.runs,
        "torch_threads": torch.get_num_threads(),
        "workloads": {},
    }
    for workload, build in WORKLOADS.items():
        items = build()
        plan, pixels = planned(items, actor)
        paths = {
            "in_process": lambda items=items: encoder.encode(items),
            "actor_in_process": lambda plan=plan, pixels=pixels: actor.run_batch(plan, pixels),
            "echo_channel": lambda plan=plan, pixels=pixels: channel_call(
                clients["echo_channel"], plan, pixels
            ),
            "actor_channel": lambda plan=plan, pixels=pixels: channel_call(
                clients["actor_channel"], plan, pixels
            ),
            "pool": lambda items=items: pool.encode(items),
        }
        if args.paths:
            paths = {name: paths[name] for name in args.paths.split(",")}
        samples = {name: [] for name in paths}
        for _ in range(args.warmup):
            for function in paths.values():
                once_ms(function)
        for _ in range(args.runs):
            for name, function in paths.items():
                samples[name].append(once_ms(function))
        results["workloads"][workload] = {name: summarize(values) for name, values in samples.items()}
    pool.shutdown()
    for client in clients.values():
        client.close()
    for child, parent_end in children:
        parent_end.send("stop")
        child.join(timeout=10)

    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    names = list(next(iter(results["workloads"].values())))
    print(f"\nGPU: {gpu}; torch threads here {torch.get_num_threads()}; median (p99) ms of {args.runs} runs")
    print("| workload | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for workload, row in results["workloads"].items():
        cells = [f"{row[n]['median_ms']:.2f} ({row[n]['p99_ms']:.2f})" for n in names]
        print(f"| {workload} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
