"""Build a model adapter from a local Hugging Face directory, or from the checkpoint vitpool ships.

A directory holds either a vision-tower-only save (config `model_type` like "qwen3_vl_vision")
or a full multimodal checkpoint (a config with `vision_config`; the vision weights sit under the
prefixes the family's `CheckpointLayout` names, `model.visual.` or `visual.` by default, and the
layout's `convert` turns them into the module's state; a release whose config.json only its own
remote code reads is read by the layout's `read_full_config`, found by the vision config's
`model_type`). Only safetensors are read, and of a full checkpoint only the shards that hold
vision weights. Weights load strictly: a missing or unexpected key is an error that names it. A
directory with a config and no weights gives random weights (benchmarks). The image processor's
settings saved beside the checkpoint, where there are any, go to the family with the tower's
config (`IMAGE_PROCESSOR_ATTRIBUTE`): some towers' input sizes are their processor's settings
(Step-3.7's and DeepSeek-OCR-2's crops). Which tower and adapter a config gets is
`vitpool.models.registry`'s business.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open

from vitpool.errors import CheckpointError
from vitpool.models.protocol import VisionAdapter, check_adapter
from vitpool.models.registry import CheckpointLayout, Family, find_family, supported_model_types, tower_family

logger = logging.getLogger(__name__)

SHIPPED_CHECKPOINT = Path(__file__).parent / "checkpoints" / "tiny-qwen3-vl"

_SHOWN_KEYS = 8
# Where transformers reads an image processor's settings from a directory, in its order: a
# processor's own config with them nested under "image_processor" (what transformers 5 saves), else
# the image processor's file.
PROCESSOR_CONFIG, IMAGE_PROCESSOR_CONFIG = "processor_config.json", "preprocessor_config.json"
# The tower config's attribute that carries them to the family's `build_tower`: {"file": the path
# they were read from, "settings": the image processor's settings}; absent where none are saved.
IMAGE_PROCESSOR_ATTRIBUTE = "vitpool_image_processor"


def load_adapter(path: str | Path | None, device: torch.device, dtype: torch.dtype) -> VisionAdapter:
    """The tower of the checkpoint at `path` (None: the shipped tiny model), on `device` in `dtype`.

    Raises:
        CheckpointError: no config, an unsupported model, non-safetensors weights, weights that do
            not match the tower (the message names the keys), or an unreadable processor config.
        TypeError: the family's adapter (one registered from outside vitpool) lacks a member the
            protocol declares with a default (`check_adapter`).
    """
    directory = _checkpoint_directory(path)
    family, tower_config, is_full_model = _read_config(directory)
    image_processor = _image_processor_settings(directory)
    if image_processor is not None:
        setattr(tower_config, IMAGE_PROCESSOR_ATTRIBUTE, image_processor)
    with torch.device(device):
        tower = family.build_tower(tower_config, dtype)
    weight_files = _weight_files(directory)
    if weight_files:
        state = _read_vision_weights(weight_files, family.checkpoint, is_full_model)
        if family.checkpoint.convert is not None:
            state = family.checkpoint.convert(state, tower_config)
        _load_strictly(tower, state, directory)
    else:
        logger.warning("%s has no weights: the tower has random weights", directory)
    return check_adapter(family.adapter(tower.eval().requires_grad_(False)))


def prepare_to_load(path: str | Path | None) -> None:
    """What `load_adapter` does before it needs a device: import the tower's code (its family's
    module and transformers' model module) and read its vision weights once, so that their pages
    sit in the OS cache (a full model's language weights are not read). A process kept ready to
    take over a GPU (`vitpool.actors.standby`) calls this; it does not touch CUDA.

    Raises:
        CheckpointError: as for `load_adapter`.
    """
    directory = _checkpoint_directory(path)
    family, _, is_full_model = _read_config(directory)
    weight_files = _weight_files(directory)
    if weight_files:
        _read_vision_weights(weight_files, family.checkpoint, is_full_model)  # read, then let go


def vision_weights_digest(path: str | Path | None) -> str:
    """A 128-bit XXH3 digest of the vision weights the tower of `path` loads (each tensor's name,
    dtype, shape and bytes, as saved; a full checkpoint's language model is not read): checkpoints
    with one digest give one tower. A directory without weights (random weights, different in every
    process) gets a digest of its own each call.

    Raises:
        CheckpointError: as `load_adapter`.
    """
    directory = _checkpoint_directory(path)
    family, _, is_full_model = _read_config(directory)
    weight_files = _weight_files(directory)
    if not weight_files:
        return f"random-{uuid.uuid4().hex}"
    hasher = xxhash.xxh3_128()
    state = _read_vision_weights(weight_files, family.checkpoint, is_full_model)
    for name in sorted(state):
        tensor = state[name].contiguous()
        hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\0".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()


def _checkpoint_directory(path: str | Path | None) -> Path:
    """`path` (None: the shipped tiny model), refused unless it holds a config.json."""
    directory = Path(path) if path is not None else SHIPPED_CHECKPOINT
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json; pass a local Hugging Face directory")
    return directory


def _vision_part(config: Any) -> Any:
    """A full model's vision sub-config (a dict's or a config object's): `vision_config`, or the
    thinker's (Qwen3-Omni nests its vision, audio and LLM parts under `thinker_config`); None
    for a tower-only config."""

    def part(of: Any, name: str) -> Any:
        return of.get(name) if isinstance(of, dict) else getattr(of, name, None)

    return part(config, "vision_config") or part(part(config, "thinker_config"), "vision_config")


def _read_config(directory: Path) -> tuple[Family, Any, bool]:
    """The family, the config its tower is built from, and whether the directory holds a full
    multimodal model.

    A tower-only save names its family at the top of config.json; a full model's vision
    sub-config is read through transformers, which knows how each model nests it, unless the
    family of its `vision_config.model_type` reads the whole file itself (`read_full_config`).
    """
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{directory}/config.json cannot be read: {error}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    family = find_family(model_type) if isinstance(model_type, str) else None
    if family is not None:
        return family, family.read_config(directory), False
    vision = _vision_part(raw) if isinstance(raw, dict) else None
    vision_type = vision.get("model_type") if isinstance(vision, dict) else None
    family = tower_family(model_type, vision_type) if isinstance(vision_type, str) else None
    if family is not None and family.checkpoint.read_full_config is not None:
        try:
            return family, family.checkpoint.read_full_config(raw), True
        except ValueError as error:
            raise CheckpointError(f"{directory}: {error}") from None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(directory)
    except (KeyError, ValueError) as error:
        raise CheckpointError(
            f"{directory}: model type {model_type!r} is not supported ({error}); "
            f"supported vision model types: {supported_model_types()}"
        ) from None
    vision_config = _vision_part(config)
    is_full_model = vision_config is not None
    vision_config = vision_config if is_full_model else config
    family = tower_family(config.model_type if is_full_model else None, vision_config.model_type)
    if family is None:
        raise CheckpointError(
            f"{directory}: vision model type {vision_config.model_type!r} is not supported; "
            f"supported: {supported_model_types()}"
        )
    return family, family.checkpoint.tower_config(config) if is_full_model else vision_config, is_full_model


def _image_processor_settings(directory: Path) -> dict[str, Any] | None:
    """The image processor's settings saved in `directory` and the file they were read from, as
    transformers finds them (`PROCESSOR_CONFIG`'s nested "image_processor", else
    `IMAGE_PROCESSOR_CONFIG`); None where neither file holds them."""
    for name in (PROCESSOR_CONFIG, IMAGE_PROCESSOR_CONFIG):
        file = directory / name
        if not file.is_file():
            continue
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{file} cannot be read: {error}") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{file} holds no settings (a JSON object); got a {type(raw).__name__}")
        settings = raw.get("image_processor") if name == PROCESSOR_CONFIG else raw
        if isinstance(settings, dict):
            return {"file": str(file), "settings": settings}
    return None


def _weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files and any(directory.glob("*.bin")):
        raise CheckpointError(
            f"{directory} holds only pickled *.bin weights, which vitpool does not read; "
            "convert them to safetensors"
        )
    return files


def _read_vision_weights(
    files: list[Path], layout: CheckpointLayout, is_full_model: bool
) -> dict[str, torch.Tensor]:
    """A full model's tensors under the layout's prefixes, or all of a tower-only save's; keyed
    as saved if the layout converts them, else with the prefix stripped."""
    index_file = files[0].parent / "model.safetensors.index.json"
    if is_full_model and index_file.is_file():
        # Open only the shards that hold vision weights: the language model is most of the bytes.
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        shard_names = {shard for key, shard in weight_map.items() if key.startswith(layout.prefixes)}
        files = [file for file in files if file.name in shard_names]
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as shard:
            for key in shard.keys():  # noqa: SIM118  (a safe_open handle is not iterable)
                if is_full_model and not key.startswith(layout.prefixes):
                    continue
                name = key if layout.convert is not None else _strip_prefix(key, layout.prefixes)
                state[name] = shard.get_tensor(key)
    if is_full_model and not state:
        raise CheckpointError(f"{files[0].parent}: no vision weights under {' or '.join(layout.prefixes)}")
    return state


def _strip_prefix(key: str, prefixes: tuple[str, ...]) -> str:
    """`key` less the first of `prefixes` it starts with (a tower-only save may have none)."""
    for prefix in prefixes:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _load_strictly(tower: torch.nn.Module, state: dict[str, torch.Tensor], directory: Path) -> None:
    expected = set(tower.state_dict())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing keys {missing[:_SHOWN_KEYS]} ({len(missing)} in all)")
        if unexpected:
            problems.append(f"unexpected keys {unexpected[:_SHOWN_KEYS]} ({len(unexpected)} in all)")
        raise CheckpointError(f"{directory}: weights do not match the tower: {'; '.join(problems)}")
    tower.load_state_dict(state, strict=True)
