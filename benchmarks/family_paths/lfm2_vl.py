"""LFM2-VL (the SigLIP2 NaFlex tower and LFM2-VL's pixel-unshuffle projector, LFM2-VL-450M's sizes):
vitpool's encoder against Hugging Face's `Lfm2VlModel.get_image_features` on the same tower and
projector. Items are what `Lfm2VlImageProcessor` gives at its default settings: one image's entries
(a small image whole; a large one's 512² tiles and its thumbnail) as packed patch rows [sum h*w,
3*16*16] with their `spatial_shapes` rows; Hugging Face gets every entry of a call in one batch laid
out as the processor lays it out (each entry zero-padded to the processor's `max_num_patches`,
1024, with `spatial_shapes` and `pixel_attention_mask`), and both paths end with the projector's
tokens [N, 1024] on the device.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from common import hugging_face_forwards

from vitpool import Image

VISION_MODEL_TYPE = (
    "siglip2_vision_model"  # the family record's tower type: LFM2-VL's vision config is SigLIP2's
)
# LFM2-VL-450M (the flagship json's checkpoint and "extra"): LFM2-350M's width, the projector's 2 x 2
# pixel unshuffle and GELU MLP of 2560 with biases; its LayerNorm is transformers' Lfm2VlConfig
# default (projector_use_layernorm=True; the remote-code release had no such field, its projector a
# LayerNorm; LFM2.5-VL-450M's config says true).
PROJECTOR_FIELDS = {
    "text_hidden_size": 1024,
    "downsample_factor": 2,
    "projector_hidden_size": 2560,
    "projector_hidden_act": "gelu",
    "projector_bias": True,
    "projector_use_layernorm": True,
}
# Lfm2VlImageProcessor's defaults (the flagship json's "extra" holds the same): 512² tiles, 2 to 10 of
# them with a thumbnail, a whole image between 64 and 256 tokens, split when over 2x the latter.
PROCESSOR = {
    "tile_size": 512,
    "min_tiles": 2,
    "max_tiles": 10,
    "min_image_tokens": 64,
    "max_image_tokens": 256,
    "max_pixels_tolerance": 2.0,
    "use_thumbnail": True,
}
# Hugging Face's batch pads every entry to the processor's max_num_patches (do_pad=True), not to the
# call's largest entry; False pads to the largest (Hugging Face's least work, not what it receives).
PAD_AS_PROCESSOR = True


def entry_shapes(height: int, width: int, patch: int, factor: int) -> list[list[int]]:
    """(h, w) in patches of each entry Lfm2VlImageProcessor makes of a height x width image at its
    defaults (`resize_and_split`): a small image smart-resized whole (sides multiples of patch x
    factor, between min and max_image_tokens); a large one (over max_image_tokens x tolerance) as
    rows x cols tiles of tile_size², row by row, then its thumbnail at the smart-resized size."""
    unit = patch * factor
    least, most = (PROCESSOR[key] * unit * unit for key in ("min_image_tokens", "max_image_tokens"))
    h_bar, w_bar = (max(unit, round(side / unit) * unit) for side in (height, width))
    large = h_bar * w_bar > most * PROCESSOR["max_pixels_tolerance"]
    if h_bar * w_bar > most:
        beta = math.sqrt(height * width / most)
        h_bar, w_bar = (max(unit, math.floor(side / beta / unit) * unit) for side in (height, width))
    elif h_bar * w_bar < least:
        beta = math.sqrt(least / (height * width))
        h_bar, w_bar = (math.ceil(side * beta / unit) * unit for side in (height, width))
    whole = [h_bar // patch, w_bar // patch]
    if not large:
        return [whole]
    cols, rows = tile_grid(height, width)
    side = PROCESSOR["tile_size"] // patch
    thumbnail = [whole] if PROCESSOR["use_thumbnail"] and rows * cols != 1 else []
    return [[side, side]] * (rows * cols) + thumbnail


def tile_grid(height: int, width: int) -> tuple[int, int]:
    """(cols, rows) of tiles: the processor's grid nearest the image's aspect ratio
    (`find_closest_aspect_ratio` over its `_target_ratios`, ties to the larger grid where the image
    covers over half of it)."""
    low, high, tile = PROCESSOR["min_tiles"], PROCESSOR["max_tiles"], PROCESSOR["tile_size"]
    ratios = sorted(
        {
            (w, h)
            for n in range(low, high + 1)
            for w in range(1, n + 1)
            for h in range(1, n + 1)
            if low <= w * h <= high
        },
        key=lambda ratio: ratio[0] * ratio[1],
    )
    best, best_diff = (1, 1), float("inf")
    for ratio in ratios:
        diff = abs(width / height - ratio[0] / ratio[1])
        if diff < best_diff:
            best, best_diff = ratio, diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * ratio[0] * ratio[1]:
            best = ratio
    return best


def workloads(vision_config: dict) -> dict[str, list]:
    """One 224² image, four, and one 1024² image, each as the processor cuts it at its defaults: a
    224² image is one entry of 256² (16 x 16 patches, 64 tokens); a 1024² image 2 x 2 tiles of 512²
    and a 512² thumbnail (5 entries of 32 x 32 patches, 1280 tokens)."""
    patch = vision_config["patch_size"]
    width = vision_config.get("num_channels", 3) * patch * patch

    def image(pixels: int) -> Image:
        shapes = entry_shapes(pixels, pixels, patch, PROJECTOR_FIELDS["downsample_factor"])
        return Image(torch.randn(sum(h * w for h, w in shapes), width), shapes)

    return {"1x224": [image(224)], "4x224": [image(224) for _ in range(4)], "1x1024": [image(1024)]}


def max_num_patches(patch: int, factor: int) -> int:
    """The processor's pad target: the larger of a thumbnail's most patches and a tile's."""
    return max(PROCESSOR["max_image_tokens"] * factor * factor, (PROCESSOR["tile_size"] // patch) ** 2)


def padded_entries(items: list, pad_to: int) -> dict[str, torch.Tensor]:
    """Every entry of the items, in order, as the processor lays out a batch: [entries, pad, C*P*P]
    zero-padded, `spatial_shapes` [entries, 2], `pixel_attention_mask` [entries, pad] (int32)."""
    shapes = [
        (int(h), int(w)) for item in items for h, w in torch.as_tensor(item.grid_thw).reshape(-1, 2).tolist()
    ]
    rows = torch.cat([torch.as_tensor(item.pixel_values) for item in items])
    pad_to = max(pad_to, max(h * w for h, w in shapes))
    pixels = rows.new_zeros(len(shapes), pad_to, rows.shape[-1])
    mask = torch.zeros(len(shapes), pad_to, dtype=torch.int32)
    start = 0
    for entry, (h, w) in enumerate(shapes):
        pixels[entry, : h * w] = rows[start : start + h * w]
        mask[entry, : h * w] = 1
        start += h * w
    return {"pixel_values": pixels, "spatial_shapes": torch.tensor(shapes), "pixel_attention_mask": mask}


def hugging_face(module: torch.nn.Module, items: list) -> torch.Tensor:
    """Hugging Face's own `Lfm2VlModel.get_image_features` (the SigLIP2 tower over the padded entries
    with their `spatial_shapes` and `pixel_attention_mask`, then the projector's pixel unshuffle and
    MLP) on `module`'s `vision_tower` and `multi_modal_projector`, every entry of the call in one
    batch; its per-entry tokens joined in entry order [N, text width], which is item order. The batch
    goes to the device as the model receives it (a processor output moved with `.to(device)`)."""
    from transformers.models.lfm2_vl.modeling_lfm2_vl import Lfm2VlModel

    hugging_face_forwards(module)
    parameter = next(module.parameters())
    projector = module.multi_modal_projector
    factor = int(projector.factor)
    pad_to = max_num_patches(int(module.config.patch_size), factor) if PAD_AS_PROCESSOR else 0
    batch = padded_entries(items, pad_to)
    batch = {key: value.to(parameter.device) for key, value in batch.items()}
    batch["pixel_values"] = batch["pixel_values"].to(parameter.dtype)
    # the model's method on its own modules: what it reads of the model besides them is its config's
    # downsample_factor (and return_dict, through its decorator)
    model = SimpleNamespace(
        vision_tower=module.vision_tower,
        multi_modal_projector=projector,
        config=SimpleNamespace(downsample_factor=factor, return_dict=True),
    )
    features = Lfm2VlModel.get_image_features(model, **batch)
    features = getattr(features, "pooler_output", features)
    return torch.cat(list(features))
