"""The vLLM gateway's command line (`python -m vitpool.integrations.vllm.gateway`): its flags, and
`main`, which joins or launches the pool, opens the publisher and serves the gateway until stopped."""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import time
from pathlib import Path

import torch

from vitpool.dtypes import dtype_from_name
from vitpool.errors import ConfigError, VitpoolError
from vitpool.integrations.vllm import gateway as gateway_module
from vitpool.integrations.vllm.gateway import Gateway, Publisher
from vitpool.integrations.vllm.gateway_model import read_model
from vitpool.integrations.vllm.images import FRONT_SETTINGS, processor_backend
from vitpool.pool.setting_flags import add_pool_setting_flags, given_settings
from vitpool.pool.settings import setting_flag

logger = logging.getLogger(__name__)
_MODEL_READER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vitpool-gateway-model")


def _dtype(name: str) -> torch.dtype:
    try:
        return dtype_from_name(name)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# Pool settings the gateway has no pool-setting flag for, and why: its own flags set them
GATEWAY_OWN_SETTINGS = {
    "model": "--model, the checkpoint vLLM serves, is the launched pool's",
    "dtype": "--dtype, the LLM's dtype, is the launched pool's",
    "detached": "a pool the gateway launches stops with it",
}


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    from vitpool.integrations.vllm.publisher import FilePublisher
    from vitpool.integrations.vllm.store import StorePublisher
    from vitpool.pool import EncoderPool

    parser = argparse.ArgumentParser(
        prog="python -m vitpool.integrations.vllm.gateway",
        description=gateway_module.__doc__,  # the gateway's own account of itself, as its --help
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="the checkpoint directory vLLM serves")
    parser.add_argument("--upstream", required=True, help="vLLM's OpenAI server, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        setting_flag("pool"),
        default=FRONT_SETTINGS["pool"][0],
        help=f"{FRONT_SETTINGS['pool'][1]} (default vitpool)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray cluster (default RAY_ADDRESS, else the one `ray start` last started here)",
    )
    parser.add_argument(
        "--launch-actors",
        type=int,
        default=0,
        help="launch a pool of this many actors in this process instead of connecting to one; "
        "its settings are `vitpool serve`'s flags, below",
    )
    parser.add_argument("--publish", choices=("store", "files"), default="store")
    parser.add_argument("--root", help="with --publish files: the directory vLLM's connector reads")
    parser.add_argument(
        "--max-bytes", type=float, default=8 << 30, help="bytes of embeddings kept (default 8 GiB)"
    )
    parser.add_argument(
        setting_flag("dtype"),
        type=_dtype,
        default=_dtype(FRONT_SETTINGS["dtype"][0]),
        help=f"{FRONT_SETTINGS['dtype'][1]} (default bfloat16)",
    )
    parser.add_argument(
        setting_flag("timeout_s"),
        type=float,
        default=FRONT_SETTINGS["timeout_s"][0],
        metavar="S",
        dest="timeout_s",
        help=f"{FRONT_SETTINGS['timeout_s'][1]}; past it vLLM encodes them itself (default 60)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="hosts whose http(s) images the gateway downloads (default any); others go to "
        "vLLM as they came, under vLLM's own --allowed-media-domains",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    add_pool_setting_flags(
        parser, leave_out=GATEWAY_OWN_SETTINGS, of=", for a pool launched here (--launch-actors)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.publish == "files" and not args.root:
        parser.error("--publish files needs --root")
    settings = given_settings(args, leave_out=GATEWAY_OWN_SETTINGS)
    if settings and not args.launch_actors:
        given = ", ".join(setting_flag(name) for name in settings)
        parser.error(
            f"{given}: pool settings are for a pool the gateway launches (--launch-actors N); a running "
            "pool keeps those it was started with (vitpool serve)"
        )
    try:
        processor_backend()  # a torchvision that cannot load stops the gateway here, before a pool starts
        # the checkpoint's side (its weights' digest, its processor) is read while Ray is joined
        reading = _MODEL_READER.submit(read_model, args.model, args.dtype)
        joining = time.perf_counter()
        # both join Ray through join_ray: a cluster that wants a token this process lacks is a one-line error
        if args.launch_actors:
            pool = EncoderPool.launch(
                args.model,
                num_actors=args.launch_actors,
                name=args.pool,
                address=args.address,
                dtype=str(args.dtype).removeprefix("torch."),
                **settings,
            )
        else:
            pool = EncoderPool.connect(args.pool, address=args.address)
        if args.publish == "files":
            publisher: Publisher = FilePublisher(args.root, max_bytes=int(args.max_bytes))
        else:
            publisher = StorePublisher(args.pool, max_bytes=int(args.max_bytes))
        joined = time.perf_counter()
        model = reading.result()
        gateway = Gateway(
            pool,
            publisher,
            args.model,
            args.upstream,
            dtype=args.dtype,
            encode_timeout_s=args.timeout_s,
            allowed_media_domains=args.allowed_media_domains,
            model=model,
        )
    except (VitpoolError, ValueError, ConnectionError) as error:
        raise SystemExit(f"vitpool gateway: {error}") from None
    dtype = str(args.dtype).removeprefix("torch.")
    ready, age = time.perf_counter(), _process_age_s()
    logger.info(
        "gateway ready%s: the pool and its store joined in %.1f s, then %.1f s more for the checkpoint "
        "(read beside it: the vision weights' digest, the image processor) and the pool's checks",
        "" if age is None else f" {age:.1f} s after its process started",
        joined - joining,
        ready - joined,
    )
    logger.info(
        "vitpool gateway for %s (pool %r, %s, %s image processor) on http://%s:%d, forwarding to %s, "
        "whose --dtype must be %s",
        args.model,
        args.pool,
        args.publish,
        gateway.processor,
        args.host,
        args.port,
        args.upstream,
        dtype,
    )
    try:
        web.run_app(gateway.app(), host=args.host, port=args.port, print=None)
    finally:
        if args.launch_actors:
            pool.shutdown()


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc), None where that cannot be read."""
    try:
        fields = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
