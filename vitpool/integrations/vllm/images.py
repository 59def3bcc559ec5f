"""From an image as a client sends it to vitpool's item and key, the same for the gateway and the
Dynamo backend: the bytes of a data: URL (or a download), the picture as vLLM decodes it, the grid
families' processor output as an item, and the content key that vLLM is told as the image's uuid."""

from __future__ import annotations

import base64
import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from vitpool.errors import ConfigError
from vitpool.items import Image, Item

# families whose image processor gives `pixel_values` and `image_grid_thw` (README: "Models")
GRID_FAMILIES = frozenset({"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen2_vl", "qwen2_5_vl",
                           "glm4v", "glm4v_moe", "paddleocr_vl"})


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


def model_identity(checkpoint: str | Path, dtype: torch.dtype, weights_digest: str) -> str:
    """The prefix of every key for this model: a digest of its config, its vision weights'
    (`vision_weights_digest`: two fine-tunes may share a config), its image processor's settings
    and the LLM's dtype (what decides an image's embedding, besides its bytes)."""
    directory = Path(checkpoint)
    hasher = xxhash.xxh3_64()
    for name in ("config.json", "preprocessor_config.json"):
        file = directory / name
        hasher.update(file.read_bytes() if file.exists() else b"-")
        hasher.update(b"\0")
    hasher.update(weights_digest.encode())
    hasher.update(str(dtype).encode())
    return hasher.hexdigest()


def image_key(prefix: str, data: bytes) -> str:
    """`vp-<model>-<128-bit XXH3 of the image's bytes>`."""
    return f"vp-{prefix}-{xxhash.xxh3_128_hexdigest(data)}"


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
    a tower-only save taken as its family)."""
    return str(read_json(Path(checkpoint) / "config.json").get("model_type", "")).removesuffix("_vision")


def processor_items(checkpoint: str | Path, family: str) -> Callable[[Any], Item]:
    """Items from the checkpoint's own image processor, for a grid family.

    Raises:
        ConfigError: the family's items are not made from a grid (give your own function).
    """
    if family not in GRID_FAMILIES:
        raise ConfigError(f"vitpool makes items from a processor for {', '.join(sorted(GRID_FAMILIES))}; for "
                          f"{family!r} give your own function from a PIL image to its vitpool item")
    from transformers import AutoImageProcessor

    return grid_item(AutoImageProcessor.from_pretrained(checkpoint))


def grid_item(processor: Any) -> Callable[[Any], Item]:
    """Image items from a grid family's processor (`pixel_values`, `image_grid_thw`)."""

    def item(image: Any) -> Item:
        out = processor(images=image, return_tensors="pt")
        if "image_grid_thw" not in out:
            raise ConfigError(f"{type(processor).__name__} gives no image_grid_thw; the gateway reads grid families")
        return Image(out["pixel_values"], out["image_grid_thw"][0])

    return item


