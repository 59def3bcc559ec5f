"""What `EncoderPool.launch` checks in the caller's process before any actor starts.

An actor that cannot start costs seconds (a Ray worker, torch, the model's imports) and reports
through Ray, so the mistakes that can be seen from here are refused here: a model that is not a
local checkpoint directory (a Hub id, a wrong path), a config.json that is missing, unreadable
or of a family vitpool does not serve, and device="cuda" for actors that get no GPU. Only JSON
is read: the caller's process imports no transformers (tests/unit/test_caller_imports.py).

What cannot be seen from here (the weights, a family registered only where the encoder runs,
CUDA on the actors' nodes) is the actors' to report; the launcher raises their errors as their
own types.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitpool.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

# How a full multimodal checkpoint's model_type relates to its tower's: the Qwen, GLM, Kimi and
# PaddleOCR families name their vision config "<model_type>_vision".
_VISION_SUFFIX = "_vision"


def checked_model_directory(model: str | None, joins_a_cluster: bool = False) -> str | None:
    """The checkpoint directory as the actors should get it (absolute: their working directory is
    not the caller's); None for the shipped tiny model.

    `joins_a_cluster`: the pool joins a running Ray cluster, whose actors may sit on nodes that
    hold checkpoints this machine lacks (a driver beside the cluster, not on its filesystem):
    there an absolute path that is not here is left to the actors to check, with a warning.

    Raises:
        CheckpointError: `model` is not a directory here (a Hub id, a typo), or it has no readable
            config.json with a model_type.
    """
    if model is None:
        return None
    directory = Path(model).expanduser()
    if not directory.exists() and joins_a_cluster and directory.is_absolute():
        logger.warning(
            "model %s is not on this machine; the encoder actors will look for it on their nodes", directory
        )
        return str(directory)
    if not directory.exists():
        raise CheckpointError(
            f"model {model!r}: no such directory on this machine. vitpool loads local checkpoints only: "
            f"download it first (e.g. `hf download {model} --local-dir DIR`) and pass DIR"
            if _looks_like_hub_id(model)
            else (
                f"model {model!r}: no such directory on this machine; pass a local Hugging Face "
                "checkpoint directory"
            )
        )
    if not directory.is_dir():
        raise CheckpointError(
            f"model {model!r} is a file; pass the checkpoint's directory (the one holding config.json)"
        )
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{directory} has no config.json; pass a local Hugging Face checkpoint directory"
        )
    model_config(directory)
    return os.path.abspath(directory)


def model_config(directory: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint directory, read as JSON.

    Raises:
        CheckpointError: it cannot be read, is not a JSON object, or names no model_type.
    """
    config_file = Path(directory) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{config_file} cannot be read: {error}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CheckpointError(f"{config_file} names no model_type; is it a Hugging Face model's config?")
    return config


def check_family(directory: str | None, family_modules: str | None) -> None:
    """Refuse a checkpoint of a family vitpool does not serve.

    Built-in families only: `family_modules` (VITPOOL_FAMILY_MODULES as the actors will see it)
    may register others where the encoder runs, which this process need not be able to import;
    then the actors decide. A full checkpoint is accepted if its model_type or its vision
    config's (at the top or in an Omni model's `thinker_config`) is a family's vision type, or that
    type less "_vision" (transformers' own reading, which knows every nesting, runs in the actors).

    Raises:
        CheckpointError: no type in config.json is one vitpool serves (the message lists those).
    """
    if directory is None or family_modules:
        return
    from vitpool.models.registry import FAMILIES  # plain data: no torch, no transformers

    config = model_config(directory)
    vision = config.get("vision_config")
    thinker = config.get("thinker_config")  # the Omni models keep their tower in their thinker's
    if vision is None and isinstance(thinker, Mapping):
        vision = thinker.get("vision_config")
    types = [config["model_type"]]
    if isinstance(vision, Mapping) and isinstance(vision.get("model_type"), str):
        types.append(vision["model_type"])
    if any(name in FAMILIES or f"{name}{_VISION_SUFFIX}" in FAMILIES for name in types):
        return
    named = " / ".join(repr(name) for name in types)
    raise CheckpointError(
        f"{directory}: model type {named} is not one vitpool serves; supported vision model types: "
        f"{sorted(FAMILIES)} (a full checkpoint of one of their models works too)"
    )


def check_device(device: str | None, actor_options: Mapping[str, Any], cluster_gpus: float) -> None:
    """Refuse device="cuda" for actors that get no GPU (each would fail as it starts).

    Raises:
        ConfigError: the message says how to run on the CPU instead.
    """
    if device != "cuda" or float(actor_options.get("num_gpus") or 0) > 0:
        return
    if cluster_gpus <= 0:
        raise ConfigError(
            "device='cuda', but the Ray cluster has no GPU: run on CPUs with device='cpu' (or None), "
            "or join a cluster with GPUs (address=...)"
        )
    raise ConfigError(
        f"device='cuda', but each encoder actor is given no GPU (num_gpus={actor_options.get('num_gpus')}): "
        "give it a GPU or a share of one (actor_options={'num_gpus': 1} or 0.5), or run it with device='cpu'"
    )


def family_modules_for_actors(actor_options: Mapping[str, Any] | None) -> str | None:
    """VITPOOL_FAMILY_MODULES as the encoder actors will see it: their own runtime_env, the job's,
    or this process's environment (which Ray's workers inherit on a local cluster)."""
    import ray

    from vitpool.models.registry import FAMILY_MODULES_VARIABLE as variable

    for runtime_env in ((actor_options or {}).get("runtime_env"), ray.get_runtime_context().runtime_env):
        env_vars = (runtime_env or {}).get("env_vars") or {}
        if env_vars.get(variable):
            return env_vars[variable]
    return os.environ.get(variable) or None


def _looks_like_hub_id(model: str) -> bool:
    """ "owner/name", as the Hugging Face Hub names models (and not a path anyone would type)."""
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and "\\" not in model
