"""The vLLM gateway's checks at start that the pool it is given fits the model vLLM serves: the
same vision weights (else refused), and the LLM's dtype (else a warning)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from vitpool.errors import ConfigError, VitpoolError
from vitpool.models.loading import vision_weights_digest

logger = logging.getLogger(__name__)


def check_same_tower(pool: Any, checkpoint: str | Path, weights_digest: str) -> None:
    """Refuse a pool whose checkpoint has other vision weights than `checkpoint` (vLLM's): its
    embeddings would answer vLLM's requests silently wrong. A pool whose checkpoint this process
    cannot read (another node's path) is trusted, with a warning.

    Raises:
        ConfigError: the pool's vision weights differ from the checkpoint's.
    """
    settings = getattr(pool, "settings", None)
    if settings is None:  # not an EncoderPool (a test's stand-in): nothing to compare
        return
    pool_model = settings.model
    if pool_model is not None and Path(pool_model).resolve() == Path(checkpoint).resolve():
        return
    try:
        theirs = vision_weights_digest(pool_model)
    except (VitpoolError, OSError) as error:
        logger.warning(
            "vitpool gateway: cannot read the pool's checkpoint %s here (%s); trusting that its "
            "vision weights are those of %s",
            pool_model,
            error,
            checkpoint,
        )
        return
    if theirs != weights_digest:
        raise ConfigError(
            f"the pool runs {pool_model or 'the shipped tiny checkpoint'}, whose vision weights differ from "
            f"those of {checkpoint} (the model vLLM serves): its embeddings would be wrong for it"
        )


def check_same_dtype(pool: Any, dtype: torch.dtype) -> None:
    """Warn where the pool runs its tower in another dtype than the LLM's (`dtype`, vLLM's
    `--dtype`): vLLM's own tower runs in the LLM's, so answers then match it more loosely (a
    float32 pool under a bfloat16 vLLM: ~1e-2 in logprobs instead of ~1e-4)."""
    settings = getattr(pool, "settings", None)
    pool_dtype = getattr(settings, "dtype", None)
    if pool_dtype is not None and pool_dtype != str(dtype).removeprefix("torch."):
        logger.warning(
            "vitpool gateway: the pool runs its tower in %s and the LLM in %s (--dtype): answers "
            "differ from vLLM's own tower's by up to ~1e-2; launch the pool with dtype=%s",
            pool_dtype,
            str(dtype).removeprefix("torch."),
            str(dtype).removeprefix("torch."),
        )
