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

import importlib.util
from typing import Any

import torch

from vitpool.errors import ConfigError
from vitpool.families.minicpmv4_6 import adapter as adapter_4_6
from vitpool.families.minicpmv4_6.adapter import (
    CHECKPOINT_PREFIXES,  # noqa: F401 - the registry's prefixes, checked against these
    MiniCPMV4_6Adapter,
    MiniCPMV4_6Encoder,
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

    full = MiniCPMV4_7Adapter.projector_config(config)
    check_supported(full.vision_config, vars(full))
    vision_tower, merger = tower_and_projector(MiniCPMV4_7VisionModel, MiniCPMV4_7Merger, full, dtype)
    return MiniCPMV4_6Encoder(vision_tower, merger)


class MiniCPMV4_7Adapter(MiniCPMV4_6Adapter):
    """4.6's adapter over MiniCPMV4_7VisionModel + MiniCPMV4_7Merger (the same modules renamed),
    with 4.7's item rules and errors; 4.6's configs' reading (`merger_settings`,
    `tower_only_config`) and checkpoint conversion (4.7 keeps 4.6's keys)."""

    FAMILY = FAMILY
    FULL_CONFIG_CLASS = "MiniCPMV4_7Config"
    VISION_MODEL_TYPE = VISION_MODEL_TYPE

    def __init__(self, tower: MiniCPMV4_6Encoder) -> None:
        try:
            super().__init__(tower)
        except ConfigError as error:
            raise as_4_7(error) from None
        rules = self.item_rules
        self.item_rules = MiniCPMV4_7Rules(rules.channels, rules.patch_size, rules.output_width)


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = MiniCPMV4_7Adapter.tower_only_config
convert_checkpoint = MiniCPMV4_7Adapter.convert_checkpoint
