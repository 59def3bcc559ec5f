"""Items from VideoLLaMA 3's processor output (`vitpool.items_from`): Qwen-style patch rows and
(t, h, w) grids, plus one merge size per item (`image_merge_sizes`, `video_merge_sizes`), which
becomes the fourth entry of each item's grid. `video_compression_mask` (the video processor's
frame-difference pruning, computed on the host) is not the encoder's: the model applies it to the
concatenated video tokens after `get_video_features`, so it stays with the caller.

No torch here: a batch's values are torch tensors or NumPy arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vitpool.models.processor_items import IMAGE, VIDEO, ProcessorItem, cut_by_grid, whole_numbers

# (pixels, grid, merge sizes) keys of each modality
KEYS = (
    (IMAGE, "pixel_values", "image_grid_thw", "image_merge_sizes"),
    (VIDEO, "pixel_values_videos", "video_grid_thw", "video_merge_sizes"),
)


def video_llama_3_items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image, then one per video, each grid (t, h, w, merge size).

    Raises:
        ValueError: a grid without its merge sizes (named, with what to pass), merge sizes that are
            not one per grid row, or a grid whose h and w are not multiples of its merge size (the
            model's `pixel_unshuffle` would fail on it too).
    """
    items: list[ProcessorItem] = []
    for modality, pixels_key, grid_key, merge_key in KEYS:
        cut = cut_by_grid(batch, pixels_key, grid_key, modality)
        if not cut:
            continue
        if batch.get(merge_key) is None:
            raise ValueError(
                f"the batch has {grid_key} but no {merge_key}, which VideoLLaMA 3's get_image_features "
                "needs; pass the processor's whole output"
            )
        merges = whole_numbers(batch[merge_key], merge_key)
        if len(merges) != len(cut):
            raise ValueError(f"{merge_key} has {len(merges)} entries; {grid_key} has {len(cut)} rows")
        for index, (item, merge) in enumerate(zip(cut, merges)):
            t, h, w = item.grid
            if merge < 1 or h % merge or w % merge:
                raise ValueError(
                    f"{merge_key}[{index}] = {merge}: {grid_key} row {index} ({t}, {h}, {w}) needs a "
                    "positive merge size that divides h and w"
                )
            items.append(ProcessorItem(modality, item.pixel_values, (t, h, w, merge)))
    return items
