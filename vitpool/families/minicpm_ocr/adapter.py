"""MiniCPM-OCR (`MiniCPMOcrVisionModel` + `MiniCPMOcrMerger`): MiniCPM-V 4.6's vision path, read in
the "4x" mode by default, run over static buffers.

What MiniCPM-OCR changes against 4.6 (transformers 5.24, `modular_minicpm_ocr.py` inherits 4.6's
config, model and processors): its modeling is 4.6's renamed (the generated file is 4.6's line for
line); its config's `downsample_mode` defaults to "4x" (4.6's to "16x"), ties the LLM's embeddings
and drops `image_size` and `drop_vision_last_layer`; its image processor defaults to "4x" and can
size small images and slices by their glyphs (`small_image_upsize`), which changes only the
slices' sizes. In "4x" `get_image_features` skips the in-tower window merger: every block runs at
full resolution, one attention sequence per slice, then `post_layernorm`, then the Merger's 2 x 2
merge and MLP: h*w / 4 tokens a slice.

In the graph ("4x", `MiniCPMOcrAdapter`): the patch embedding over the [rows, C, P, P] buffer plus
`position_embedding[position_ids]`; every block through vitpool's packed attention hook with
`cu_seqlens` over the rows (`max_seqlen` the buffer's rows, a Python int); `post_layernorm`; a
gather by `merge_index` [tokens, 4] of each 2 x 2 block's rows in the Merger's order (its
`view(h/2, 2, w/2, 2)` and permute), reshaped to [tokens, 4 * d], then `merger.mlp[0]`. On the host:
the position ids, `cu_seqlens` and `merge_index` of each slice (cached per slice size). Padding
rows (a multiple of 4, at the end) read position 0, form one trailing sequence and their tokens
gather their own rows. Why not Hugging Face's forward: as 4.6's (`vitpool.families.minicpmv4_6.adapter`),
it reads `target_sizes` on the host and loops over slices in its Merger.

"16x" (`downsample_mode="16x"` in the config, both merges) is 4.6's forward, metadata and item
sampling unchanged: the adapter hands each to 4.6's adapter, its base, in that mode.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from transformers.vision_utils import get_vision_nearest_position_ids

from vitpool.errors import ConfigError
from vitpool.families.minicpm_ocr.rules import DEFAULT_MODE, FAMILY, MERGE_SIDE, MiniCPMOcrRules
from vitpool.families.minicpmv4_6 import adapter as adapter_4_6
from vitpool.families.minicpmv4_6.adapter import (
    CHECKPOINT_PREFIXES,  # noqa: F401 - the registry's prefixes, checked against these
    MiniCPMV4_6Adapter,
    MiniCPMV4_6Encoder,
)
from vitpool.families.minicpmv4_6.rules import parse_target_sizes
from vitpool.kernels.attention import install_packed_attention
from vitpool.models.adapter_base import sample_block_parts
from vitpool.models.compat import check_tower_parts, installed_transformers
from vitpool.models.projected import tower_and_projector
from vitpool.models.protocol import TensorSpec, zero_metadata
from vitpool.packing import Budget
from vitpool.specs import IMAGE, ItemSpec

VISION_MODEL_TYPE = "minicpm_ocr_vision"
TRANSFORMERS_MODULE = "transformers.models.minicpm_ocr"
# The release checked here (5.17, the range's lower bound, lacks the model; those between were not
# checked).
FIRST_TRANSFORMERS = "5.24.0"
MAX_SAMPLED_SLICES = 3
PATCHES_PER_TOKEN = MERGE_SIDE[DEFAULT_MODE] ** 2
# The parts the "4x" forward reads (checked when the adapter is built).
TOWER_PARTS = (
    "vision_tower.embeddings.patch_embedding",
    "vision_tower.embeddings.position_embedding",
    "vision_tower.embeddings.num_patches_per_side",
    "vision_tower.encoder.layers",
    "vision_tower.post_layernorm",
    "merger.mlp",
    "merger.merge_kernel_size",
)


def missing_transformers_model() -> str | None:
    """Why this transformers cannot build MiniCPM-OCR (None: it can): it has no
    `transformers.models.minicpm_ocr`."""
    if importlib.util.find_spec(TRANSFORMERS_MODULE) is not None:
        return None
    return (
        f"{FAMILY} needs a transformers with its model ({TRANSFORMERS_MODULE}, in {FIRST_TRANSFORMERS}); "
        f"transformers {installed_transformers()} is installed: "
        f"pip install 'transformers>={FIRST_TRANSFORMERS}'"
    )


def as_ocr(error: ConfigError) -> ConfigError:
    """4.6's code names its family in its errors; the model here is MiniCPM-OCR."""
    return ConfigError(str(error).replace(adapter_4_6.FAMILY, FAMILY))


class MiniCPMOcrEncoder(MiniCPMV4_6Encoder):
    """The tower and its Merger (state keys `vision_tower.*`, `merger.*`, as 4.6's) and the
    downsample mode they run in (the model's config's, not in the state)."""

    def __init__(
        self, vision_tower: torch.nn.Module, merger: torch.nn.Module, downsample_mode: str = DEFAULT_MODE
    ) -> None:
        super().__init__(vision_tower, merger)
        self.downsample_mode = downsample_mode


def check_supported(vision_config: Any, settings: dict[str, Any]) -> None:
    """ConfigError for what the static forward does not run: another mode than "4x" or "16x",
    another merge kernel than 2 x 2, more than one merge round; in "16x" also 4.6's limits of the
    window merger, which "4x" does not run."""
    mode = settings["downsample_mode"]
    if mode == "16x":
        try:
            adapter_4_6.check_supported(vision_config, settings)
        except ConfigError as error:
            raise as_ocr(error) from None
        return
    problems = []
    if mode not in MERGE_SIDE:
        problems.append(f"downsample_mode {mode!r} (only '4x' and '16x' are supported)")
    merge_kernel = tuple(settings["merge_kernel_size"])
    if merge_kernel != (2, 2):
        problems.append(f"merge_kernel_size {merge_kernel} (only (2, 2) is supported)")
    if settings["merger_times"] != 1:
        problems.append(f"merger_times {settings['merger_times']} (only 1 is supported)")
    if problems:
        raise ConfigError(f"{FAMILY}: vitpool does not run this model: {'; '.join(problems)}")


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> MiniCPMOcrEncoder:
    """Fresh MiniCPMOcrVisionModel and MiniCPMOcrMerger in the config's mode, from a full
    MiniCPMOcrConfig or a vision config written by `tower_only_config`.

    Raises:
        ValueError: the config lacks the LLM's width; ConfigError: an unsupported setting, or a
            transformers without MiniCPM-OCR.
    """
    missing = missing_transformers_model()
    if missing:
        raise ConfigError(missing)
    from transformers.models.minicpm_ocr.modeling_minicpm_ocr import MiniCPMOcrMerger, MiniCPMOcrVisionModel

    full = MiniCPMOcrAdapter.projector_config(config)
    check_supported(full.vision_config, vars(full))
    vision_tower, merger = tower_and_projector(MiniCPMOcrVisionModel, MiniCPMOcrMerger, full, dtype)
    return MiniCPMOcrEncoder(vision_tower, merger, full.downsample_mode)


class MiniCPMOcrAdapter(MiniCPMV4_6Adapter):
    """Adapter for `MiniCPMOcrEncoder`: in "4x" (the default) its own forward, metadata and
    sampled items (see the module's opening); in "16x" 4.6's, naming MiniCPM-OCR. 4.6's reading of
    configs and checkpoints (4.6's keys) in both."""

    FAMILY = FAMILY
    FULL_CONFIG_CLASS = "MiniCPMOcrConfig"
    VISION_MODEL_TYPE = VISION_MODEL_TYPE

    @classmethod
    def merger_settings(cls, config: Any) -> tuple[Any, dict[str, Any]]:
        """4.6's, with MiniCPM-OCR's default mode ("4x") for a tower-only config that names none."""
        vision_config, settings = super().merger_settings(config)
        if vision_config is config and getattr(config, "downsample_mode", None) is None:
            settings["downsample_mode"] = DEFAULT_MODE
        return vision_config, settings

    def __init__(self, tower: MiniCPMOcrEncoder) -> None:
        self.downsample_mode = getattr(tower, "downsample_mode", DEFAULT_MODE)
        if self.downsample_mode == "16x":
            try:
                super().__init__(tower)
            except ConfigError as error:
                raise as_ocr(error) from None
            rules = self.item_rules
            self.item_rules = MiniCPMOcrRules(
                rules.channels, rules.patch_size, rules.output_width, downsample_mode="16x"
            )
            return
        # Not 4.6's __init__ in "4x": it checks and caches what only "16x" reads (the window merger).
        check_tower_parts(FAMILY, tower, TOWER_PARTS)
        vision_tower = tower.vision_tower
        config = vision_tower.config
        settings = {
            "downsample_mode": self.downsample_mode,
            "merge_kernel_size": tower.merger.merge_kernel_size,
            "merger_times": len(tower.merger.mlp),
        }
        check_supported(config, settings)
        self.tower = tower
        self.item_rules = MiniCPMOcrRules(
            int(config.num_channels), int(config.patch_size), int(tower.merger.mlp[0].linear_2.out_features)
        )
        self._num_patches_per_side = int(vision_tower.embeddings.num_patches_per_side)
        self._per_slice_4x = lru_cache(maxsize=1024)(self._slice_metadata_4x)
        install_packed_attention(vision_tower)

    @property
    def is_16x(self) -> bool:
        """Both merges run: 4.6's forward, metadata and sampled items."""
        return self.downsample_mode == "16x"

    def max_rows(self, num_tokens: int) -> int:
        if self.is_16x:
            return super().max_rows(num_tokens)
        return num_tokens * PATCHES_PER_TOKEN

    def metadata_specs(self, num_rows: int, budget: Budget) -> dict[str, TensorSpec]:
        if self.is_16x:
            return super().metadata_specs(num_rows, budget)
        return {
            "position_ids": TensorSpec((num_rows,), torch.long),
            # one sequence per slice, the padding's, the leading 0
            "cu_seqlens": TensorSpec((budget.max_sequences + 2,), torch.int32),
            "merge_index": TensorSpec((num_rows // PATCHES_PER_TOKEN, PATCHES_PER_TOKEN), torch.long),
        }

    def build_metadata(
        self, specs: Sequence[ItemSpec], num_rows: int, budget: Budget
    ) -> dict[str, torch.Tensor]:
        if self.is_16x:
            return super().build_metadata(specs, num_rows, budget)
        slices = [size for spec in specs for size in parse_target_sizes(spec.layout)]
        rows = sum(h * w for h, w in slices)
        if (
            num_rows % PATCHES_PER_TOKEN
            or rows > num_rows
            or len(slices) > budget.max_sequences
            or rows // PATCHES_PER_TOKEN > budget.num_tokens
            or len(specs) > budget.max_items
        ):
            raise ValueError(
                f"{len(specs)} items need {rows} rows, {len(slices)} sequences and "
                f"{rows // PATCHES_PER_TOKEN} tokens; the buffers hold {num_rows} rows (a multiple of "
                f"{PATCHES_PER_TOKEN}), {budget.max_sequences} sequences, {budget.num_tokens} tokens and "
                f"{budget.max_items} items"
            )
        metadata = zero_metadata(self.metadata_specs(num_rows, budget))
        # Padding: position 0, its tokens gather their own rows.
        metadata["merge_index"].copy_(torch.arange(num_rows).view(-1, PATCHES_PER_TOKEN))
        boundaries = [0]
        for h, w in slices:
            row, end = boundaries[-1], boundaries[-1] + h * w
            positions, merge_index = self._per_slice_4x(h, w)
            metadata["position_ids"][row:end] = positions
            metadata["merge_index"][row // PATCHES_PER_TOKEN : end // PATCHES_PER_TOKEN] = merge_index + row
            boundaries.append(end)
        # unused entries repeat the end: the padding rows are one trailing sequence
        cu_seqlens = metadata["cu_seqlens"]
        cu_seqlens.fill_(num_rows)
        cu_seqlens[: len(boundaries)] = torch.tensor(boundaries, dtype=torch.int32)
        return metadata

    def forward(self, pixels: torch.Tensor, metadata: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if self.is_16x:
            return super().forward(pixels, metadata)
        vision_tower = self.tower.vision_tower
        num_rows = pixels.shape[0]  # static: a Python int from the buffer's shape
        embeddings = vision_tower.embeddings
        hidden = embeddings.patch_embedding(pixels).flatten(1)  # [rows, d]
        hidden = (hidden + embeddings.position_embedding(metadata["position_ids"])).unsqueeze(0)
        for layer in vision_tower.encoder.layers:
            hidden = layer(hidden, None, cu_seqlens=metadata["cu_seqlens"], max_seqlen=num_rows)
        hidden = vision_tower.post_layernorm(hidden[0])
        merge_index = metadata["merge_index"]
        merged = hidden[merge_index].reshape(merge_index.shape[0], -1)  # [tokens, 4 * d]
        return [self.tower.merger.mlp[0](merged)]

    def sample_specs(self, num_rows: int, budget: Budget, rng: random.Random) -> list[ItemSpec]:
        if self.is_16x:
            return super().sample_specs(num_rows, budget, rng)
        rules = self.item_rules
        specs: list[ItemSpec] = []
        side = MERGE_SIDE[DEFAULT_MODE]  # a block: 2 x 2 patches, one token
        blocks = min(num_rows // PATCHES_PER_TOKEN, budget.num_tokens)
        for slices in sample_block_parts(
            rng, blocks, budget.max_sequences, self.sampled_items(budget), MAX_SAMPLED_SLICES
        ):
            sizes = [(side * height, side * width) for height, width in slices]
            rows = sum(h * w for h, w in sizes)
            specs.append(rules.item_spec(IMAGE, (rows, *rules.row_shape), "float32", sizes))
        return specs

    def _slice_metadata_4x(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A slice's position ids [h*w] and its Merger gather [h*w/4, 4] (2 x 2 blocks in raster
        order, each in raster order)."""
        positions = get_vision_nearest_position_ids(torch.tensor([[h, w]]), self._num_patches_per_side)
        merge_index = torch.arange(h * w).view(h // 2, 2, w // 2, 2).permute(0, 2, 1, 3)
        return positions.long(), merge_index.reshape(-1, PATCHES_PER_TOKEN)


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = MiniCPMOcrAdapter.tower_only_config
convert_checkpoint = MiniCPMOcrAdapter.convert_checkpoint
