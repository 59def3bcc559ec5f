"""What a `GraphEncoder`'s options come to on its device and model, decided once when it is
built: the options merged from keywords, the attention and precision checked against the device,
each path's budgets, the tower placed; and the consistency check of a planned item's spec."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vitpool.encoder_spec import EncoderOptions
from vitpool.errors import ConfigError
from vitpool.graphs.defaults import default_token_budgets, resolve_device
from vitpool.kernels.attention import fa4_available
from vitpool.kernels.cudnn_packed import cudnn_packed_available
from vitpool.kernels.fp8 import fp8_supported
from vitpool.models import VisionAdapter
from vitpool.models.protocol import KEEPS_DTYPE
from vitpool.packing import Budget
from vitpool.rules.paths import rules_of_part
from vitpool.specs import ItemRules, ItemSpec

# attention choice -> whether it runs on a device, and what it needs where it does not
_DEVICE_ATTENTION = {
    "cudnn": (
        cudnn_packed_available,
        (
            "the nvidia-cudnn-frontend package (installed with vitpool on Linux) and a GPU of compute "
            "capability 9.0 or newer"
        ),
    ),
    "fa4": (fa4_available, "the flash-attn-4 package and a GPU of compute capability 9.0 or newer"),
}


def check_attention(attention: str, device: torch.device, dtype: torch.dtype) -> str:
    """What `EncoderOptions` cannot check without the device: whether FA4 or packed cuDNN runs here."""
    if attention in _DEVICE_ATTENTION and device.type == "cuda":
        available, needs = _DEVICE_ATTENTION[attention]
        if dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"attention {attention!r} runs in bfloat16 or float16, not {dtype}")
        if not available(device):
            raise ConfigError(
                f"attention {attention!r} needs {needs}; use 'auto' to take it where it can run"
            )
    return attention


def check_precision(precision: str, device: torch.device, dtype: torch.dtype) -> str:
    """What `EncoderOptions` cannot check without the device: whether it runs FP8 GEMMs."""
    if precision == "fp8":
        if not fp8_supported(device):
            raise ConfigError(
                "precision 'fp8' needs a GPU of compute capability 8.9 or newer (FP8 tensor cores); the "
                f"device is {device}; use 'bf16'"
            )
        if dtype != torch.bfloat16:
            raise ConfigError(f"precision 'fp8' computes in bfloat16, not {dtype}")
    return precision


def options_with(options: EncoderOptions | None, values: Mapping[str, Any]) -> EncoderOptions:
    """`options` (None: the defaults) with `values` over them, a torch device or dtype among them
    given by name (the options hold plain values).

    Raises:
        ConfigError: an invalid option; TypeError: a name that is no option.
    """
    if options is not None and not isinstance(options, EncoderOptions):
        raise TypeError(
            f"options must be a vitpool.encoder_spec.EncoderOptions, not {type(options).__name__}; give "
            "budgets and the other options by name (budgets=[64, 256])"
        )
    plain = dict(values)
    device, dtype = plain.get("device"), plain.get("dtype")
    if device is not None and not isinstance(device, str):
        plain["device"] = str(resolve_device(device))  # a torch.device, or an index
    if isinstance(dtype, torch.dtype):
        plain["dtype"] = str(dtype).removeprefix("torch.")
    if options is None:
        return EncoderOptions(**plain)
    return dataclasses.replace(options, **plain) if plain else options


def spec_is_consistent(rules: ItemRules, spec: ItemSpec) -> bool:
    """Whether `spec` is what the model's rules (its input's, for an item of several inputs) make
    of its own layout."""
    try:
        if rules.parts:  # an item of several inputs: its own input's rules
            own = rules_of_part(rules, spec.path)
            derived = own.item_spec(spec.modality, spec.pixel_shape, spec.pixel_dtype, spec.layout)
            return dataclasses.replace(derived, path=spec.path) == spec
        return rules.item_spec(spec.modality, spec.pixel_shape, spec.pixel_dtype, spec.layout) == spec
    except (ValueError, TypeError):
        return False


def path_budgets(
    rules: ItemRules,
    path: str,
    adapter: VisionAdapter,
    budgets: Sequence[int] | None,
    device: torch.device,
    max_items_per_batch: int | None,
    limits: Mapping[str, int],
) -> list[Budget]:
    """A path's budgets: the user's token budgets, else its own adapter's defaults. Rules that
    route items to paths themselves (`ItemSpec.path` by the item's kind) mark their budgets."""
    token_budgets = default_token_budgets(device, adapter) if budgets is None else budgets
    if rules.parts:  # `PathRules`: each input's budgets
        return rules.path_budgets(path, token_budgets, max_items_per_batch, limits)
    return [
        budget for budget in rules.budgets(token_budgets, max_items_per_batch, limits) if budget.path == path
    ]


def place_tower(tower: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Move the tower to `device` and its parameters to `dtype`.

    Buffers keep their dtype: rotary inverse frequencies stay float32, as when Hugging Face
    loads a model in half precision; so do parameters the adapter marked with `KEEPS_DTYPE`.
    """
    tower.to(device)
    for parameter in tower.parameters():
        if parameter.dtype != dtype and not getattr(parameter, KEEPS_DTYPE, False):
            parameter.data = parameter.data.to(dtype)
    tower.eval().requires_grad_(False)
