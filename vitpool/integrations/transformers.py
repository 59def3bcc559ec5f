"""A drop-in vision tower for Hugging Face vision-language models of every family vitpool serves
(Qwen3-VL, Qwen3.5, Qwen2.5-VL, Qwen2-VL, GLM-4.1V / 4.5V / 4.6V, Kimi-K2.5, PaddleOCR-VL, InternVL,
Llama 4, Step-3.7, DeepSeek-OCR-2, MiniCPM-V 4.6): `model.generate(...)` encodes images (and
videos, where the family has them) through an `EncoderPool` (or an in-process `GraphEncoder`),
deepstack features included where the family has them.

    from vitpool.integrations.transformers import replace_vision_tower
    original = replace_vision_tower(model, pool)       # model.model.visual now asks the pool
    model.generate(**inputs)                           # same tokens as with the original tower

The model calls its tower with the processor's pixel rows of all images (or all videos) of a
request and their grids; the stand-in splits them into items, encodes them, and answers in the
tower's own output type (`pooler_output`, and `deepstack_features` for a family that has them),
on the model's device and in its dtype. GLM passes a video as one (1, h, w) grid row per frame;
its tower encodes each frame alone, so those rows are encoded as images, with the same result.

Where the model's projector lives outside its tower class (Kimi-K2.5's `mm_projector`,
PaddleOCR-VL's `projector`), vitpool's embeddings are already projected: the stand-in answers in
the field the model reads after its tower, and the projector is replaced by a pass-through.

The families added later (InternVL, Llama 4, Step-3.7, DeepSeek-OCR-2, MiniCPM-V 4.6) are answered
one step up, at the model's `get_image_features` (each family's `features.py`, on `vitpool.models.stand_in`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from vitpool.graphs import GraphEncoder
from vitpool.items import Image, Item, Video
from vitpool.models.family import Family, FamilyRecord, ModelParts, named_object
from vitpool.models.registry import RECORDS, family_record, supported_model_types, tower_family
from vitpool.models.stand_in import Encoder, PooledImageFeatures, StandIn


class PassThroughProjector(torch.nn.Module):
    """Stands in for a projector whose work vitpool already did: returns the features unchanged.
    Keeps the replaced projector's plain settings, which the model may read around the call
    (ERNIE-4.5-VL's `get_video_features` reads its resampler's `temporal_merge_size`)."""

    def __init__(self, replaced: torch.nn.Module | None = None) -> None:
        super().__init__()
        for name, value in vars(replaced).items() if replaced is not None else ():
            if (
                not name.startswith("_")
                and name != "training"
                and isinstance(value, (bool, int, float, str, tuple))
            ):
                setattr(self, name, value)

    def forward(self, features: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return features


class PooledVisionTower(StandIn):
    """Stands in for `model.model.visual` of a vision-language model of a vitpool family.

    Args:
        encoder: an `EncoderPool` or a `GraphEncoder` (anything with `encode(items)`), loaded with
            the same vision weights as the model.
        spatial_merge_size: the tower's merge size (2 in every family so far); the model's
            `get_image_features` / `get_video_features` read it from the tower (Kimi-K2.5 as
            `merge_kernel_size`).
        dtype, device: where the model expects the embeddings.
        parts: how the model calls its tower (`ModelParts`).
    """

    def __init__(
        self,
        encoder: Encoder,
        spatial_merge_size: int,
        dtype: torch.dtype,
        device: torch.device,
        parts: ModelParts | None = None,
    ) -> None:
        super().__init__(encoder, dtype, device)
        self.spatial_merge_size = spatial_merge_size
        self.merge_kernel_size = (spatial_merge_size, spatial_merge_size)
        self.parts = parts or ModelParts()

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any
    ) -> BaseModelOutputWithPooling:
        if self.parts.batch_dim:
            pixel_values = pixel_values.squeeze(0)
        grids = [tuple(int(n) for n in grid) for grid in grid_thw.tolist()]
        rows = [t * h * w for t, h, w in grids]
        if sum(rows) != pixel_values.shape[0]:
            raise ValueError(
                f"pixel_values have {pixel_values.shape[0]} rows; grid_thw {grids} needs {sum(rows)}"
            )
        # A grid with one temporal patch is an image to the tower, whether it came as one or not.
        items: list[Item] = [
            (Image if grid[0] == 1 else Video)(chunk.detach().cpu(), grid)
            for chunk, grid in zip(torch.split(pixel_values, rows), grids)
        ]
        results = self.encoder.encode(items)
        tokens = self._gather([r.tokens for r in results])
        num_deepstack = len(results[0].deepstack) if results else 0
        if not num_deepstack:  # every family but Qwen3-VL: the merged tokens alone
            return BaseModelOutputWithPooling(**{self.parts.output: tokens})
        deepstack = [self._gather([r.deepstack[k] for r in results]) for k in range(num_deepstack)]
        return BaseModelOutputWithDeepstackFeatures(pooler_output=tokens, deepstack_features=deepstack)

    def _gather(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.to(self._device, self._dtype, non_blocking=True) for t in tensors])


def _feature_stand_in(record: FamilyRecord | None) -> type[PooledImageFeatures] | None:
    """The family's `get_image_features` stand-in (`FamilyRecord.image_features`), or None for a
    family whose drop-in stands in for its tower."""
    if record is None or record.image_features is None:
        return None
    return named_object(record.image_features)


def _model_parts(record: FamilyRecord | None) -> ModelParts:
    """How the family's Hugging Face model calls its tower (`FamilyRecord.transformers_parts`);
    the Qwen and GLM layout for a family registered without a record."""
    return (record.transformers_parts if record is not None else None) or ModelParts()


_TOWER_ATTRIBUTES = sorted(
    {ModelParts().tower}
    | {record.transformers_parts.tower for record in RECORDS if record.transformers_parts is not None}
    | {named_object(record.image_features).tower for record in RECORDS if record.image_features is not None}
)
_STAND_INS = (PooledVisionTower, PooledImageFeatures)


def replace_vision_tower(model: torch.nn.Module, encoder: Encoder) -> torch.nn.Module:
    """Make `model` (a Hugging Face vision-language model of a vitpool family: Qwen3-VL, Qwen3.5,
    Qwen2.5-VL, Qwen2-VL, GLM-4.1V / 4.5V / 4.6V, Kimi-K2.5, PaddleOCR-VL, InternVL, Llama 4,
    Step-3.7, DeepSeek-OCR-2, MiniCPM-V 4.6) encode through `encoder`.

    Args:
        model: the full model (`...ForConditionalGeneration`), its vision weights the encoder's.
        encoder: an `EncoderPool` or a `GraphEncoder` (anything with `encode(items)`).

    Returns:
        What to hand `restore_vision_tower`: the original tower (for Kimi-K2.5, PaddleOCR-VL and
        the families answered at `get_image_features`, a ModuleDict of the tower and the
        projector or Merger, which vitpool runs too).

    Raises:
        TypeError: the model has no tower of a vitpool family, or its tower is replaced already.
    """
    inner, tower, record, _ = _vision_parts(model)
    weight = next(tower.parameters())
    stand_in_class = _feature_stand_in(record)
    if stand_in_class is not None:
        stand_in = stand_in_class(encoder, weight.dtype, weight.device, inner.config)
        names = (stand_in_class.tower, *stand_in_class.projectors)
        features_original = torch.nn.ModuleDict({name: getattr(inner, name) for name in names})
        for name in stand_in_class.projectors:
            setattr(inner, name, PassThroughProjector(getattr(inner, name)))
        setattr(inner, stand_in_class.tower, stand_in)
        # an instance attribute: the model's forward calls self.get_image_features, found here first
        inner.get_image_features = stand_in.get_image_features
        return features_original
    parts = _model_parts(record)
    merge = getattr(tower, "spatial_merge_size", None) or getattr(tower.config, "spatial_merge_size", None)
    if merge is None:  # Kimi-K2.5: a square merge kernel
        merge = int(tower.config.merge_kernel_size[0])
    original: torch.nn.Module = tower
    if parts.projector is not None:
        original = torch.nn.ModuleDict({"tower": tower, "projector": getattr(inner, parts.projector)})
        setattr(inner, parts.projector, PassThroughProjector(getattr(inner, parts.projector)))
    setattr(inner, parts.tower, PooledVisionTower(encoder, merge, weight.dtype, weight.device, parts))
    return original


def restore_vision_tower(model: torch.nn.Module, original: torch.nn.Module) -> None:
    """Put back what `replace_vision_tower(model, ...)` returned.

    Raises:
        TypeError: the model's tower is not replaced.
    """
    inner = getattr(model, "model", model)
    stand_in = next(
        (
            getattr(inner, name)
            for name in _TOWER_ATTRIBUTES
            if isinstance(getattr(inner, name, None), _STAND_INS)
        ),
        None,
    )
    if stand_in is None:
        raise TypeError(f"{type(model).__name__}'s vision tower is not replaced")
    if isinstance(stand_in, PooledImageFeatures):
        for name, module in original.items():
            setattr(inner, name, module)
        inner.__dict__.pop("get_image_features", None)  # the class's method again
    elif stand_in.parts.projector is not None:
        setattr(inner, stand_in.parts.tower, original["tower"])
        setattr(inner, stand_in.parts.projector, original["projector"])
    else:
        setattr(inner, stand_in.parts.tower, original)


def graph_encoder_for(model: torch.nn.Module, **kwargs: Any) -> GraphEncoder:
    """An in-process GraphEncoder over a copy of `model`'s own vision tower (and projector, where
    vitpool runs it), same weights, device and dtype. `kwargs` go to GraphEncoder (budgets,
    max_items_per_batch, ...). Unlike a standalone GraphEncoder, no item bound by default
    (`max_item_tokens=None`): the drop-in runs what the Hugging Face model would (a long video).

    Step-3.7's and DeepSeek-OCR-2's crop size is the processor's setting, not the model's: set
    `local_image_size` in the model's vision config where its processor cuts crops of another
    size than the releases' (504 and 768 pixels).

    Raises:
        TypeError: the model has no tower of a vitpool family, or its tower is replaced already.
        ConfigError: a setting vitpool does not run (MiniCPM-V 4.6's "4x" mode, ...).
    """
    inner, tower, record, family = _vision_parts(model)
    weight = next(tower.parameters())
    stand_in_class = _feature_stand_in(record)
    parts = _model_parts(record)
    if stand_in_class is not None:
        module = stand_in_class.encoder_module(inner, tower)
    elif parts.projector is not None and parts.encoder_module is not None:
        module = named_object(parts.encoder_module)(
            copy.deepcopy(tower), copy.deepcopy(getattr(inner, parts.projector))
        )
    else:
        module = copy.deepcopy(tower)  # the adapter changes the tower's attention
    kwargs.setdefault("max_item_tokens", None)
    return GraphEncoder(family.adapter(module), device=weight.device, dtype=weight.dtype, **kwargs)


def _vision_parts(
    model: torch.nn.Module,
) -> tuple[torch.nn.Module, torch.nn.Module, FamilyRecord | None, Family]:
    """`model.model` (Llama 4: the model itself), its (original) vision tower, and the tower's
    family's record (None: a family registered without one) and family: the model's own
    family's where it has a tower of that type (a SigLIP tower is Gemma 3's and
    LLaVA-OneVision's), else whichever family has it.

    Raises:
        TypeError: no tower of a vitpool family, or one already replaced.
    """
    inner = getattr(model, "model", model)
    towers = [
        getattr(inner, name)
        for name in _TOWER_ATTRIBUTES
        if isinstance(getattr(inner, name, None), torch.nn.Module)
    ]
    if not towers:
        names = " or ".join(_TOWER_ATTRIBUTES)
        raise TypeError(f"{type(model).__name__} has no vision tower ({names}) on .model or on itself")
    tower = towers[0]
    if isinstance(tower, _STAND_INS):
        raise TypeError("the model's tower is already replaced; pass the original tower's model")
    model_type = getattr(getattr(tower, "config", None), "model_type", None)
    full_type = getattr(getattr(inner, "config", None), "model_type", None)
    family = tower_family(full_type, model_type) if model_type else None
    if family is None:
        raise TypeError(
            f"{type(model).__name__}'s vision tower ({model_type!r}) is of no vitpool family; "
            f"supported: {', '.join(supported_model_types())}"
        )
    return inner, tower, family_record(full_type, model_type), family
