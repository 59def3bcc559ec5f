"""The `vitpool` command line: a pool as a cluster service.

    vitpool serve --model PATH --num-actors N [--name NAME] [--address ADDR]   # detached; returns once ready
    vitpool list                          # the pools running in the cluster
    vitpool status [--name NAME]          # the pool's actors and counters, as a short table
    vitpool scale N [--name NAME]         # start or retire actors
    vitpool bench [--name NAME]           # a short latency and throughput check against the pool
    vitpool stop [--name NAME]            # stop the pool, its actors and its vLLM store
    vitpool --version

Every command joins the Ray cluster that `ray.init()` would (`--address`, RAY_ADDRESS, or the
cluster `ray start --head` started on this machine); `serve` refuses to start a private one, which
would end with the command (and `list` with none running says so, starting none). Progress goes to
stderr; an error is one line (exit status 1), not a traceback; a flag's mistake is refused before
Ray is joined (exit status 2), in one line. Ray's own log lines stay off the terminal unless
`--verbose`; `--version` and `--help` import neither Ray nor torch. Only the pool's public API is
used here, but for `list`, which finds the pools' controllers in vitpool's Ray namespace.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.metadata
import logging
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from vitpool.cli_flags import add_setting_flags, given_settings, non_negative_share
from vitpool.errors import InvalidItemError, PoolNotFoundError, VitpoolError, counted

if TYPE_CHECKING:  # the commands import Ray and torch when they run: `--version` and `--help` do not
    from vitpool.items import Image
    from vitpool.pool import EncoderPool
    from vitpool.pool.controller import Membership

logger = logging.getLogger("vitpool.cli")

# The library's errors about actor options name Python keywords (`actor_options={'num_cpus': ...}`,
# `device='cpu'`), which a command-line user cannot pass: `serve` adds the flag that sets each.
SERVE_FLAGS_FOR_ACTOR_OPTIONS = {
    "num_cpus": "--cpus-per-actor",
    "num_gpus": "--gpus-per-actor",
    "device='cpu'": "--device cpu",
}
LIST_TIMEOUT_S = 10.0  # how long `list` waits for each pool's controller to answer
PROGRESS_HANDLER = "vitpool-cli-progress"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _show_progress(args.quiet)
    import ray

    from vitpool.pool.cluster import quiet_ray_logs

    if not args.verbose:
        quiet_ray_logs()
    try:
        return args.command(args)
    except KeyboardInterrupt:
        print("vitpool: interrupted", file=sys.stderr)
        return 130
    except (VitpoolError, ValueError, ConnectionError, TimeoutError, ray.exceptions.RayError) as error:
        message = in_command_line_terms(_one_line(error))
        if args.command_name == "serve":
            message = with_serve_flags(message)
        print(f"vitpool {args.command_name}: error: {message}", file=sys.stderr)
        return 1


def serve(args: argparse.Namespace) -> int:
    from vitpool.pool import EncoderPool

    settings = serve_settings(args)
    start = time.monotonic()
    pool = EncoderPool.launch(
        num_actors=args.num_actors,
        name=args.name,
        address=args.address,
        actor_options=actor_options(args),
        detached=True,
        **settings,
    )
    num_actors = pool.num_actors
    pool.close()  # the pool is detached: it keeps running
    print(
        f"pool {args.name!r} serving with {counted(num_actors, 'encoder actor')} "
        f"({time.monotonic() - start:.1f} s); connect with EncoderPool.connect({args.name!r}), "
        f"stop with `vitpool stop --name {args.name}`"
    )
    return 0


def serve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The pool settings `serve`'s flags set, by field name: those given (a flag left out is None,
    and the pool's own default stands; "none" sets None)."""
    return given_settings(args)


def actor_options(args: argparse.Namespace) -> dict[str, float] | None:
    """`serve`'s flags as Ray options for each encoder actor; None: the pool's defaults (a GPU
    each where the cluster has GPUs, and one CPU)."""
    options = {}
    if args.gpus_per_actor is not None:
        options["num_gpus"] = args.gpus_per_actor
    elif args.device == "cpu":
        options["num_gpus"] = 0
    if args.cpus_per_actor is not None:
        options["num_cpus"] = args.cpus_per_actor
    return options or None


# The library's words for what a Python caller passes, and what a command-line user types instead
# (the same message serves both: the library cannot know who called it).
PYTHON_TO_COMMAND_LINE = {
    "pass address= (--address) or set RAY_ADDRESS": "pass --address or set RAY_ADDRESS",
    "EncoderPool.launch or `vitpool serve`": "`vitpool serve`",
    "call ray.shutdown() first to": "run the command in a fresh process to",
}


def in_command_line_terms(message: str) -> str:
    """`message` with the Python arguments it names put as the command line's flags."""
    for python, command_line in PYTHON_TO_COMMAND_LINE.items():
        message = message.replace(python, command_line)
    return message


def with_serve_flags(message: str) -> str:
    """`message` with the `serve` flags for the actor options it names, unless it names them."""
    if "actor_options" not in message:
        return message
    named = [flag for keyword, flag in SERVE_FLAGS_FOR_ACTOR_OPTIONS.items() if keyword in message]
    flags = [flag for flag in named if flag not in message]
    return f"{message} (vitpool serve: {', '.join(flags)})" if flags else message


def list_pools(args: argparse.Namespace) -> int:
    pools = running_pools(args.address)
    if pools is None:
        from vitpool.pool.cluster import clusters_on_this_machine

        running = clusters_on_this_machine()
        if running:
            verb = "runs" if len(running) == 1 else "run"
            print(
                f"no pools found: {counted(len(running), 'Ray cluster')} {verb} "
                f"on this machine ({', '.join(running)}), but none is joined without an address (Ray's "
                "address file names none that runs): --address names the one to look in"
            )
        else:
            print("no pools: no Ray cluster runs on this machine to look in (--address names one elsewhere)")
        return 0
    if not pools:
        print("no pools")
        return 0
    rows = ["| pool | model | actors | detached |", "|---|---|---|---|"]
    for name, membership in pools:
        if membership is None:
            rows.append(f"| {name} | ? | controller did not answer in {LIST_TIMEOUT_S:.0f} s | ? |")
            continue
        model = membership.settings.model or "shipped tiny model"
        detached = "yes" if membership.settings.detached else "no"
        rows.append(f"| {name} | {model} | {len(membership.actors)} | {detached} |")
    print("\n".join(rows))
    return 0


def running_pools(address: str | None) -> list[tuple[str, Membership | None]] | None:
    """Each pool of the cluster by name, with its membership (None: its controller did not answer
    in time), sorted by name; None where no cluster runs to look in (as `EncoderPool.connect`
    would find it: a private one started here could hold no pool)."""
    import ray

    from vitpool.pool.cluster import join_ray, joins_a_cluster
    from vitpool.pool.controller import NAMESPACE

    if not joins_a_cluster(address):
        return None
    join_ray(address)
    # A pool is its named controller in vitpool's namespace; its encoder actors and standbys are
    # named there too, but only a controller has `membership`.
    controllers = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE:
            continue
        try:
            handle = ray.get_actor(entry["name"], namespace=NAMESPACE)
        except ValueError:
            continue  # gone since it was listed
        if hasattr(handle, "membership"):
            controllers[entry["name"]] = handle
    refs = {name: handle.membership.remote() for name, handle in controllers.items()}
    pools = []
    for name in sorted(refs):
        try:
            membership = ray.get(refs[name], timeout=LIST_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            membership = None
        pools.append((name, membership))
    return pools


def status(args: argparse.Namespace) -> int:
    from vitpool.pool import EncoderPool

    pool = EncoderPool.connect(args.name, args.address)
    try:
        print(pool.stats().summary(this_process=False))  # this command made no call
    finally:
        pool.close()
    return 0


def scale(args: argparse.Namespace) -> int:
    from vitpool.pool import EncoderPool

    pool = EncoderPool.connect(args.name, args.address)
    try:
        before = pool.num_actors
        pool.scale(args.num_actors)
        print(f"pool {args.name!r}: {before} -> {counted(pool.num_actors, 'encoder actor')}")
    finally:
        pool.close()
    return 0


def stop(args: argparse.Namespace) -> int:
    from vitpool.pool import EncoderPool

    try:
        pool = EncoderPool.connect(args.name, args.address)
    except PoolNotFoundError as error:  # stopped already (or never started): nothing left to do
        where = (
            f" in the {error.where}" if error.where else ": no Ray cluster runs on this machine to look in"
        )
        print(f"nothing to stop: no pool named {args.name!r}{where}")
        return 0
    if not pool.settings.detached:
        pool.close()
        raise VitpoolError(
            f"pool {args.name!r} is not detached: it stops with the process that launched it (its shutdown())"
        )
    with _progress_muted():  # shutdown logs "pool ... stopped", which this command prints as its result
        pool.shutdown()  # from any handle, shutdown stops a detached pool
    from vitpool.integrations.vllm.store import stop_store

    # the vLLM gateway's store of this pool, if one ran: detached, it would outlive the pool
    store = " and its vLLM embedding store" if stop_store(args.name) else ""
    print(f"pool {args.name!r}{store} stopped")
    return 0


def bench(args: argparse.Namespace) -> int:
    from vitpool.pool import EncoderPool

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
            f"| pool | actors | item | one call p50 / p99 ms ({args.calls} calls) | items/s ({args.threads} "
            f"threads, {args.seconds:g} s) |\n|---|---|---|---|---|\n"
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
    import torch

    from vitpool.items import Image

    row_shape = tuple(pool.item_rules.row_shape)
    candidates = [Image(torch.randn(256, *row_shape), (1, 16, 16)), Image(torch.randn(1, *row_shape))]
    for candidate in candidates:
        try:
            pool.encode([candidate])
        except InvalidItemError:
            continue
        return candidate
    raise VitpoolError("could not build a sample image for this model; use benchmarks/pool_latency.py")


def version() -> str:
    """The installed distribution's version; the package's own where it runs from a source tree."""
    try:
        return importlib.metadata.version("vitpool")
    except importlib.metadata.PackageNotFoundError:
        import vitpool

        return getattr(vitpool, "__version__", "unknown")


def _describe(item: Image) -> str:
    return (
        f"grid {tuple(item.grid_thw)}" if item.grid_thw is not None else f"{item.pixel_values.shape[0]} tile"
    )


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


@contextlib.contextmanager
def _progress_muted() -> Iterator[None]:
    """vitpool's progress lines (info) hidden while inside; warnings and errors still shown."""
    library = logging.getLogger("vitpool")
    level = library.level
    library.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        library.setLevel(level)


def _show_progress(quiet: bool) -> None:
    """vitpool's progress lines on stderr (the library only logs; the command line shows them)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("vitpool: %(message)s"))
    handler.set_name(PROGRESS_HANDLER)
    library = logging.getLogger("vitpool")
    for earlier in [h for h in library.handlers if h.get_name() == PROGRESS_HANDLER]:
        library.removeHandler(earlier)  # `main` run again in one process would show each line twice
    library.addHandler(handler)
    library.setLevel(logging.WARNING if quiet else logging.INFO)


class _Parser(argparse.ArgumentParser):
    """A flag's mistake in one line naming the command, not the command's whole usage first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vitpool", description="vitpool: a pool of vision encoders on Ray")
    parser.add_argument("--version", action="version", version=f"vitpool {version()}")
    commands = parser.add_subparsers(required=True, metavar="command", parser_class=_Parser)

    def command(name: str, function, text: str, names_a_pool: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text)
        sub.set_defaults(command=function, command_name=name)
        if names_a_pool:
            sub.add_argument("--name", default="vitpool", help="the pool's name (default: vitpool)")
        sub.add_argument("--address", default=None, help="the Ray cluster (default: as ray.init() finds it)")
        sub.add_argument("--quiet", action="store_true", help="no progress lines")
        sub.add_argument("--verbose", action="store_true", help="Ray's own log lines too")
        return sub

    sub = command("serve", serve, "start a detached pool and return once its actors are ready")
    sub.add_argument(
        "--num-actors",
        type=int,
        default=None,
        help="default: one per GPU of the cluster; one on a cluster without GPUs",
    )
    sub.add_argument(
        "--gpus-per-actor",
        type=non_negative_share,
        default=None,
        metavar="N",
        help="GPUs each actor holds, e.g. 0.5 to share a GPU (default 1 on a cluster with GPUs)",
    )
    sub.add_argument(
        "--cpus-per-actor",
        type=non_negative_share,
        default=None,
        metavar="N",
        help="CPUs each actor holds in Ray's accounting, e.g. 0.5 to run more CPU actors than "
        "the cluster has CPUs (default 1)",
    )
    add_setting_flags(sub)
    command("list", list_pools, "the pools in the Ray cluster: name, model, actors", names_a_pool=False)
    command("status", status, "the pool's actors and counters")
    sub = command("scale", scale, "start or retire actors")
    sub.add_argument("num_actors", type=int, help="encoder actors taking work once it returns")
    command("stop", stop, "stop the pool")
    sub = command("bench", bench, "a short latency and throughput check against the running pool")
    sub.add_argument(
        "--calls", type=int, default=50, help="one-item calls timed one by one for p50 / p99 (default 50)"
    )
    sub.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    sub.add_argument(
        "--threads",
        type=int,
        default=4,
        help="threads calling at once for items/s, each again as its call returns (default 4)",
    )
    sub.add_argument(
        "--seconds",
        type=float,
        default=5.0,
        metavar="S",
        help="how long the threads call for items/s (default 5)",
    )
    return parser
