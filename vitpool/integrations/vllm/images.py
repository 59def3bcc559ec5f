"""From an image as a client sends it to vitpool's item and key, the same for the gateway and the
Dynamo backend: the bytes of a data: URL (or a download), the picture as vLLM decodes it, the grid
families' processor output as an item, and the content key that vLLM is told as the image's uuid."""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from vitpool.errors import ConfigError
from vitpool.integrations.vllm.layouts import full_model_type
from vitpool.items import Image, Item
from vitpool.models.registry import RECORDS
from vitpool.pool.cache_keys import model_identity

logger = logging.getLogger(__name__)

# families whose image processor gives `pixel_values` and `image_grid_thw` (README: "Models")
GRID_FAMILIES = frozenset(
    model_type for record in RECORDS if record.grid_processor for model_type in record.model_types
)


# What the vLLM gateway and the Dynamo backend take besides a pool's own settings, each defined
# once here: name -> (default, what it is). The gateway's flag is the name's, as a pool setting's
# (`vitpool.pool.settings.setting_flag`: --pool, --dtype, --timeout); the Dynamo backend, which
# Dynamo creates with no arguments, reads ENVIRONMENT_PREFIX and the name in capitals
# (VITPOOL_POOL, VITPOOL_DTYPE, VITPOOL_TIMEOUT_S). Both join the cluster in RAY_ADDRESS (the
# gateway's --address over it); the settings of a pool the gateway launches are `vitpool serve`'s
# flags.
FRONT_SETTINGS: dict[str, tuple[Any, str]] = {
    "pool": ("vitpool", "the pool's name"),
    "dtype": (
        "bfloat16",
        (
            "the LLM's dtype: give vLLM the same --dtype; the embeddings are laid out in it, and a "
            "pool the gateway launches runs its tower in it"
        ),
    ),
    "timeout_s": (60.0, "seconds a call's images may wait for the pool"),
}
ENVIRONMENT_PREFIX = "VITPOOL_"


def front_setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """FRONT_SETTINGS' `name` as the environment sets it (ENVIRONMENT_PREFIX and the name in
    capitals), else its default; a number where the default is one.

    Raises:
        ConfigError: a value that is not what the setting takes, naming the variable.
    """
    default, what = FRONT_SETTINGS[name]
    variable = ENVIRONMENT_PREFIX + name.upper()
    text = (os.environ if environ is None else environ).get(variable)
    if text is None:
        return default
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{variable}={text!r}: give a number ({what})") from None
    return text


def data_url_bytes(url: str) -> bytes | None:
    """The payload of a base64 data: URL; None for anything else or a malformed one."""
    header, _, payload = url.partition(",")
    if not (header.startswith("data:") and header.endswith(";base64")):
        return None
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:
        return None


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None


def model_prefix(checkpoint: str | Path, dtype: torch.dtype, processor_name: str = "") -> str:
    """The model's part of every key (`image_key`), 64 bits in hex: the model as the pool's cache
    names it (`vitpool.pool.cache_keys.model_identity`: its config's and weights' content, and
    the LLM's dtype), and what turns an image's bytes into its pixels, which the pool's keys hash
    but these do not: the image processor's settings and class (`processor_name`: the PIL and
    torchvision backends resize to slightly different pixels)."""
    directory = Path(checkpoint)
    hasher = xxhash.xxh3_64(model_identity(directory, str(dtype).removeprefix("torch.")))
    for name in (PROCESSOR_CONFIG, IMAGE_PROCESSOR_CONFIG):
        file = directory / name
        hasher.update(file.read_bytes() if file.exists() else b"-")
        hasher.update(b"\0")
    if processor_name:
        hasher.update(processor_name.encode())
    return hasher.hexdigest()


# where transformers reads an image processor's settings from (`vitpool.models.loading`'s names)
PROCESSOR_CONFIG, IMAGE_PROCESSOR_CONFIG = "processor_config.json", "preprocessor_config.json"


KEY_MARK = "vp-"  # how every gateway key begins; vLLM's own identifiers (its hashes, a uuid) do not


def image_key(prefix: str, data: bytes) -> str:
    """`vp-<model>-<128-bit XXH3 of the image's bytes>`."""
    return f"{KEY_MARK}{prefix}-{xxhash.xxh3_128_hexdigest(data)}"


def decode_image(data: bytes) -> Any:
    """The image as vLLM reads it: EXIF orientation applied, transparency over white, RGB."""
    from PIL import Image as PILImage
    from PIL import ImageOps

    image = PILImage.open(io.BytesIO(data))
    with contextlib.suppress(Exception):  # vLLM ignores broken EXIF too
        image = ImageOps.exif_transpose(image)
    image.load()
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        image = image.convert("RGBA")
        background = PILImage.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        return background
    return image.convert("RGB")


def checkpoint_family(checkpoint: str | Path) -> str:
    """The family of a checkpoint as vLLM serves it: its config's model_type ("<family>_vision" of
    a tower-only save taken as its family: `layouts.full_model_type`)."""
    return full_model_type(str(read_json(Path(checkpoint) / "config.json").get("model_type", "")))


# vLLM depends on torchvision, and its processor (transformers' AutoProcessor, no backend asked)
# takes the torchvision image processor where torchvision imports: vLLM's pixels are torchvision's.
VLLM_PROCESSOR_BACKEND = "torchvision"

# Where the gateway has only PIL's processor: after a resize, PIL rounds the picture to 8 bits and
# torchvision does not, so a pixel differs by up to one 8-bit step (2/255 at Qwen's mean and std
# 0.5), more for a picture enlarged to the minimum size; pictures taken as they are (sides a
# multiple of the merged patch, in the pixel range) differ by ~6e-8. Figures: README, "The same
# pixels".
PIL_PROCESSOR_BOUND = (
    "a resized image's pixels differ from vLLM's by up to one 8-bit step, and answers from "
    "vLLM's own tower's by up to ~5e-3 in logprobs (4.9e-3 measured; a greedy token can change) "
    "(images not resized: ~2e-5)"
)


@functools.lru_cache(maxsize=1)  # one answer (and one warning) per process
def processor_backend() -> str:
    """The backend of transformers' image processors that gives vLLM's pixels: "torchvision"
    where it imports here, else (not installed) "pil", with a warning naming why, the bound that
    follows and the fix.

    Raises:
        ConfigError: torchvision is installed but does not load (a build for another torch:
            "operator torchvision::nms does not exist"); transformers' models do not import beside
            it either, so nothing here could run.
    """
    try:
        import torchvision  # noqa: F401
    except ImportError as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        logger.warning(
            "vitpool: images are processed with transformers' PIL image processor, not the torchvision one "
            "vLLM runs (torchvision does not import here: %s): %s. Install the torchvision built for this "
            'torch (README: "vitpool as vLLM\'s encoder")',
            reason,
            PIL_PROCESSOR_BOUND,
        )
        return "pil"
    except Exception as error:  # noqa: BLE001 - a build for another torch fails in its op registrations
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(
            f"torchvision {_installed_version('torchvision')} is installed but does not load beside torch "
            f"{torch.__version__} ({reason}), and transformers' models do not import beside it either: "
            "install the torchvision built for this torch, from the index this torch came from (README: "
            '"Extras"), or uninstall torchvision to run the PIL image processor (answers within ~5e-3 of '
            "vLLM's)"
        ) from None
    return VLLM_PROCESSOR_BACKEND


def _installed_version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(version unknown)"


def image_processor(checkpoint: str | Path) -> Any:
    """The checkpoint's image processor as vLLM makes it: the torchvision backend where it
    imports, else PIL's (`processor_backend` warns once)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(checkpoint, backend=processor_backend())
    logger.info("vitpool: image processor %s for %s", type(processor).__name__, checkpoint)
    return processor


def processor_items(checkpoint: str | Path, family: str) -> Callable[[Any], Item]:
    """Items from the checkpoint's own image processor (`image_processor`), for a grid family.

    Raises:
        ConfigError: the family's items are not made from a grid (give your own function).
    """
    if family not in GRID_FAMILIES:
        raise ConfigError(
            f"vitpool makes items from a processor for {', '.join(sorted(GRID_FAMILIES))}; for "
            f"{family!r} give your own function from a PIL image to its vitpool item"
        )
    return grid_item(image_processor(checkpoint))


def grid_item(processor: Any) -> Callable[[Any], Item]:
    """Image items from a grid family's processor (`pixel_values`, `image_grid_thw`)."""

    def item(image: Any) -> Item:
        out = processor(images=image, return_tensors="pt")
        if "image_grid_thw" not in out:
            raise ConfigError(
                f"{type(processor).__name__} gives no image_grid_thw; the gateway reads grid families"
            )
        return Image(out["pixel_values"], out["image_grid_thw"][0])

    return item
