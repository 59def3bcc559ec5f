"""The `vitpool` command line: a pool as a cluster service.

    vitpool serve --model PATH --num-actors N [--name NAME] [--address ADDR]   # detached; returns once ready
    vitpool status [--name NAME]          # the pool's actors and counters, as a short table
    vitpool scale N [--name NAME]         # start or retire actors
    vitpool bench [--name NAME]           # a short latency and throughput check against the pool
    vitpool stop [--name NAME]            # stop the pool and its actors

Every command joins the Ray cluster that `ray.init()` would (`--address`, RAY_ADDRESS, or the
cluster `ray start --head` started on this machine); `serve` refuses to start a private one, which
would end with the command. Progress goes to stderr; an error is one line (exit status 1), not a
traceback. Only the pool's public API is used here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import statistics
import sys
import time
from collections.abc import Sequence

import ray
import torch

from vitpool.errors import InvalidItemError, VitpoolError, counted
from vitpool.items import Image
from vitpool.pool import EncoderPool
from vitpool.specs import PRECISION_CHOICES

logger = logging.getLogger("vitpool.cli")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _show_progress(args.quiet)
    try:
        return args.command(args)
    except KeyboardInterrupt:
        print("vitpool: interrupted", file=sys.stderr)
        return 130
    except (VitpoolError, ValueError, ConnectionError, TimeoutError, ray.exceptions.RayError) as error:
        print(f"vitpool {args.command_name}: error: {_one_line(error)}", file=sys.stderr)
        return 1


def serve(args: argparse.Namespace) -> int:
    settings = {"device": args.device} if args.device else {}
    if args.dtype:
        settings["dtype"] = args.dtype
    if args.precision:
        settings["precision"] = args.precision
    if args.embedding_cache_bytes:
        settings["embedding_cache_bytes"] = args.embedding_cache_bytes
    if args.embedding_cache_local_bytes is not None:
        settings["embedding_cache_local_bytes"] = args.embedding_cache_local_bytes
    if args.small_first_stream is not None:
        settings["small_first_stream"] = args.small_first_stream == "on"
    if args.autoscale:
        settings["autoscale"] = _bounds(args.autoscale)
    if args.autoscale_interval is not None:
        settings["autoscale_interval_s"] = args.autoscale_interval
    if args.warm_standby is not None:
        settings["warm_standby"] = args.warm_standby == "on"
    options = None
    if args.gpus_per_actor is not None:
        options = {"num_gpus": args.gpus_per_actor}
    elif args.device == "cpu":
        options = {"num_gpus": 0}
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else None
    start = time.monotonic()
    pool = EncoderPool.launch(
        model=args.model, num_actors=args.num_actors, budgets=budgets, name=args.name, address=args.address,
        actor_options=options, detached=True, **settings,
    )
    num_actors = pool.num_actors
    pool.close()  # the pool is detached: it keeps running
    print(
        f"pool {args.name!r} serving with {counted(num_actors, 'encoder actor')} "
        f"({time.monotonic() - start:.1f} s); connect with EncoderPool.connect({args.name!r}), "
        f"stop with `vitpool stop --name {args.name}`"
    )
    return 0


def status(args: argparse.Namespace) -> int:
    pool = EncoderPool.connect(args.name, args.address)
    try:
        print(pool.stats().summary(this_process=False))  # this command made no call
    finally:
        pool.close()
    return 0


def scale(args: argparse.Namespace) -> int:
    pool = EncoderPool.connect(args.name, args.address)
    try:
        before = pool.num_actors
        pool.scale(args.num_actors)
        print(f"pool {args.name!r}: {before} -> {counted(pool.num_actors, 'encoder actor')}")
    finally:
        pool.close()
    return 0


def stop(args: argparse.Namespace) -> int:
    pool = EncoderPool.connect(args.name, args.address)
    if not pool.settings.detached:
        pool.close()
        raise VitpoolError(
            f"pool {args.name!r} is not detached: it stops with the process that launched it (its shutdown())"
        )
    pool.shutdown()  # from any handle, shutdown stops a detached pool
    print(f"pool {args.name!r} stopped")
    return 0


def bench(args: argparse.Namespace) -> int:
    pool = EncoderPool.connect(args.name, args.address)
    try:
        item = sample_item(pool)
        for _ in range(args.warmup):
            pool.encode([item])
        latencies = []
        for _ in range(args.calls):
            start = time.perf_counter()
            pool.encode([item])
            latencies.append(time.perf_counter() - start)
        deadline = time.monotonic() + args.seconds

        def closed_loop() -> int:
            done = 0
            while time.monotonic() < deadline:
                pool.encode([item])
                done += 1
            return done

        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.threads) as workers:
            items = sum(workers.map(lambda _: closed_loop(), range(args.threads)))
        elapsed = time.monotonic() - start
        latencies.sort()
        p99 = latencies[min(len(latencies) - 1, round(0.99 * len(latencies)) - 1)]
        print(
            f"| pool | actors | item | one call p50 / p99 ms ({args.calls} calls) | items/s ({args.threads} threads, "
            f"{args.seconds:g} s) |\n|---|---|---|---|---|\n"
            f"| {args.name} | {pool.num_actors} | {_describe(item)} | "
            f"{statistics.median(latencies) * 1e3:.2f} / {p99 * 1e3:.2f} | {items / elapsed:.1f} |"
        )
    finally:
        pool.close()
    return 0


def sample_item(pool: EncoderPool) -> Image:
    """A random image the pool's model takes: a 16 x 16 patch grid for grid families, one tile
    for tiled ones.

    Raises:
        VitpoolError: no such sample fits this model.
    """
    row_shape = tuple(pool.item_rules.row_shape)
    candidates = [Image(torch.randn(256, *row_shape), (1, 16, 16)), Image(torch.randn(1, *row_shape))]
    for candidate in candidates:
        try:
            pool.encode([candidate])
        except InvalidItemError:
            continue
        return candidate
    raise VitpoolError("could not build a sample image for this model; use benchmarks/pool_latency.py")


def _bounds(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise VitpoolError(f"--autoscale {text!r}: use MIN,MAX, e.g. 1,4") from None
    return low, high


def _describe(item: Image) -> str:
    return f"grid {tuple(item.grid_thw)}" if item.grid_thw is not None else f"{item.pixel_values.shape[0]} tile"


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _show_progress(quiet: bool) -> None:
    """vitpool's progress lines on stderr (the library only logs; the command line shows them)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("vitpool: %(message)s"))
    library = logging.getLogger("vitpool")
    library.addHandler(handler)
    library.setLevel(logging.WARNING if quiet else logging.INFO)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitpool", description="vitpool: a pool of vision encoders on Ray")
    commands = parser.add_subparsers(required=True, metavar="command")

    def command(name: str, function, text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text)
        sub.set_defaults(command=function, command_name=name)
        sub.add_argument("--name", default="vitpool", help="the pool's name (default: vitpool)")
        sub.add_argument("--address", default=None, help="the Ray cluster (default: as ray.init() finds it)")
        sub.add_argument("--quiet", action="store_true", help="no progress lines")
        return sub

    sub = command("serve", serve, "start a detached pool and return once its actors are ready")
    sub.add_argument("--model", default=None, help="local checkpoint directory (default: the shipped tiny model)")
    sub.add_argument("--num-actors", type=int, default=None, help="default: one per GPU of the cluster")
    sub.add_argument("--device", choices=("cuda", "cpu"), default=None)
    sub.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    sub.add_argument("--precision", choices=PRECISION_CHOICES, default=None,
                     help="fp8: the blocks' GEMMs in FP8 on Ada/Hopper GPUs (default bf16)")
    sub.add_argument("--budgets", default=None, help="comma-separated token budgets (default: the device's)")
    sub.add_argument("--gpus-per-actor", type=float, default=None, help="e.g. 0.5 to share a GPU (default 1)")
    sub.add_argument("--embedding-cache-bytes", type=int, default=0, help="the shared embedding cache (0: off)")
    sub.add_argument("--embedding-cache-local-bytes", type=int, default=None, metavar="BYTES",
                     help="with the cache on, what each connected handle keeps of it in its own process "
                     "(default: the smaller of the cache's bound and 256 MiB; 0: none)")
    sub.add_argument("--small-first-stream", choices=("on", "off"), default=None,
                     help="small batches interrupt large runs on GPU actors (default: off; see the README)")
    sub.add_argument("--autoscale", default=None, metavar="MIN,MAX", help="actors added while busy, retired while idle")
    sub.add_argument("--autoscale-interval", type=float, default=None, metavar="S",
                     help="seconds between the autoscaler's readings (default 5)")
    sub.add_argument("--warm-standby", choices=("on", "off"), default=None,
                     help="a process per node ready to replace a dead actor (default: on for GPU actors)")
    command("status", status, "the pool's actors and counters")
    sub = command("scale", scale, "start or retire actors")
    sub.add_argument("num_actors", type=int)
    command("stop", stop, "stop the pool")
    sub = command("bench", bench, "a short latency and throughput check against the running pool")
    sub.add_argument("--calls", type=int, default=50)
    sub.add_argument("--warmup", type=int, default=5)
    sub.add_argument("--threads", type=int, default=4)
    sub.add_argument("--seconds", type=float, default=5.0)
    return parser
