"""MiniCPM-V 4.6's processor output cut into items (`vitpool.items_from`).

`MiniCPMV4_6ImageProcessor` packs every slice of every image side by side into one strip
`pixel_values` [1, C, P, N*P] (each slice's h*w patches in turn), with one `target_sizes` row
(h, w) per slice and `num_patches_per_image`, the slices of each image (its overview, then its
refined slices). An item is one image: its slices' columns of the strip and their `target_sizes`
rows, as the processor gives them for that image alone (`rules.py`). `MiniCPMV4_6Processor` drops
`num_patches_per_image` (among its unused inputs), and without it a slice row does not say which
image it belongs to: that output cannot be cut.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.families.internvl.processor import cut_by_counts, refuse_videos, required, whole_numbers
from vitpool.families.minicpmv4_6.rules import parse_target_sizes
from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array

SLICES_KEY = "num_patches_per_image"


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image: its slices' patch columns of the strip and its `target_sizes` rows.

    Raises:
        ValueError: no `num_patches_per_image` (MiniCPMV4_6Processor's output), videos, a strip
            that is not [1, C, P, N*P], or slices and patches that do not add up.
    """
    refuse_videos(batch, "MiniCPM-V 4.6")
    strip = required(batch, "pixel_values", "")
    check_array(strip, "pixel_values")
    target_sizes = required(batch, "target_sizes", "")
    slices = whole_numbers(
        required(batch, SLICES_KEY,
                 "MiniCPMV4_6Processor drops it; cut the image processor's output instead "
                 "(processor.image_processor(images, return_tensors='pt') keeps it), or call the "
                 "processor one image at a time and make each item by hand (README)"),
        SLICES_KEY,
    )
    patch = patch_size_of(strip)
    parts = []
    start = 0  # the first patch column of the image
    for sizes in cut_by_counts(target_sizes, "target_sizes", slices, SLICES_KEY):
        patches = sum(h * w for h, w in parse_target_sizes(sizes))
        parts.append((strip[..., start * patch : (start + patches) * patch], sizes))
        start += patches
    if start * patch != strip.shape[-1]:
        raise ValueError(
            f"pixel_values holds {strip.shape[-1] // patch} patches; the target_sizes rows account for "
            f"{start}"
        )
    return [ProcessorItem(IMAGE, pixels, sizes) for pixels, sizes in parts]


def patch_size_of(strip: Any) -> int:
    """The strip's patch side P: its height, each patch P columns wide."""
    shape = tuple(strip.shape)
    if len(shape) != 4 or shape[0] != 1 or shape[2] < 1 or shape[3] % shape[2]:
        raise ValueError(
            f"pixel_values has shape {shape}; the processor's strip is [1, C, P, N*P] (N patches of P x P "
            "side by side)"
        )
    return shape[2]
