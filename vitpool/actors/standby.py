"""A process kept ready to become an encoder actor, so that a dead actor is replaced in seconds.

A fresh actor process spends most of its start before the encoder exists: importing torch,
transformers and the engine takes about two thirds of it, more than the CUDA context, loading and
capturing together (`benchmarks/RESULTS.md`, "Startup: build, capture, memory"). A standby has
done the imports and read the checkpoint's files, holds no GPU and has not touched CUDA; when an
actor on its node dies, the pool gives it that actor's GPU (`take_over`), and it loads, captures
and checks its graphs as any actor does, then serves as an encoder actor of the same class.

CUDA reads `CUDA_VISIBLE_DEVICES` once, when its driver starts, so a standby must not start it
before it knows its GPU; `take_over` refuses (and the pool starts a fresh actor) if something
did.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Sequence

from vitpool.actors.encoder_actor import EncoderActor
from vitpool.actors.reports import ActorInfo
from vitpool.encoder_spec import ActorSpec

logger = logging.getLogger(__name__)

_CUDA_ERROR_NOT_INITIALIZED = 3


class StandbyMixin:
    """Makes an encoder actor class a standby: built with only the model path, it becomes an
    encoder actor of that class on `take_over` (the class's own `__init__`, given the GPU)."""

    def __init__(self, model: str | None) -> None:
        start = time.perf_counter()
        import vitpool.graphs  # noqa: F401 - the engine, imported now rather than at take-over
        from vitpool.models.loading import prepare_to_load

        prepare_to_load(model)
        self._standby_seconds = time.perf_counter() - start
        self._taken = False
        logger.info("standby ready in %.1f s (engine imported, checkpoint read)", self._standby_seconds)

    def standby_ready(self) -> float:
        """Seconds the standby took to import the engine and read the checkpoint."""
        return self._standby_seconds

    def take_over(self, actor_index: int, spec: ActorSpec, gpu_ids: Sequence[str]) -> ActorInfo:
        """Become encoder actor `actor_index` on the node's GPUs `gpu_ids` (Ray's ids, which the
        pool holds for it); returns its ActorInfo once its graphs are captured and checked.

        Raises:
            RuntimeError: CUDA was started in this process before it was given its GPU, or it
                was taken over before.
            Exception: what the encoder met as it started (see `EncoderActor.info`).
        """
        if self._taken:
            raise RuntimeError("this standby already took over an encoder actor")
        self._taken = True
        if gpu_ids:
            if cuda_driver_initialized():
                raise RuntimeError(
                    "CUDA was started in this standby before it was given a GPU, so it cannot be "
                    "narrowed to the GPU it takes over (an import started it)"
                )
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        super().__init__(actor_index, spec, gpu_ids=gpu_ids)  # type: ignore[call-arg]  # the actor class's
        return self.info()  # type: ignore[attr-defined]  # the actor class's


class StandbyEncoderActor(StandbyMixin, EncoderActor):
    """A standby that becomes an `EncoderActor`."""


def cuda_driver_initialized() -> bool:
    """Whether this process has started CUDA's driver (`cuInit`); False where there is no driver.
    Every driver call but `cuInit` answers CUDA_ERROR_NOT_INITIALIZED before it."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED
