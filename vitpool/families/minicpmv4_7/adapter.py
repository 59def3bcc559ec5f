"""MiniCPM-V 4.7 (`MiniCPMV4_7VisionModel` + `MiniCPMV4_7Merger`), run by MiniCPM-V 4.6's adapter.

What 4.7 changes against 4.6 (transformers 5.24, `modular_minicpmv4_7.py` inherits 4.6's config,
model and processor): its config adds five token ids (`image_start_id` ... `newline_id`) and drops
`drop_vision_last_layer` (which 4.6's modeling never read); its model adds canvas M-RoPE (3-D
positions of the LLM's tokens, `get_rope_index`) and reads `mm_token_type_ids`; its processor returns
`mm_token_type_ids` by default and refuses images without a placeholder. The vision path is
untouched: the generated `MiniCPMV4_7VisionModel`, `MiniCPMV4_7ViTWindowAttentionMerger` and
`MiniCPMV4_7Merger` are 4.6's classes renamed, with the same parameters, `get_image_features` is
4.6's, the image processor is 4.6's and a full checkpoint keeps the tower and Merger under the same
keys (`model.vision_tower.*`, `model.merger.*`). So the static forward, the item rules and the
checkpoint conversion are 4.6's (`vitpool.families.minicpmv4_6.adapter`); this module builds the
4.7 classes, reads 4.7's configs and names 4.7 in its errors.
"""

from __future__ import annotations

import copy
import importlib.util
from types import SimpleNamespace
from typing import Any

import torch

from vitpool.errors import ConfigError
from vitpool.families.minicpmv4_6 import adapter as adapter_4_6
from vitpool.families.minicpmv4_6.adapter import (
    CHECKPOINT_PREFIXES,  # noqa: F401 - the registry's prefixes, checked against these
    TEXT_HIDDEN_SIZE,
    MiniCPMV4_6Adapter,
    MiniCPMV4_6Encoder,
    convert_checkpoint,  # noqa: F401 - the layout's conversion: 4.7 keeps 4.6's keys
)
from vitpool.families.minicpmv4_7.rules import MiniCPMV4_7Rules
from vitpool.models.compat import installed_transformers
from vitpool.models.projected import tower_and_projector

FAMILY = "MiniCPM-V 4.7"
VISION_MODEL_TYPE = "minicpmv4_7_vision"
TRANSFORMERS_MODULE = "transformers.models.minicpmv4_7"
# Its first release with MiniCPM-V 4.7 (5.23 did not have it); that code already takes slices of
# unlike sizes, what 4.6's adapter requires (5.19 on).
FIRST_TRANSFORMERS = "5.24.0"
# What the Merger reads besides the LLM's width, with MiniCPMV4_7Config's defaults.
MERGER_DEFAULTS = {"downsample_mode": "16x", "merge_kernel_size": (2, 2), "merger_times": 1}


def missing_transformers_model() -> str | None:
    """Why this transformers cannot build MiniCPM-V 4.7 (None: it can): it has no
    `transformers.models.minicpmv4_7`."""
    if importlib.util.find_spec(TRANSFORMERS_MODULE) is not None:
        return None
    return (
        f"{FAMILY} needs a transformers with its model ({TRANSFORMERS_MODULE}, from {FIRST_TRANSFORMERS} "
        f"on); transformers {installed_transformers()} is installed: "
        f"pip install 'transformers>={FIRST_TRANSFORMERS}'"
    )


def as_4_7(error: ConfigError) -> ConfigError:
    """4.6's code names its family in its errors; the model here is 4.7."""
    return ConfigError(str(error).replace(adapter_4_6.FAMILY, FAMILY))


def merger_settings(config: Any) -> tuple[Any, dict[str, Any]]:
    """The vision config and what the Merger reads (`text_hidden_size` and `MERGER_DEFAULTS`'
    names), from a full `MiniCPMV4_7Config` or a vision config written by `tower_only_config`.

    Raises:
        ValueError: neither (the Merger's output width is the LLM's, which a plain vision config lacks).
    """
    vision_config = getattr(config, "vision_config", None)
    text_config = getattr(config, "text_config", None)
    if vision_config is not None and text_config is not None:
        settings = {name: getattr(config, name) for name in MERGER_DEFAULTS}
        return vision_config, {TEXT_HIDDEN_SIZE: int(text_config.hidden_size), **settings}
    is_tower_only = getattr(config, "model_type", None) == VISION_MODEL_TYPE
    if is_tower_only and getattr(config, TEXT_HIDDEN_SIZE, None):
        settings = {name: getattr(config, name, default) for name, default in MERGER_DEFAULTS.items()}
        return config, {TEXT_HIDDEN_SIZE: int(getattr(config, TEXT_HIDDEN_SIZE)), **settings}
    raise ValueError(
        f"{FAMILY}'s Merger needs the LLM's hidden size: give the full model's config (MiniCPMV4_7Config) "
        f"or a vision config ({VISION_MODEL_TYPE}) with {TEXT_HIDDEN_SIZE!r}, as tower_only_config "
        f"writes it; "
        f"got a {type(config).__name__} (model_type {getattr(config, 'model_type', None)!r})"
    )


def check_supported(vision_config: Any, settings: dict[str, Any]) -> None:
    """ConfigError for what the static forward does not run (4.6's limits: the "16x" mode, 2 x 2
    merge and window kernels, one merge round, a window merger inside the tower)."""
    try:
        adapter_4_6.check_supported(vision_config, settings)
    except ConfigError as error:
        raise as_4_7(error) from None


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> MiniCPMV4_6Encoder:
    """Fresh MiniCPMV4_7VisionModel and MiniCPMV4_7Merger, held as 4.6's encoder module (state keys
    `vision_tower.*`, `merger.*`), from a full MiniCPMV4_7Config or a vision config written by
    `tower_only_config`.

    Raises:
        ValueError: the config lacks the LLM's width; ConfigError: an unsupported setting, or a
            transformers without MiniCPM-V 4.7.
    """
    missing = missing_transformers_model()
    if missing:
        raise ConfigError(missing)
    from transformers.models.minicpmv4_7.modeling_minicpmv4_7 import MiniCPMV4_7Merger, MiniCPMV4_7VisionModel

    vision_config, settings = merger_settings(config)
    check_supported(vision_config, settings)
    # MiniCPMV4_7Merger reads merge_kernel_size, merger_times, vision_config.hidden_size and
    # text_config.hidden_size
    full = SimpleNamespace(
        vision_config=vision_config,
        text_config=SimpleNamespace(hidden_size=settings[TEXT_HIDDEN_SIZE]),
        merge_kernel_size=tuple(settings["merge_kernel_size"]),
        merger_times=settings["merger_times"],
    )
    vision_tower, merger = tower_and_projector(MiniCPMV4_7VisionModel, MiniCPMV4_7Merger, full, dtype)
    return MiniCPMV4_6Encoder(vision_tower, merger)


def tower_only_config(full_config: Any) -> Any:
    """The vision config of a full MiniCPMV4_7Config with what the Merger needs added
    (`text_hidden_size`, `downsample_mode`, `merge_kernel_size`, `merger_times`): what a tower-only
    save of the encoder module writes as its config.json."""
    vision_config, settings = merger_settings(full_config)
    config = copy.deepcopy(vision_config)
    for name, value in settings.items():
        setattr(config, name, list(value) if isinstance(value, tuple) else value)
    return config


class MiniCPMV4_7Adapter(MiniCPMV4_6Adapter):
    """4.6's adapter over MiniCPMV4_7VisionModel + MiniCPMV4_7Merger (the same modules renamed),
    with 4.7's item rules and errors."""

    def __init__(self, tower: MiniCPMV4_6Encoder) -> None:
        try:
            super().__init__(tower)
        except ConfigError as error:
            raise as_4_7(error) from None
        rules = self.item_rules
        self.item_rules = MiniCPMV4_7Rules(rules.channels, rules.patch_size, rules.output_width)
