"""A process kept ready to become an encoder actor, so that a dead actor is replaced in seconds.

A fresh actor process spends most of its start before the encoder exists: importing torch,
transformers and the engine takes about two thirds of it, more than the CUDA context, loading and
capturing together (`benchmarks/RESULTS.md`, "Startup: build, capture, memory"). Every standby does
the imports and reads the checkpoint's files. Given an actor's spec and GPU (`built_ahead`, the
pool's `standby_graphs`), it also builds the encoder there, graphs captured and checked, beside the
actor that runs on that GPU: a take-over is then a switch, the standby serving at once from the GPU
it built on. Without them it holds no GPU and has not touched CUDA; when an actor on its node dies,
the pool gives it that actor's GPU (`take_over`), and it loads, captures and checks its graphs as
any actor does. Either way it then serves as an encoder actor of the same class.

CUDA reads `CUDA_VISIBLE_DEVICES` once, when its driver starts, so a standby narrows it to its GPU
before anything starts CUDA; `take_over` refuses (and the pool starts a fresh actor) if something
did before a standby without an encoder was given its GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vitpool.actors.encoder_actor import EncoderActor
from vitpool.actors.reports import ActorInfo, StandbyState
from vitpool.encoder_spec import ActorSpec

if TYPE_CHECKING:
    from vitpool.graphs import GraphEncoder

logger = logging.getLogger(__name__)

_CUDA_ERROR_NOT_INITIALIZED = 3


class StandbyMixin:
    """Makes an encoder actor class a standby: built with the model path (and, to build the encoder
    ahead, an actor's spec and the node's GPUs to build it on), it becomes an encoder actor of that
    class on `take_over` (the class's own `__init__`)."""

    def __init__(self, model: str | None, spec: ActorSpec | None = None, gpu_ids: Sequence[str] = ()) -> None:
        start = time.perf_counter()
        import vitpool.graphs  # noqa: F401 - the engine, imported now rather than at take-over
        from vitpool.models.loading import prepare_to_load

        prepare_to_load(model)
        self._taken = False
        self._spec, self._gpu_ids = spec, [str(gpu) for gpu in gpu_ids]
        self._encoder = None if spec is None else self._build_ahead(spec)
        self._state = StandbyState(
            seconds=time.perf_counter() - start,
            built_ahead=self._encoder is not None,
            device=str(self._encoder.device) if self._encoder is not None else "",
            gpu_ids=list(self._gpu_ids),
            device_bytes=_reserved_bytes(self._encoder),
        )
        if self._encoder is None:
            logger.info("standby ready in %.1f s (engine imported, checkpoint read)", self._state.seconds)
        else:
            logger.info(
                "standby ready in %.1f s on %s (GPUs %s): encoder built, graphs captured, %.2f GiB held",
                self._state.seconds,
                self._state.device,
                ",".join(self._gpu_ids) or "none",
                self._state.device_bytes / 2**30,
            )

    def _build_ahead(self, spec: ActorSpec) -> GraphEncoder | None:
        """The encoder on the standby's GPUs, or None (logged) where it cannot be built now: the
        standby then builds at take-over, as one without an encoder does."""
        import torch

        from vitpool.graphs import GraphEncoder

        if self._gpu_ids:
            if cuda_driver_initialized():
                logger.warning(
                    "CUDA was started in this standby before it knew its GPU: it built nothing ahead"
                )
                return None
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self._gpu_ids)
        torch.set_num_threads(spec.num_threads)
        try:
            return GraphEncoder.from_spec(spec.encoder)
        except Exception as error:  # noqa: BLE001 - out of memory beside the GPU's actor, ...
            logger.warning(
                "the standby could not build its encoder ahead (%s: %s); the pool starts a fresh actor "
                "instead of it",
                type(error).__name__,
                error,
            )
            return None

    def standby_ready(self) -> float:
        """Seconds the standby took to import the engine and read the checkpoint (and build the
        encoder, where it builds ahead)."""
        return self._state.seconds

    def standby_state(self) -> StandbyState:
        """What the standby holds (`StandbyState`)."""
        return self._state

    def take_over(self, actor_index: int, spec: ActorSpec, gpu_ids: Sequence[str]) -> ActorInfo:
        """Become encoder actor `actor_index`; returns its ActorInfo once it serves. A standby that
        built its encoder ahead serves at once, on the GPUs it built on (`gpu_ids` are then not
        used: the pool checks where it runs); one without loads, captures and checks on the node's
        GPUs `gpu_ids` (Ray's ids, which the pool holds for it).

        Raises:
            RuntimeError: it was taken over before; it was to build ahead and could not, or built
                for another encoder; or CUDA was started in this process before it was given its GPU.
            Exception: what the encoder met as it started (see `EncoderActor.info`).
        """
        if self._taken:
            raise RuntimeError("this standby already took over an encoder actor")
        self._taken = True
        if self._spec is not None and self._encoder is None:
            raise RuntimeError("this standby could not build its encoder ahead (its log says why)")
        if self._encoder is not None:
            assert self._spec is not None
            if spec.encoder != self._spec.encoder:
                raise RuntimeError("this standby built its encoder for other settings than the actor's")
            encoder, self._encoder = self._encoder, None
            super().__init__(actor_index, spec, gpu_ids=self._gpu_ids, encoder=encoder)  # type: ignore[call-arg]
            return self.info()  # type: ignore[attr-defined]  # the actor class's
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


def _reserved_bytes(encoder: GraphEncoder | None) -> int:
    """The GPU memory the standby's process holds for its encoder (0 on a CPU or without one)."""
    if encoder is None or encoder.device.type != "cuda":
        return 0
    import torch

    return int(torch.cuda.memory_reserved(encoder.device))
