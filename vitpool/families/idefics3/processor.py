"""Idefics3's and SmolVLM's processor output cut into items (`vitpool.items_from`).

`Idefics3ImageProcessor` (and `SmolVLMImageProcessor`, the same code) takes images as samples of
one or more images (a flat list is ONE sample) and returns `pixel_values` [samples, frames, 3, S, S]:
each sample's frames in order (for each image its rows x cols splits row by row, then its global
image; an image that fits one split is that frame alone), padded to the longest sample with all-zero
frames, and `pixel_attention_mask` [samples, frames, S, S]. Every real frame is a full split (see
`vitpool.families.idefics3.adapter`), so the mask says nothing the frames do not. Where an image
ends only `rows` and `cols` say (one list per sample, one entry per image: 0 and 0 for an unsplit
image), which the image processor returns with `return_row_col_info=True`; `Idefics3Processor` and
`SmolVLMProcessor` drop them. An item is one image's frames; the padding frames are dropped, as the
model drops them. Without `rows` and `cols`, but with the mask (the full processors' output), an item
is one real frame: the model encodes each frame alone and hands the LLM their tokens in order, so
the items' tokens joined are its `get_image_features`, frame by frame.

No torch here: slicing and comparisons work on torch tensors and NumPy arrays alike.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitpool.models import processor_items
from vitpool.models.family import ProcessorOutput
from vitpool.models.processor_items import IMAGE, ProcessorItem, check_array, required

GRID_KEYS = ("rows", "cols")
GRID_HINT = (
    "call the image processor with return_row_col_info=True (Idefics3Processor and SmolVLMProcessor drop "
    "rows and cols: cut processor.image_processor(images, return_row_col_info=True, return_tensors='pt'))"
)


FAMILY = "idefics3"
MASK_KEY = "pixel_attention_mask"
PROMPT_KEYS = ("input_ids", "attention_mask")


@dataclass(frozen=True)
class Idefics3ProcessorOutput(ProcessorOutput):
    """The image processor's output with `rows` and `cols`, or the full processors' without them
    but with the mask, where no other family's keys mark the batch (LFM2-VL's `spatial_shapes`)."""

    def missing(self, keys: Collection[str]) -> tuple[str, ...]:
        """What keeps a batch with `keys` from being Idefics3's: empty where it is."""
        lacking = super().missing(keys)
        if not lacking or "pixel_values" not in keys or MASK_KEY not in keys or set(GRID_KEYS) & set(keys):
            return lacking
        foreign = processor_items.other_families_keys(keys, FAMILY, ("pixel_values", MASK_KEY, *PROMPT_KEYS))
        return tuple(sorted(foreign))


def items(batch: Mapping[str, Any]) -> list[ProcessorItem]:
    """One item per image, sample by sample: its frames of `pixel_values` [frames, 3, S, S], as
    many as its `rows` and `cols` say (rows * cols splits and a global image, or one frame).

    Raises:
        ValueError: no `rows` / `cols`, pixel values that are not [samples, frames, 3, S, S],
            counts that do not fit the samples, an image frame that is all zeros (padding, which
            the model would drop), a real frame the mask does not cover whole, or a sample holding
            real frames past its images'.
    """
    pixels = required(batch, "pixel_values", "")
    check_array(pixels, "pixel_values")
    if len(pixels.shape) != 5:
        raise ValueError(
            f"pixel_values has shape {tuple(pixels.shape)}; the image processor's is [samples, frames, "
            "channels, height, width] (do_pad=True, return_tensors='pt' or 'np')"
        )
    masks = batch.get(MASK_KEY)
    if masks is not None and all(batch.get(key) is None for key in GRID_KEYS):
        return _frames(pixels, masks)
    rows, cols = (_per_sample(required(batch, key, GRID_HINT), key) for key in GRID_KEYS)
    if not len(rows) == len(cols) == pixels.shape[0]:
        raise ValueError(
            f"pixel_values holds {pixels.shape[0]} samples; rows has {len(rows)} and cols {len(cols)}"
        )
    cut: list[ProcessorItem] = []
    for sample, (sample_rows, sample_cols) in enumerate(zip(rows, cols)):
        if len(sample_rows) != len(sample_cols):
            raise ValueError(
                f"sample {sample}: rows {sample_rows} and cols {sample_cols} count different images"
            )
        start = 0
        for image, (num_rows, num_cols) in enumerate(zip(sample_rows, sample_cols)):
            count = _frames_of(num_rows, num_cols, sample, image)
            if start + count > pixels.shape[1]:
                raise ValueError(
                    f"sample {sample}: rows {sample_rows} and cols {sample_cols} account for more frames "
                    f"than its {pixels.shape[1]}"
                )
            for frame in range(start, start + count):
                _check_frame(pixels, masks, sample, frame, image)
            cut.append(ProcessorItem(IMAGE, pixels[sample, start : start + count]))
            start += count
        if bool((pixels[sample, start:] != 0).any()):
            raise ValueError(
                f"sample {sample} holds real frames past the {start} its rows {sample_rows} and cols "
                f"{sample_cols} account for"
            )
    return cut


def _frames(pixels: Any, masks: Any) -> list[ProcessorItem]:
    """One item per real frame, sample by sample (where an image ends, nothing says: the full
    processors dropped `rows` and `cols`); all-zero frames are padding, dropped as the model does."""
    cut = []
    for sample in range(pixels.shape[0]):
        for frame in range(pixels.shape[1]):
            if bool((pixels[sample, frame] != 0).any()):
                _check_mask(masks, sample, frame, f"frame {frame}")  # no image to name: no rows, cols
                cut.append(ProcessorItem(IMAGE, pixels[sample, frame : frame + 1]))
    return cut


def _per_sample(value: Any, key: str) -> list[list[int]]:
    """`rows` or `cols`: one list of non-negative whole numbers per sample (ragged where samples
    hold different numbers of images)."""
    samples = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(samples, Sequence) or not all(
        isinstance(sample, Sequence) and all(_is_count(number) for number in sample) for sample in samples
    ):
        raise ValueError(f"{key} must be one list of non-negative whole numbers per sample; got {samples!r}")
    return [[int(number) for number in sample] for sample in samples]


def _frames_of(num_rows: int, num_cols: int, sample: int, image: int) -> int:
    """An image's frames: its rows x cols splits and its global image, or one frame unsplit."""
    if (num_rows == 0) != (num_cols == 0):
        raise ValueError(
            f"sample {sample}, image {image}: rows {num_rows} and cols {num_cols}; an image is split both "
            "ways or not at all"
        )
    return num_rows * num_cols + 1 if num_rows else 1


def _check_frame(pixels: Any, masks: Any, sample: int, frame: int, image: int) -> None:
    if not bool((pixels[sample, frame] != 0).any()):
        raise ValueError(
            f"sample {sample}, frame {frame} (image {image}) is all zeros: the model drops such a frame as "
            "padding, so its image would not get the tokens its prompt holds"
        )
    _check_mask(masks, sample, frame, f"frame {frame} (image {image})")


def _check_mask(masks: Any, sample: int, frame: int, which: str) -> None:
    if masks is not None and not bool((masks[sample, frame] != 0).all()):
        raise ValueError(
            f"sample {sample}, {which}: pixel_attention_mask marks padding inside a real frame; vitpool "
            "runs whole splits only, as the image processor cuts them"
        )


def _is_count(number: Any) -> bool:
    try:
        return not isinstance(number, bool) and int(number) == number and number >= 0
    except (TypeError, ValueError):
        return False
