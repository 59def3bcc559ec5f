"""The base every family's adapter derives from (directly, or through the shared bases
`SpatialMergeAdapter`, `PatchRowAdapter`, `TiledAdapter`, `PathTiles` and `ViewAndCropsAdapter`).

It gives the protocol's members that have defaults (`vitpool.models.protocol.VisionAdapter`):

- `paths`: one path, "", run by the adapter itself; a family of several paths sets its own;
- `budget_range`: None, the device's default ladder (`vitpool.graphs.defaults`);
- `fp8_refused`: None, FP8 GEMMs allowed;

the sizes, from the item rules (`row_shape`, `output_row_shapes`, and `max_rows` for rules that
merge `merge_unit` rows into a token); the capture-check sampler's bound (`MAX_SAMPLED_ITEMS`,
`sampled_items`) and its block sampler (`sample_specs`: images, and clips where the adapter samples
frames, of whole merge blocks; `sample_block_parts` for items of several parts of blocks); and
what the loader needs of a family's checkpoints, read through the family's record
(`vitpool.models.family.adapter_checkpoint`):

- `tower_only_config`: a full model's config -> the config its tower (and projector) is built
  from, which is also what a tower-only save writes: the vision config with `PROJECTOR_FIELDS`
  added, for a full model of `FULL_MODEL_TYPES` (any, where that is empty);
- `projector_config`: what the projector reads, from a full model's config (as it is) or from a
  tower-only config carrying `PROJECTOR_FIELDS` (ValueError naming what it lacks);
- `convert_checkpoint`: a checkpoint's tensors -> the module's state, by first-match key renames
  (`CHECKPOINT_RENAMES`) less the keys Hugging Face ignores (`CHECKPOINT_IGNORED`).

A family sets the class attributes and overrides what its checkpoints need beyond them.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vitpool.errors import CheckpointError
from vitpool.models.projected import require_fields
from vitpool.packing import Budget
from vitpool.rules.patch_rows import EXTRA_ROWS, sample_grids
from vitpool.specs import IMAGE, VIDEO, ItemSpec

if TYPE_CHECKING:
    from vitpool.models.protocol import BudgetRange, TensorSpec, VisionAdapter
    from vitpool.specs import ItemRules

Renames = tuple[tuple[re.Pattern[str], str], ...]


@dataclass(frozen=True)
class ConfigField:
    """A field a tower-only save's vision config carries besides the tower's own, for the modules
    after the tower (a projector, a merger): its name there, where a full model's config holds it
    (a dotted path, "text_config.hidden_size"; the projector reads it there too), and the type it
    is kept as (None: as it is)."""

    name: str
    source: str
    cast: Callable[[Any], Any] | None = None

    def read(self, full_config: Any) -> Any:
        """The field's value in a full model's config."""
        return self.kept(functools.reduce(getattr, self.source.split("."), full_config))

    def kept(self, value: Any) -> Any:
        return value if self.cast is None else self.cast(value)


# The LLM's width, which every projector into it reads.
TEXT_HIDDEN_SIZE = ConfigField("text_hidden_size", "text_config.hidden_size")


def renamed_key(key: str, renames: Sequence[tuple[re.Pattern[str], str]]) -> str:
    """`key` under the first of `renames` (pattern, replacement) that matches it; as it is where
    none does."""
    for pattern, target in renames:
        name, count = pattern.subn(target, key)
        if count:
            return name
    return key


def is_full_config(config: Any) -> bool:
    """Whether `config` is a full multimodal model's (it holds a `vision_config`), not a tower's."""
    return getattr(config, "vision_config", None) is not None


class AdapterBase:
    """The defaults of `VisionAdapter`'s optional members, sizes from the item rules, the capture
    check's sampler, and a family's checkpoint handling (the module's opening).

    A subclass sets `tower` and `item_rules` and writes `metadata_specs`, `build_metadata` and
    `forward` (and `max_rows` or `sample_specs` where its rules are not merge blocks).
    """

    tower: torch.nn.Module
    item_rules: ItemRules

    # ---- the protocol's members with defaults ------------------------------------------------
    fp8_refused: str | None = None  # why precision="fp8" is refused; None: allowed
    _path_adapters: Mapping[str, VisionAdapter] | None = None

    @property
    def paths(self) -> Mapping[str, VisionAdapter]:
        """The adapter of each path by name: {"": self} unless the family sets its own."""
        return self._path_adapters if self._path_adapters is not None else {"": self}

    @paths.setter
    def paths(self, adapters: Mapping[str, VisionAdapter]) -> None:
        self._path_adapters = dict(adapters)

    def budget_range(self, device: torch.device) -> BudgetRange | None:
        """The budgets the family's graphs cover when the user names none: the device's ladder."""
        return None

    # ---- sizes, from the item rules -------------------------------------------------------------
    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.item_rules.row_shape)

    @property
    def output_row_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.item_rules.output_row_shapes)

    def max_rows(self, num_tokens: int) -> int:
        """Rows of `num_tokens` tokens of rules that merge `merge_unit` rows into each token."""
        return num_tokens * self.item_rules.merge_unit

    # ---- the capture check's sampler ------------------------------------------------------------
    # Sampled check batches stay small so that checking a budget costs little host time.
    MAX_SAMPLED_ITEMS: ClassVar[int] = 8
    # Frames of the items `sample_specs` draws: (fewest, most); more than one makes clips.
    sampled_frames: tuple[int, int] = (1, 1)
    # The longest side, in merge blocks, of the items `sample_specs` draws (None: any).
    max_sampled_side_blocks: int | None = None

    def sampled_items(self, budget: Budget) -> int:
        """The most items a sampled check batch holds within `budget`."""
        return min(self.MAX_SAMPLED_ITEMS, budget.max_items)

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        """Random items of whole merge blocks (`item_rules.merge_kernel`): images, and clips of up
        to `sampled_frames` frames within the budget's extra rows; some fill what is left, most
        take a part of it."""
        rules = self.item_rules
        grids = sample_grids(
            rng,
            rules.merge_kernel,
            num_rows,
            budget.num_tokens,
            self.sampled_items(budget),
            self.sampled_frames,
            budget.limit(EXTRA_ROWS) or 0,
            self.max_sampled_side_blocks,
        )
        return [
            rules.item_spec(VIDEO if t > 1 else IMAGE, (t * h * w, *rules.row_shape), "float32", (t, h, w))
            for t, h, w in grids
        ]

    # ---- the family's checkpoints ---------------------------------------------------------------
    # What a tower-only save's vision config carries besides the tower's fields.
    PROJECTOR_FIELDS: ClassVar[tuple[ConfigField, ...]] = ()
    # `projector_config`'s ValueError for a vision config without them: "<subject> needs [...] <advice>".
    PROJECTOR_SUBJECT: ClassVar[str] = "the vision config"
    PROJECTOR_ADVICE: ClassVar[str] = (
        "to build the modules after the tower; give the full model's config or a tower-only save written "
        "with tower_only_config"
    )
    # The full models whose tower and projector the family runs (empty: any), and the CheckpointError
    # for another (`{model_type}`: its type, quoted; `{expected}`: FULL_MODEL_TYPES).
    FULL_MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    OTHER_MODEL: ClassVar[str] = "a {model_type} checkpoint is not one vitpool runs (model_type {expected})"
    # A checkpoint's key -> the module's: the first pattern that matches applies.
    CHECKPOINT_RENAMES: ClassVar[Renames] = ()
    # Keys dropped on load (what Hugging Face ignores), matched as saved.
    CHECKPOINT_IGNORED: ClassVar[tuple[re.Pattern[str], ...]] = ()

    @classmethod
    def tower_only_config(cls, full_config: Any) -> Any:
        """The config the family's module is built from, of a full model's config: its vision
        config with `PROJECTOR_FIELDS` added; what a tower-only save writes as its config.json.

        Raises:
            CheckpointError: a full model outside `FULL_MODEL_TYPES`.
        """
        model_type = getattr(full_config, "model_type", None)
        if cls.FULL_MODEL_TYPES and model_type not in cls.FULL_MODEL_TYPES:
            expected = " or ".join(map(repr, cls.FULL_MODEL_TYPES))
            raise CheckpointError(cls.OTHER_MODEL.format(model_type=repr(model_type), expected=expected))
        config = cls.vision_config_of(full_config)
        for field in cls.PROJECTOR_FIELDS:
            setattr(config, field.name, field.read(full_config))
        return config

    # The config class of a tower-only save where it is the family's own (a tower's config under
    # the family's model_type, where the tower's own type is another family's): None, the vision
    # config's class.
    VISION_CONFIG: ClassVar[type | None] = None

    @classmethod
    def vision_config_of(cls, full_config: Any) -> Any:
        """A copy of a full model's vision config, to add `PROJECTOR_FIELDS` to: under
        `VISION_CONFIG` where the family sets one."""
        if cls.VISION_CONFIG is None:
            return copy.deepcopy(full_config.vision_config)
        fields = full_config.vision_config.to_dict()
        fields.pop("model_type", None)  # the class's own
        return cls.VISION_CONFIG.from_dict(fields)

    @classmethod
    def projector_config(cls, config: Any) -> Any:
        """What the modules after the tower read: a full model's config as it is, or of a tower-only
        config (`tower_only_config`) its vision config with each of `PROJECTOR_FIELDS` where the
        full config holds it.

        Raises:
            ValueError: a vision config without `PROJECTOR_FIELDS`, naming those it lacks.
        """
        if is_full_config(config):
            return config
        require_fields(
            config,
            [field.name for field in cls.PROJECTOR_FIELDS],
            cls.PROJECTOR_SUBJECT,
            f"{cls.PROJECTOR_ADVICE}; got a {type(config).__name__} "
            f"(model_type {getattr(config, 'model_type', None)!r})",
        )
        full = SimpleNamespace(vision_config=config)
        for field in cls.PROJECTOR_FIELDS:
            *parents, name = field.source.split(".")
            holder = full
            for parent in parents:
                holder = holder.__dict__.setdefault(parent, SimpleNamespace())
            setattr(holder, name, field.kept(getattr(config, field.name)))
        return full

    @classmethod
    def convert_checkpoint(
        cls, state: dict[str, torch.Tensor], config: Any = None
    ) -> dict[str, torch.Tensor]:
        """The module's state from a checkpoint's tensors (`CheckpointLayout.convert`): each key
        under the first of `CHECKPOINT_RENAMES` that matches it, those of `CHECKPOINT_IGNORED`
        dropped; other keys pass unchanged (a strict load names them). `config` is not needed."""
        return {
            renamed_key(key, cls.CHECKPOINT_RENAMES): tensor
            for key, tensor in state.items()
            if not any(pattern.search(key) for pattern in cls.CHECKPOINT_IGNORED)
        }


def renames(*pairs: tuple[str, str]) -> Renames:
    """(pattern, replacement) pairs, the patterns compiled."""
    return tuple((re.compile(pattern), target) for pattern, target in pairs)


def sample_block_parts(
    rng: random.Random, blocks: int, sequences: int, max_items: int, max_parts: int
) -> list[list[tuple[int, int]]]:
    """Random items of one to `max_parts` parts (each its own attention sequence: LFM2-VL's
    entries, MiniCPM-V's slices), each part a (height, width) in blocks of one token, below and
    above square, together at most `blocks` blocks, `sequences` parts and `max_items` items; some
    fill what is left, most take a part of it, so that padding rows are exercised too."""
    items: list[list[tuple[int, int]]] = []
    while blocks >= 1 and sequences >= 1 and len(items) < max_items:
        item_blocks = blocks if rng.random() < 0.2 else rng.randint(1, max(1, blocks // 2))
        num_parts = rng.randint(1, min(max_parts, sequences, item_blocks))
        parts = []
        for number in range(num_parts):
            parts_after = num_parts - number - 1
            share = item_blocks if not parts_after else rng.randint(1, item_blocks - parts_after)
            side = rng.randint(1, math.isqrt(share))
            height, width = rng.sample((side, share // side), 2)
            parts.append((height, width))
            item_blocks -= share
            blocks -= height * width
        items.append(parts)
        sequences -= num_parts
    return items


class PlainPathAdapter(AdapterBase):
    """An adapter of several paths (`paths`, set by the subclass) whose plain path "" answers the
    per-batch members for the adapter itself (Kimi-K2.5's, VideoLLaMA 3's): the encoder asks each
    path's adapter, and a caller holding the family's adapter gets the plain path's answers."""

    def max_rows(self, num_tokens: int) -> int:
        return self.paths[""].max_rows(num_tokens)

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        return self.paths[""].metadata_specs(num_rows, budget)

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        return self.paths[""].build_metadata(specs, num_rows, budget)

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return self.paths[""].forward(pixels, metadata)

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        return self.paths[""].sample_specs(num_rows, budget, rng)
