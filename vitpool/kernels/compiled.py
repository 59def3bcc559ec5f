"""Compiled transformer blocks on a GPU: one inductor compile per block class, shared by every
block of the tower and every budget, so the elementwise work between the GEMMs (LayerNorm, residual
adds, GELU, bias, the rotary embedding's fp32 math) runs as a few fused kernels.

Every family's tower is a stack of identical blocks (an `nn.ModuleList` of one class: Qwen's
`blocks`, Kimi-K2.5's `layers`, Qwen3-VL's deepstack mergers). `install_compiled_blocks` routes
each block's forward through `torch.compile(type(block).forward, dynamic=True)`: the compiled code
takes the block as an input (its weights are graph inputs, not constants), and its row count is
symbolic, so every block and every budget share one compile per class (the "regional compilation"
PyTorch recommends for repeated layers). Attention stays outside the compiled code, as an opaque
custom op (`vitpool.kernels.attention`), so the kernel behind it is still chosen at run time.

It is off by default (`GraphEncoder(compiled_blocks=True)` turns it on): it shortens a small
forward's replay but moved neither the pool's throughput nor the latency benchmarks measurably, and
it adds the compile (or, warm, the trace) to every start (`benchmarks/RESULTS.md`, "Startup: build,
capture, memory"; `benchmarks/HISTORY.md`, "Compiled blocks, eager FA4 threshold, same-run parts
off / on"). It takes effect only inside `use_compiled_blocks(True)` (the encoder
sets it around its GPU forwards, before capture, so every graph records the compiled kernels) and
only on CUDA tensors; anything else runs Hugging Face's forward, so the CPU path stays the exact
reference. A block class whose compile fails runs eager from then on, with a warning in the log.

Inductor keeps what it compiles on disk (`compile_cache_dir`: FX graphs, Triton kernels, autotuning
results); it writes each entry to a temporary file and renames it into place, so the actors of a
node can share one directory. A start with a warm cache skips the code generation, most of the
blocks' compile time (same sections); dynamo still traces.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vitpool.kernels.scoped import scoped_value

logger = logging.getLogger(__name__)

# Where compiled artifacts go when neither the setting nor TORCHINDUCTOR_CACHE_DIR names a place.
DEFAULT_COMPILE_CACHE_DIR = Path("~/.cache/vitpool/inductor")
_COMPILED: contextvars.ContextVar[bool] = contextvars.ContextVar("vitpool_compiled_blocks", default=False)
_STATE_LOCK = threading.Lock()
_COMPILED_FORWARDS: dict[type, Callable] = {}  # block class -> its compiled forward
_WORKING: set[type] = set()  # block classes whose compiled forward has run once
_FAILED: set[type] = set()  # block classes that run eager: their compile failed


def use_compiled_blocks(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Let installed blocks run their compiled forward (on CUDA) while the block runs."""
    return scoped_value(_COMPILED, enabled)


def set_compile_cache_dir(directory: str | Path | None) -> Path:
    """Point inductor's on-disk cache at `directory` (None: TORCHINDUCTOR_CACHE_DIR if set, else
    `~/.cache/vitpool/inductor`) and return it. Inductor reads the place from the environment, so
    it holds for the whole process; set it before the first compile."""
    if directory is None:
        directory = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or DEFAULT_COMPILE_CACHE_DIR
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def install_compiled_blocks(tower: torch.nn.Module) -> list[str]:
    """Route the forward of every repeated block of `tower` through its class's compiled forward
    (in effect only under `use_compiled_blocks(True)`). Returns the block classes' names.
    Installing again is harmless."""
    classes: list[str] = []
    for stack in repeated_block_stacks(tower):
        for block in stack:
            if not isinstance(block.forward, functools.partial):
                # a partial of a module-level function (not a bound method): the tower still pickles
                block.forward = functools.partial(_block_forward, block)
        if type(stack[0]).__name__ not in classes:
            classes.append(type(stack[0]).__name__)
    return classes


def repeated_block_stacks(tower: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The `nn.ModuleList`s of `tower` that hold two or more modules of one class."""
    return [
        module
        for module in tower.modules()
        if isinstance(module, torch.nn.ModuleList)
        and len(module) > 1
        and len({type(block) for block in module}) == 1
    ]


def _block_forward(block: torch.nn.Module, *args: object, **kwargs: object) -> object:
    cls = type(block)
    if _COMPILED.get() and cls not in _FAILED and _first_tensor_is_cuda(args, kwargs):
        compiled = _compiled_forward(cls)
        if not torch.is_grad_enabled():
            args = _not_views(args)
        if cls in _WORKING:
            return compiled(block, *args, **kwargs)
        return _first_compiled_call(compiled, block, args, kwargs)
    return cls.forward(block, *args, **kwargs)


def _first_compiled_call(compiled: Callable, block: torch.nn.Module, args: tuple, kwargs: dict) -> object:
    """The first call compiles; a class that cannot be compiled runs eager from then on."""
    cls = type(block)
    start = time.perf_counter()
    try:
        output = compiled(block, *args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any compile failure falls back to eager
        with _STATE_LOCK:
            _FAILED.add(cls)
        logger.warning("%s blocks run eager: torch.compile failed: %s", cls.__name__, _first_line(error))
        return cls.forward(block, *args, **kwargs)
    with _STATE_LOCK:
        _WORKING.add(cls)
    logger.info(
        "compiled %s blocks in %.1f s (cache: %s)",
        cls.__name__,
        time.perf_counter() - start,
        os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default"),
    )
    return output


def _compiled_forward(cls: type) -> Callable:
    with _STATE_LOCK:
        compiled = _COMPILED_FORWARDS.get(cls)
        if compiled is None:
            logger.info(
                "compiling %s blocks (a first start on this node takes a while; later ones read the cache)",
                cls.__name__,
            )
            compiled = torch.compile(cls.forward, dynamic=True)
            _COMPILED_FORWARDS[cls] = compiled
        return compiled


def _not_views(args: tuple) -> tuple:
    """The same tensors, none of them a view: dynamo guards on a view's base, so a stack whose
    first block gets a view and the others fresh tensors would compile twice. `detach` makes an
    alias that is not a view (without autograd it changes nothing else)."""
    return tuple(a.detach() if isinstance(a, torch.Tensor) and a._base is not None else a for a in args)


def _first_tensor_is_cuda(args: tuple, kwargs: dict) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.is_cuda
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
