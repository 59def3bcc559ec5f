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

    python benchmarks/channel_overhead.py [--runs 200] [--warmup 30] [--out channel_overhead.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import tempfile
from pathlib import Path

import numpy as np
import torch
from common import image, once_ms, save_random_tower, summarize

from vitpool import EncoderPool, GraphEncoder, Video
from vitpool.actors import OK, BatchReceipt, EncoderActor
from vitpool.actors.local_channel import ChannelClient, ChannelInfo, ChannelServer
from vitpool.items import Embedding
from vitpool.transport.wire import to_array, wire_dtype_name

WORKLOADS = {"1x224": lambda: [image(224)], "4x224": lambda: [image(224) for _ in range(4)]}


def serve_echo(connection, output_width: int, num_deepstack: int) -> None:
    def zeros(tokens: int) -> torch.Tensor:  # NumPy's: torch's would wake a CPU thread pool
        return torch.from_numpy(np.zeros((tokens, output_width), dtype=np.int16)).view(torch.bfloat16)

    def run_batch(metadata, pixels, output_device):
        values = []
        for rows in pixels:
            tokens = rows.shape[0] // 4
            values.append(Embedding(zeros(tokens), [zeros(tokens) for _ in range(num_deepstack)]))
        return values, BatchReceipt(OK)

    server = ChannelServer(run_batch, name="echo")
    connection.send(server.address)
    connection.recv()  # until told to stop


def serve_actor(connection, directory: str) -> None:
    actor = EncoderActor(0, directory, None, None, None, "bfloat16", "cuda", num_threads=4)
    info = actor.info().channel
    connection.send(info.address)
    connection.recv()


def channel_items(items) -> list:
    return [
        (
            (isinstance(item, Video), tuple(item.grid_thw), wire_dtype_name(item.pixel_values.dtype)),
            to_array(item.pixel_values),
            item.pixel_values.shape[0] // 4,
        )
        for item in items
    ]


def channel_call(client: ChannelClient, items: list) -> None:
    future: concurrent.futures.Future = concurrent.futures.Future()
    client.submit(items, future.set_result)
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
    actor = EncoderActor(0, directory, None, None, None, "bfloat16", "cuda", num_threads=4, serve_channel=False)
    spec = actor.encoder.adapter

    context = multiprocessing.get_context("spawn")
    clients, children = {}, []
    for name, target, target_args in (
        ("echo_channel", serve_echo, (spec.output_width, spec.num_deepstack)),
        ("actor_channel", serve_actor, (directory,)),
    ):
        parent_end, child_end = context.Pipe()
        child = context.Process(target=target, args=(child_end, *target_args), daemon=True)
        child.start()
        children.append((child, parent_end))
        address = parent_end.recv()
        clients[name] = ChannelClient(ChannelInfo(address, spec.output_width, spec.num_deepstack, "bfloat16"))
    pool = EncoderPool.launch(model=directory, num_actors=1, dtype="bfloat16", actor_options={"num_gpus": 0.5})

    results = {
        "gpu": gpu, "torch": torch.__version__, "runs": args.runs, "torch_threads": torch.get_num_threads(),
        "workloads": {},
    }
    for workload, build in WORKLOADS.items():
        items = build()
        wire = channel_items(items)
        metadata, pixels = [w[0] for w in wire], [w[1] for w in wire]
        paths = {
            "in_process": lambda: encoder.encode(items),
            "actor_in_process": lambda: actor.run_batch(metadata, pixels),
            "echo_channel": lambda: channel_call(clients["echo_channel"], wire),
            "actor_channel": lambda: channel_call(clients["actor_channel"], wire),
            "pool": lambda: pool.encode(items),
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
