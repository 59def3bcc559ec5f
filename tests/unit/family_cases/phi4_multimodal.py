"""Phi-4-multimodal (its image path, `Phi4MultimodalImageEmbedding`) under the adapter conformance
suite, and the tiny models the family's own tests share. The model has no `get_image_features`: the
reference is what `model.model.embed_tokens_extend.image_embed` writes at the image token's
positions for the item's image alone, read back from the embeddings it returns (tower, 2 x 2
pooling, HD assembly with sub_GN / glb_GN, projection), with the tower's attention "eager": HF's
bidirectional path (its "sdpa" path runs unpadded calls causally; see the family's tests)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from family_cases.common import randomize
from vitpool import GraphEncoder, Image, Video
from vitpool.specs import ItemSpec

CROP = 28  # pixels a crop side; patches of 2 pixels: 14 x 14 patches, pooled to 7 x 7
PATCH = 2
POOLED = 7
IMAGE_TOKEN, AUDIO_TOKEN = 250, 251
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "image_size": CROP,
    "patch_size": PATCH,
    "crop_size": CROP,
    "feature_layer": -2,
    "image_token_id": IMAGE_TOKEN,
}
# an odd patch side (13): the model reflection-pads the grid by one before pooling
ODD_VISION = {**TINY_VISION, "image_size": 26, "crop_size": 26}
TINY_AUDIO = {
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_blocks": 1,
    "num_attention_heads": 2,
    "ext_pw_out_channel": 32,
    "depthwise_separable_out_channel": 32,
    "nemo_conv_channels": 32,
    "input_size": 16,
    "audio_token_id": AUDIO_TOKEN,
}
TINY_TEXT = {
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ROW_SHAPE = (3, CROP, CROP)
BUDGETS = (128, 256, 512)  # 2, 4 and 10 crops


def full_config(vision: dict[str, Any] = TINY_VISION) -> Any:
    from transformers import Phi4MultimodalConfig

    return Phi4MultimodalConfig(vision_config=dict(vision), audio_config=dict(TINY_AUDIO), **TINY_TEXT)


def hf_model(seed: int = 0, vision: dict[str, Any] = TINY_VISION) -> torch.nn.Module:
    """The full model with unit-scale random image-path weights (the separators too), its tower's
    attention eager (bidirectional)."""
    from transformers import Phi4MultimodalForCausalLM

    model = Phi4MultimodalForCausalLM(full_config(vision))
    randomize(model.model.embed_tokens_extend.image_embed, seed)
    model.model.embed_tokens_extend.image_embed.img_processor.config._attn_implementation = "eager"
    return model.eval().requires_grad_(False)


def encoder_of(model: torch.nn.Module, budgets: Sequence[int]) -> GraphEncoder:
    from vitpool.families.phi4_multimodal.adapter import Phi4MultimodalAdapter

    module = copy.deepcopy(model.model.embed_tokens_extend.image_embed)
    return GraphEncoder(
        Phi4MultimodalAdapter(module), budgets=list(budgets), device="cpu", dtype=torch.float32
    )


def canvas_crops(height: int, width: int, side: int) -> tuple[int, int]:
    """Crop rows and columns of a canvas in pixels, for crops of `side` patches of PATCH pixels."""
    return height // (side * PATCH), width // (side * PATCH)


def crop_masks(layout: Sequence[int], side: int = CROP // PATCH) -> torch.Tensor:
    """`image_attention_mask` of one image [1 + crops, n, n] as the processor makes it: ones on the
    global crop, the canvas' top-left valid_rows x valid_cols patches cut into its crops."""
    height, width, valid_rows, valid_cols = (int(v) for v in layout)
    rows, cols = canvas_crops(height, width, side)
    canvas = torch.zeros(rows * side, cols * side)
    canvas[:valid_rows, :valid_cols] = 1
    crops = canvas.reshape(rows, side, cols, side).transpose(1, 2).reshape(rows * cols, side, side)
    return torch.cat([torch.ones(1, side, side), crops])


def image_embed_rows(
    model: torch.nn.Module, items: Sequence[Any], module: torch.nn.Module | None = None
) -> list[torch.Tensor]:
    """What `image_embed` writes for each item's image when the items are one call's images: the
    processor's batch form (crops padded to the most with zero crops of all-ones masks), a prompt of
    their image tokens with a text token between, the rows read back at each image's positions."""
    image_embed = module if module is not None else model.model.embed_tokens_extend.image_embed
    side = int(image_embed.img_processor.config.image_size) // int(
        image_embed.img_processor.config.patch_size
    )
    pixels = [torch.as_tensor(item.pixel_values).float() for item in items]
    layouts = [full_layout(item.grid_thw, side) for item in items]
    max_crops = max(len(p) for p in pixels)
    batch_pixels = torch.zeros(len(items), max_crops, *pixels[0].shape[1:])
    batch_masks = torch.ones(len(items), max_crops, side, side)
    for index, (item_pixels, layout) in enumerate(zip(pixels, layouts)):
        batch_pixels[index, : len(item_pixels)] = item_pixels
        batch_masks[index, : len(item_pixels)] = crop_masks(layout, side)
    counts = [num_tokens(layout, side) for layout in layouts]
    ids = []
    for count in counts:
        ids += [3] + [IMAGE_TOKEN] * count
    input_ids = torch.tensor([ids + [3]])
    embeds = torch.zeros(1, input_ids.shape[1], image_embed.img_projection_down.out_features)
    with torch.no_grad():
        written = image_embed(
            input_ids,
            embeds,
            image_pixel_values=batch_pixels,
            image_sizes=torch.tensor([layout[:2] for layout in layouts]),
            image_attention_mask=batch_masks,
        )
    rows = written[0, input_ids[0] == IMAGE_TOKEN]
    return list(rows.split(counts))


def full_layout(grid: Any, side: int = CROP // PATCH) -> tuple[int, int, int, int]:
    """(height, width, valid_rows, valid_cols) of an item's layout ((height, width): unpadded)."""
    values = [int(v) for v in grid]
    if len(values) == 2:
        rows, cols = canvas_crops(values[0], values[1], side)
        return (values[0], values[1], rows * side, cols * side)
    return tuple(values)  # type: ignore[return-value]


def num_tokens(layout: Sequence[int], side: int = CROP // PATCH) -> int:
    """The placeholders `image_embed` fills for an image of this layout: the image processor's
    `num_img_tokens` formula with this tower's pooled side b = ceil(side / 2) for the release's 16
    (`image_embed` itself refuses a prompt whose count differs)."""
    height, width, valid_rows, valid_cols = layout
    rows, cols = canvas_crops(height, width, side)
    pooled = (side + 1) // 2
    last_rows, last_cols = valid_rows - side * (rows - 1), valid_cols - side * (cols - 1)
    useful_rows = pooled * (rows - 1) + (last_rows + 1) // 2
    useful_cols = pooled * (cols - 1) + (last_cols + 1) // 2
    return useful_rows * (useful_cols + 1) + 1 + pooled * (pooled + 1)


def image_features(model: torch.nn.Module, item: Any) -> torch.Tensor:
    """What the model hands its LLM for one image alone: [its placeholders, text width]."""
    [rows] = image_embed_rows(model, [item])
    return rows


def _case_fields() -> dict[str, Any]:
    shared: dict[str, torch.nn.Module] = {}

    def model() -> torch.nn.Module:
        if "model" not in shared:
            shared["model"] = hf_model()
        return shared["model"]

    def item_for(spec: ItemSpec, pixels: torch.Tensor) -> Image:
        return Image(pixels, spec.layout)

    bad_items = (
        # no canvas: the processor's image_sizes and mask say it
        (Image(torch.randn(2, *ROW_SHAPE)), "needs its canvas"),
        # a canvas that is no whole number of crops
        (Image(torch.randn(2, *ROW_SHAPE), (CROP + 2, CROP)), "not a whole number"),
        # crops the canvas does not account for (a padding crop kept)
        (Image(torch.randn(3, *ROW_SHAPE), (CROP, CROP)), "a canvas of 1 x 1 crops needs"),
        # a crop holding no image
        (Image(torch.randn(3, *ROW_SHAPE), (CROP, 2 * CROP, 14, 14)), "valid_cols 14"),
        # crops of another size
        (Image(torch.randn(2, 3, CROP, CROP + 2), (CROP, CROP)), "a canvas of 1 x 1 crops needs"),
        (Video(torch.randn(2, *ROW_SHAPE), (CROP, CROP)), "images only"),
    )
    return {
        "make_encoder": lambda budgets: encoder_of(model(), budgets),
        "reference": lambda encoder: lambda item: [image_features(model(), item)],
        "item_for": item_for,
        "bad_items": bad_items,
        "budgets": BUDGETS,
    }


CASE_FIELDS = _case_fields()
