"""What the families' cases share: random weights for their tiny towers, items from specs, and
Hugging Face's own tower as the reference."""

from __future__ import annotations

import copy
import importlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vitpool import GraphEncoder, Image, Video
from vitpool.specs import VIDEO, ItemSpec


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of unit scale (HF's init is tiny): every row, position and norm matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            values = torch.randn(parameter.shape, generator=generator)
            if parameter.ndim >= 2 and "position_embedding" not in name:
                values = values / math.sqrt(parameter[0].numel())
            elif parameter.ndim == 1:
                values = (1 + 0.1 * values) if "norm" in name else 0.1 * values
            parameter.copy_(values)
    return module


def item_for(spec: ItemSpec, pixels: torch.Tensor) -> Any:
    """The item a caller builds for this spec: an Image or a Video of these pixels and its grid."""
    return (Video if spec.modality == VIDEO else Image)(pixels, spec.layout)


def tower_reference(encoder: GraphEncoder) -> Callable[[Any], list[torch.Tensor]]:
    """Hugging Face's forward of the encoder's tower, SDPA, on one item alone."""
    tower = copy.deepcopy(encoder.adapter.tower)
    tower.config._attn_implementation = "sdpa"

    def outputs(item: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            pixels = torch.as_tensor(item.pixel_values).to(torch.float32)
            output = tower(pixels, grid_thw=torch.tensor([item.grid_thw]))
        return [output.pooler_output]

    return outputs


def save_tower_only(tower: torch.nn.Module, directory: Path) -> Path:
    """A tower-only checkpoint of a Hugging Face tower: its config.json and safetensors."""
    tower.save_pretrained(directory)
    return directory


def save_tower_and_projector(family: str, full_config: Any, module: torch.nn.Module, directory: Path) -> Path:
    """A tower-only checkpoint of a family whose vitpool module holds the tower and a projector:
    the config its adapter module's `tower_only_config` makes of the full one, and the module's state."""
    from safetensors.torch import save_file

    adapter_module = importlib.import_module(f"vitpool.families.{family}.adapter")
    adapter_module.tower_only_config(full_config).save_pretrained(directory)
    state = {key: value.contiguous() for key, value in module.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"))
    return directory


def tiled_case_fields(
    hf_model: Callable[[], torch.nn.Module],
    encoder_of: Callable[[torch.nn.Module, list[int]], GraphEncoder],
    image_features: Callable[[torch.nn.Module, Any], torch.Tensor],
    row_shape: tuple[int, ...],
    budgets: tuple[int, ...],
) -> dict[str, Any]:
    """A tiled family's conformance case: one full HF model (built on first use, shared by the
    encoder and the reference), `image_features` of one item's tiles alone as the reference,
    items `Image(tiles)`, and the bad items every tiled family refuses."""
    shared: dict[str, torch.nn.Module] = {}

    def model() -> torch.nn.Module:
        if "model" not in shared:
            shared["model"] = hf_model()
        return shared["model"]

    channels, side, _ = row_shape
    bad_items = (
        (Image(torch.randn(2, *row_shape), (1, 2, 2)), "no grid"),
        (Image(torch.randn(2, channels, side, side + 2)), "must be tiles"),
        (Image(torch.randn(4, channels * side * side)), "must be tiles"),
        (Image(torch.randn(0, *row_shape)), "no tiles"),
    )
    return {
        "make_encoder": lambda budget_list: encoder_of(model(), budget_list),
        "reference": lambda encoder: lambda item: [image_features(model(), item)],
        "item_for": lambda spec, pixels: Image(pixels),
        "bad_items": bad_items,
        "budgets": budgets,
    }


def view_and_crops_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What a global-view-and-crops model (Step-3.7, DeepSeek-OCR-2) hands its LLM for one image:
    `get_image_features` of its view and crops, one image's entry."""
    crops = (item.inputs or {}).get("pixel_values_local")
    with torch.no_grad():
        output = model.model.get_image_features(
            pixel_values=torch.as_tensor(item.pixel_values),
            pixel_values_local=None if crops is None else torch.as_tensor(crops),
            num_local_patches=None if crops is None else [crops.shape[0]],
        )
    return output.pooler_output[0]


def view_and_crops_case_fields(
    hf_model: Callable[[], torch.nn.Module],
    encoder_of: Callable[[torch.nn.Module, list[int]], GraphEncoder],
    tower_of: Callable[[torch.nn.Module], torch.nn.Module],
    global_row_shape: tuple[int, ...],
    local_row_shape: tuple[int, ...],
    budgets: tuple[int, ...],
) -> dict[str, Any]:
    """A global-view-and-crops family's conformance case, part by part: an item built for a crops
    spec carries a fixed global view beside its crops, and the reference gives that item's crops'
    outputs alone (the model's tower, `tower_of(model)`, and projector on them, as
    `get_image_features` runs them); for a global spec the item is the view alone and the
    reference `get_image_features`. Whole items are checked in the families' own tests."""
    shared: dict[str, torch.nn.Module] = {}
    fixed_view = torch.randn(1, *global_row_shape, generator=torch.Generator().manual_seed(99))

    def model() -> torch.nn.Module:
        if "model" not in shared:
            shared["model"] = hf_model()
        return shared["model"]

    def part_item(spec: ItemSpec, pixels: torch.Tensor) -> Image:
        if spec.path == "pixel_values_local":
            return Image(fixed_view, inputs={"pixel_values_local": pixels})
        return Image(pixels)

    def part_reference(item: Image) -> list[torch.Tensor]:
        if not item.inputs:
            return [view_and_crops_features(model(), item)]
        with torch.no_grad():
            hidden = tower_of(model())(item.inputs["pixel_values_local"]).last_hidden_state
            features = model().model.multi_modal_projector(hidden)
        return [features.reshape(-1, features.shape[-1])]

    channels, side, _ = local_row_shape
    bad_items = (
        # a grid is for patch families
        (Image(torch.randn(1, *global_row_shape), (1, 2, 2)), "no grid"),
        # crops of another size
        (
            Image(
                torch.randn(1, *global_row_shape),
                inputs={"pixel_values_local": torch.randn(2, channels, side, side + 2)},
            ),
            "pixel_values_local: pixel_values must be tiles",
        ),
        # two global views in one item: one image an item
        (Image(torch.randn(2, *global_row_shape)), "an item has at most 1"),
        # an input the model does not take
        (
            Image(torch.randn(1, *global_row_shape), inputs={"crops": torch.randn(2, *local_row_shape)}),
            "unknown inputs ['crops']",
        ),
        # crops without their global view
        (
            Image(None, inputs={"pixel_values_local": torch.randn(2, *local_row_shape)}),
            "has no ['pixel_values']",
        ),
        # integer crops
        (
            Image(
                torch.randn(1, *global_row_shape),
                inputs={"pixel_values_local": torch.ones(2, *local_row_shape, dtype=torch.int64)},
            ),
            "pixel_values_local have dtype torch.int64",
        ),
    )
    return {
        "make_encoder": lambda budget_list: encoder_of(model(), budget_list),
        "reference": lambda encoder: part_reference,
        "item_for": part_item,
        "bad_items": bad_items,
        "budgets": budgets,
    }
