"""DeepSeek-OCR-2 (`DeepseekOcr2VisionModel`), its `multi_modal_projector` and `view_separator`:
two paths through one tower.

`DeepseekOcr2ImageProcessor` gives an image a global view (`pixel_values`, one 1024² tile: the
image padded to a square) and, when its long side is over its `tile_size` (768 pixels by
default), 2 to 6 local crops (`pixel_values_local`, tiles of that side). The model runs both
through the same tower at their own resolution: a SAM ViT-B (16-pixel patches, windowed and
global attention with decomposed relative-position biases, a neck and two stride-2 convolutions:
256 SAM tokens a global view, 144 a 768² crop), then a Qwen2 decoder stack used as an encoder
over [SAM tokens; learned queries], where the SAM tokens attend to each other both ways and the
queries causally (to every SAM token and the queries before them); the queries' outputs,
projected into the LLM's width, are the view's tokens. There are two query tables, 144 rows and
256, and a tile takes the first where it has at most 144 SAM tokens, the second otherwise.
`get_image_features` hands the LLM an image's crops first, then its global view, then one learned
`view_separator` row. In vitpool each input is a path (`vitpool.rules.paths`), with its own
tiles, budgets and graphs; the global path appends the separator to each view's tokens (257 a
tile), so an item's parts are joined by concatenation.

The tower takes a square tile of any side S of at least one patch: the patch convolution reads
floor(S / 16) patches a side (pixels past the last whole patch are not read), the position table
and the global layers' relative-position tables are interpolated to that grid, windows are padded,
and each stride-2 convolution rounds up, so a tile has ceil(floor(S / 16) / 4)² SAM tokens and
gives 144 tokens (S under 784) or 256. The crop size is the processor's setting: vitpool reads it
where the checkpoint sets it (`DeepseekOcr2Adapter.crop_size`) and captures the crop path's graphs
for that size; square crops of another side of at least one patch run eagerly at their own size,
with the same tokens as the model's (`vitpool.models.tiled`). (The processor counts ceil(S / 64)²
placeholder tokens a crop, so the full model accepts only crops whose count is their query
table's: S in 705..768 or 961..1024.)

The tower runs from its parts (`vitpool.families.deepseek_ocr2.tower`: `tile_features`, the
family's one seam). State keys `vision_tower.*`, `multi_modal_projector.*` and `view_separator`; a
full checkpoint has them under `model.`, in transformers' layout or in the release's
(`vitpool.families.deepseek_ocr2.checkpoint`).
"""

from __future__ import annotations

from typing import Any

import torch

from vitpool.families.deepseek_ocr2 import checkpoint
from vitpool.families.deepseek_ocr2.tower import GLOBAL, LOCAL, DeepseekOcr2Encoder, tile_features
from vitpool.models.adapter_base import TEXT_HIDDEN_SIZE
from vitpool.models.tiled import PathTiles, ViewAndCropsAdapter, install_kernels
from vitpool.rules.tiles import SquareTiles

# DeepseekOcr2ImageProcessor's default `tile_size`: the side of a local crop in pixels. It is the
# processor's setting, not the model's (`DeepseekOcr2Adapter.crop_size`).
LOCAL_IMAGE_SIZE = 768
SEPARATOR_TOKENS = 1  # view_separator, after each global view
SAM_REDUCTION = 4  # the SAM neck's two stride-2 convolutions, each rounding up

# Default budgets: up to 8 global views (8 images) and 24 crops (4 images of 6 crops) per batch;
# more run eager at their own size.
MAX_GRAPH_TILES = {GLOBAL: 8, LOCAL: 24}


def build_encoder(config: Any, dtype: torch.dtype | None = None) -> DeepseekOcr2Encoder:
    """Fresh tower, projector and separator from a tower-only config
    (`DeepseekOcr2Adapter.tower_only_config`), for crops of `DeepseekOcr2Adapter.crop_size(config)`.

    Raises:
        ValueError: the config lacks a field the tower or the projector needs.
        CheckpointError: a crop size that is no positive whole number of pixels.
    """
    from transformers.models.deepseek_ocr2.modeling_deepseek_ocr2 import DeepseekOcr2VisionModel

    for name in ("sam_config", "encoder_config", "text_hidden_size"):
        if getattr(config, name, None) is None:
            raise ValueError(
                f"a DeepSeek-OCR-2 vision config needs {name} to build its tower and multi_modal_projector; "
                "give the full model's checkpoint (DeepseekOcr2Config) or a tower-only save that carries it"
            )
    if dtype is None:
        vision = DeepseekOcr2VisionModel(config)
    else:
        vision = DeepseekOcr2VisionModel._from_config(config, dtype=dtype)
    width, text_width = int(config.encoder_config.hidden_size), int(config.text_hidden_size)
    projector = torch.nn.Linear(width, text_width, dtype=dtype)
    crop = DeepseekOcr2Adapter.crop_size(config)
    return DeepseekOcr2Encoder(vision, projector, torch.zeros(text_width, dtype=dtype), crop)


class DeepseekOcr2PathAdapter(PathTiles):
    """One path's tiles through the tower and the projector; a global view's tokens end with the
    separator."""

    def __init__(self, encoder: DeepseekOcr2Encoder, path: str, output_width: int) -> None:
        tokens = encoder.queries(encoder.grids[path]).shape[0] + (SEPARATOR_TOKENS if path == GLOBAL else 0)
        crops = path == LOCAL  # crops of another side run eagerly; a global view of another side is refused
        # a crop of any side: its SAM tokens, then the rows of the query table the tower takes for
        # them: the 144 queries for at most 144 SAM tokens (MAX_PATCHES_OF_SMALL_QUERIES), else the 256
        queries = (encoder.vision_tower.query_768_resolution, encoder.vision_tower.query_1024_resolution)
        sides = SquareTiles(encoder.patch_size, SAM_REDUCTION, tuple(int(q.weight.shape[0]) for q in queries))
        super().__init__(
            encoder,
            path,
            int(encoder.vision_tower.sam_encoder.config.num_channels),
            encoder.tile_sizes[path],
            tokens,
            output_width,
            MAX_GRAPH_TILES[path],
            encoder.crop if crops else None,
            sides if crops else None,
        )

    def forward_tiles(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        tokens = self.tower.multi_modal_projector(tile_features(self.tower, self.path, pixels))
        if self.path == GLOBAL:  # [n, Q, W] -> [n, Q + 1, W]
            separator = self.tower.view_separator.to(tokens.dtype)[None, None].expand(tokens.shape[0], 1, -1)
            tokens = torch.cat([tokens, separator], dim=1)
        return [tokens.reshape(-1, tokens.shape[-1])]


class DeepseekOcr2Adapter(ViewAndCropsAdapter):
    """Adapter for `DeepseekOcr2Encoder`: two paths, local crops joined before the global view."""

    # What a tower-only save's vision config carries besides the tower's: the LLM's width (the
    # projector's output).
    PROJECTOR_FIELDS = (TEXT_HIDDEN_SIZE,)
    # The crops' side: DeepseekOcr2ImageProcessor's `tile_size`, LOCAL_IMAGE_SIZE unless the checkpoint
    # sets it.
    CROP_SETTING = ("DeepseekOcr2ImageProcessor", "tile_size", LOCAL_IMAGE_SIZE)

    # GraphEncoder refuses precision="fp8" with this reason
    fp8_refused = (
        "its FP8 tokens were far from the bf16 ones at the real size (per-token cosine median 0.66, "
        "benchmarks/RESULTS.md)"
    )

    # transformers' layout and the release's (`vitpool.families.deepseek_ocr2.checkpoint`).
    convert_checkpoint = staticmethod(checkpoint.encoder_state)

    def __init__(self, tower: DeepseekOcr2Encoder) -> None:
        width = int(tower.multi_modal_projector.out_features)
        if tuple(tower.view_separator.shape) != (width,):
            raise ValueError(
                f"DeepSeek-OCR-2's view_separator has shape {tuple(tower.view_separator.shape)}; the "
                f"projector gives rows of {width}"
            )
        install_kernels(tower)  # the patch convolution as a GEMM; its blocks run through tile_features
        super().__init__(
            tower, DeepseekOcr2PathAdapter(tower, LOCAL, width), DeepseekOcr2PathAdapter(tower, GLOBAL, width)
        )


# The loader's hooks and their long-standing names (`vitpool.models.family.adapter_checkpoint`).
tower_only_config = DeepseekOcr2Adapter.tower_only_config
convert_checkpoint = DeepseekOcr2Adapter.convert_checkpoint
