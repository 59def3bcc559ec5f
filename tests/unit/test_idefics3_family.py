"""Idefics3's and SmolVLM's own checks (the shared ones: test_adapter_conformance.py): splits in and
the LLM's tokens out as Hugging Face's `get_image_features` hands them over, for one image, several
images of different split counts in one call (and in one padded processor batch), padded budgets;
the position ids of a full split; loading from full checkpoints (whole and sharded) and tower-only
saves; a malformed item; the real image processor's output (every real split full) cut by
`vitpool.items_from`; the transformers drop-in. CPU, fp32, tiny random models, both kinds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import idefics3 as case
from safetensors.torch import save_file

import vitpool
from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError
from vitpool.families.idefics3 import adapter as idefics3_adapter
from vitpool.families.idefics3.processor import items as cut_items

TOLERANCE = 1e-4
BUDGETS = [case.TOKENS_PER_TILE * splits for splits in (1, 2, 4)]
KINDS = sorted(case.KINDS)
# per kind: the image processor class, sized for the tiny tower (splits of its image_size, up to
# two a side)
PROCESSORS = {"idefics3": "Idefics3ImageProcessorPil", "smolvlm": "SmolVLMImageProcessorPil"}
# (height, width) of the images the processor tests cut: a tall one (2 x 2 splits), a wide one
# (1 x 2) and a square one (2 x 2), each with its global image
SIZES = ((20, 12), (6, 30), (9, 9))


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(kind):
    return case.hf_model(seed=3, kind=kind)


@pytest.fixture(scope="module")
def encoder(model):
    return case.encoder_of(model, BUDGETS)


def splits(kind: str, count: int, seed: int) -> Image:
    """One image's splits [count, 3, S, S] of random pixels."""
    return Image(torch.randn(count, *case.row_shape(kind), generator=torch.Generator().manual_seed(seed)))


def assert_matches(model, items, embeddings) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings, strict=True):
        expected = case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def test_one_image_gives_hugging_faces_tokens(kind, model, encoder):
    item = splits(kind, 1, 0)
    [embedding] = encoder.encode([item])
    assert embedding.tokens.shape == (case.TOKENS_PER_TILE, case.TINY_TEXT["hidden_size"])
    assert_matches(model, [item], [embedding])


def test_images_of_several_split_counts_in_one_call(kind, model, encoder):
    counts = (1, 3, 2, 1, 5)  # 5 splits (a 2 x 2 image and its global one): over every budget, run eager
    items = [splits(kind, count, 10 + seed) for seed, count in enumerate(counts)]
    before = encoder.stats().eager_batches
    embeddings = encoder.encode(items)
    assert [e.tokens.shape[0] for e in embeddings] == [case.TOKENS_PER_TILE * n for n in counts]
    assert_matches(model, items, embeddings)
    assert encoder.stats().eager_batches == before + 1


def test_a_padded_processor_batch_gives_each_samples_tokens(kind, model, encoder):
    """Hugging Face's batch form: [samples, frames, 3, S, S], the shorter sample padded with all-zero
    frames that the model drops; each sample's tokens are its images' tokens in order."""
    images = [[splits(kind, 3, 20), splits(kind, 1, 21)], [splits(kind, 5, 22)]]
    frames = [torch.cat([item.pixel_values for item in sample]) for sample in images]
    pixel_values = torch.zeros(len(frames), max(len(f) for f in frames), *case.row_shape(kind))
    for index, sample_frames in enumerate(frames):
        pixel_values[index, : len(sample_frames)] = sample_frames
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=pixel_values).pooler_output
    embeddings = encoder.encode([item for sample in images for item in sample])
    got = [torch.cat([e.tokens for e in embeddings[:2]]), embeddings[2].tokens]
    for got_sample, want_sample in zip(got, want, strict=True):
        assert got_sample.shape == want_sample.shape
        assert relative_error(got_sample, want_sample) <= TOLERANCE


def test_padding_splits_of_a_larger_budget_change_nothing(kind, model):
    """One budget of 4 splits: a 1-split image runs with 3 padding splits, after and before a
    4-split image filled the same buffers (stale rows must not leak into the next batch)."""
    encoder = case.encoder_of(model, [4 * case.TOKENS_PER_TILE])
    small, large = splits(kind, 1, 30), splits(kind, 4, 31)
    first = encoder.encode([small])
    assert_matches(model, [large, small], encoder.encode([large]) + encoder.encode([small]))
    assert torch.equal(encoder.encode([small])[0].tokens, first[0].tokens)
    assert encoder.stats().replays_per_budget[4 * case.TOKENS_PER_TILE] == 4


@pytest.mark.parametrize(("image_size", "patch_size"), [(364, 14), (384, 14), (512, 16), (8, 2)])
def test_a_full_splits_position_ids_are_the_models(image_size, patch_size):
    """The ids the adapter keeps are those Idefics3VisionEmbeddings computes for a full split (the
    releases' 26, 27 and 32 patches a side): read back through a one-wide position table holding
    each row's index."""
    from transformers import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    side = image_size // patch_size
    config = Idefics3VisionConfig(hidden_size=1, image_size=image_size, patch_size=patch_size)
    embeddings = Idefics3VisionEmbeddings(config)
    with torch.no_grad():
        embeddings.patch_embedding.weight.zero_()
        embeddings.patch_embedding.bias.zero_()
        embeddings.position_embedding.weight.copy_(torch.arange(side * side, dtype=torch.float32)[:, None])
        read = embeddings(
            torch.zeros(1, 3, image_size, image_size), torch.ones(1, side, side, dtype=torch.bool)
        )
    assert torch.equal(idefics3_adapter.split_position_ids(side), read[0, :, 0].long())


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(kind, model, tmp_path, max_shard_size):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(set(weight_map.values())) > 2  # the vision weights span several shards
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert type(encoder.adapter.tower.vision_model) is type(
        model.model.vision_model
    )  # SmolVLM's classes for SmolVLM
    items = [splits(kind, 2, 40), splits(kind, 1, 41)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_a_tower_only_save_and_refuses_missing_weights(kind, model, encoder, tmp_path):
    idefics3_adapter.tower_only_config(model.config).save_pretrained(tmp_path)
    state = {key: value.contiguous() for key, value in encoder.adapter.tower.state_dict().items()}
    assert not any("position_ids" in key for key in state)  # the split's ids are not saved
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [splits(kind, 3, 42)]
    assert_matches(model, items, loaded.encode(items))
    del state["connector.modality_projection.proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys.*connector.modality_projection.proj.weight"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


def test_a_vision_config_without_the_connectors_fields_is_refused(model):
    with pytest.raises(ValueError, match="text_hidden_size.*scale_factor"):
        idefics3_adapter.build_encoder(model.config.vision_config)


def test_a_scale_factor_that_does_not_divide_the_patch_grid_is_refused():
    config = case.full_config("idefics3")
    config.scale_factor = 3  # 4 x 4 patches a split
    with pytest.raises(ValueError, match="scale_factor 3"):
        idefics3_adapter.Idefics3Adapter(idefics3_adapter.build_encoder(config))


def test_default_budgets_are_whole_splits(model, encoder):
    default = GraphEncoder(encoder.adapter, device="cpu", dtype=torch.float32)
    tokens = [budget.num_tokens for budget in default.budgets]
    assert tokens[0] == case.TOKENS_PER_TILE
    assert tokens[-1] == idefics3_adapter.MAX_GRAPH_TILES * case.TOKENS_PER_TILE
    assert all(value % case.TOKENS_PER_TILE == 0 for value in tokens)


def test_a_malformed_item_is_named_and_the_others_still_encode(kind, model, encoder):
    good = splits(kind, 2, 50)
    side = case.row_shape(kind)[-1]
    bad_items = (
        # splits of another size (a processor whose max_image_size is not the tower's image_size)
        (Image(torch.randn(2, 3, side + 2, side + 2)), "image_size"),
        (Image(torch.randn(2, 3, side, side + 2)), "must be tiles"),
        # the processor's batch form: pass one image's splits, not the samples
        (Image(torch.randn(1, 2, 3, side, side)), "must be tiles"),
        (Image(torch.randn(2, 3, side, side), (1, 2, 2)), "no grid"),
    )
    for bad, words in bad_items:
        with pytest.raises(InvalidItemError) as raised:
            encoder.encode([good, bad])
        assert raised.value.index == 1 and words in str(raised.value)
    assert_matches(model, [good], encoder.encode([good]))


# ---- the real image processor and items_from -------------------------------------------------


def image_processor(kind: str, **kwargs):
    import transformers

    split = case.row_shape(kind)[-1]
    return getattr(transformers, PROCESSORS[kind])(
        size={"longest_edge": 2 * split}, max_image_size={"longest_edge": split}, **kwargs
    )


def random_images(sizes, seed: int = 0) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.mark.parametrize("splitting", [True, False], ids=["split", "unsplit"])
def test_every_real_frame_the_processor_emits_is_a_full_split(kind, splitting):
    """What lets the graph run without a mask: resized to whole splits (or to one split), every real
    frame is S x S with an all-ones mask, and the padding is whole all-zero frames, masked out."""
    pytest.importorskip("PIL")
    processor = image_processor(kind, do_image_splitting=splitting)
    images = random_images(((20, 12), (6, 30), (9, 9), (3, 41), (17, 16)), seed=1)
    out = processor(
        images=[images[:1], images[1:3], images[3:]], return_tensors="pt", return_row_col_info=True
    )
    pixels, masks = out["pixel_values"], out["pixel_attention_mask"]
    assert tuple(pixels.shape[-2:]) == case.row_shape(kind)[-2:]
    for sample, (rows, cols) in enumerate(zip(out["rows"], out["cols"], strict=True)):
        real = sum(r * c + 1 if r else 1 for r, c in zip(rows, cols))
        assert bool(masks[sample, :real].all()) and not bool(masks[sample, real:].any())
        assert not bool(pixels[sample, real:].any()) and all(
            bool(frame.any()) for frame in pixels[sample, :real]
        )
    assert out["pixel_values"].shape[1] > 1 if splitting else max(map(len, out["rows"])) == 2


@pytest.mark.parametrize("nested", [False, True], ids=["one_sample", "two_samples"])
def test_items_from_the_processor_are_the_images_alone_and_encode_as_hugging_face(
    kind, model, encoder, nested
):
    pytest.importorskip("PIL")
    processor = image_processor(kind)
    images = random_images(SIZES, seed=2)
    samples = [images[:1], images[1:]] if nested else [images]  # a flat list is one sample
    batch = processor(images=samples, return_tensors="pt", return_row_col_info=True)
    items = vitpool.items_from(batch)  # the keys alone tell the family
    assert [type(item) for item in items] == [Image] * len(images)
    for item, image in zip(items, images, strict=True):  # each as the processor makes it for that image alone
        alone = processor(images=[image], return_tensors="pt")["pixel_values"][0]
        assert torch.equal(torch.as_tensor(item.pixel_values), alone)
    assert [len(item.pixel_values) for item in items] == [5, 3, 5]
    embeddings = encoder.encode(items)
    with torch.no_grad():
        want = model.model.get_image_features(
            pixel_values=batch["pixel_values"], pixel_attention_mask=batch["pixel_attention_mask"]
        ).pooler_output
    per_sample = [embeddings[:1], embeddings[1:]] if nested else [embeddings]
    for sample_embeddings, want_sample in zip(per_sample, want, strict=True):
        assert relative_error(torch.cat([e.tokens for e in sample_embeddings]), want_sample) <= TOLERANCE


def test_items_from_numpy_output_without_splitting(kind):
    pytest.importorskip("PIL")
    processor = image_processor(kind, do_image_splitting=False)
    images = random_images(SIZES, seed=3)
    batch = processor(images=images, return_tensors="np", return_row_col_info=True)
    items = vitpool.items_from(batch, family="smolvlm")  # named by a model_type: the same family
    assert [np.asarray(item.pixel_values).shape for item in items] == [(1, *case.row_shape(kind))] * 3
    assert np.array_equal(np.concatenate([item.pixel_values for item in items]), batch["pixel_values"][0])


def _batch(**changes):
    """A hand-made batch of two samples: (2 x 1 splits + global, unsplit) and (unsplit), padded."""
    side = 4
    pixels = torch.zeros(2, 4, 3, side, side)
    pixels[0] = torch.rand(4, 3, side, side) + 0.1
    pixels[1, 0] = torch.rand(3, side, side) + 0.1
    masks = torch.zeros(2, 4, side, side, dtype=torch.int64)
    masks[0] = 1
    masks[1, 0] = 1
    batch = {
        "pixel_values": pixels,
        "pixel_attention_mask": masks,
        "rows": [[2, 0], [0]],
        "cols": [[1, 0], [0]],
    }
    batch.update(changes)
    return {key: value for key, value in batch.items() if value is not None}


def test_the_cutter_cuts_by_rows_and_cols():
    batch = _batch()
    cut = cut_items(batch)
    assert [len(item.pixel_values) for item in cut] == [3, 1, 1]
    assert torch.equal(cut[1].pixel_values, batch["pixel_values"][0, 3:4])
    assert torch.equal(cut[2].pixel_values, batch["pixel_values"][1, :1])


def _with_frame(sample: int, frame: int, value: float) -> torch.Tensor:
    pixels = _batch()["pixel_values"].clone()
    pixels[sample, frame] = value
    return pixels


def _partial_mask() -> torch.Tensor:
    masks = _batch()["pixel_attention_mask"].clone()
    masks[0, 1, -1] = 0
    return masks


# (changes to the batch, words of the ValueError)
BAD_BATCHES = [
    # the full processor's output: rows and cols dropped
    ({"rows": None}, "return_row_col_info=True"),
    ({"cols": None}, "return_row_col_info=True"),
    # counts that are not per sample, not whole numbers, or that do not add up
    ({"rows": [[2, 0]], "cols": [[1, 0]]}, "holds 2 samples"),
    ({"rows": [[2, 0], [0]], "cols": [[1], [0]]}, "count different images"),
    ({"rows": [[2.5, 0], [0]]}, "non-negative whole numbers"),
    ({"rows": [[2, 1], [0]], "cols": [[1, 0], [0]]}, "split both ways or not at all"),
    ({"rows": [[2, 0], [2]], "cols": [[1, 0], [2]]}, "account for more frames"),
    # a real frame past the images', an all-zero frame inside an image, a partly masked frame
    ({"rows": [[2], [0]], "cols": [[1], [0]]}, "real frames past the 3"),
    ({"pixel_values": _with_frame(0, 1, 0.0)}, "all zeros"),
    ({"pixel_attention_mask": _partial_mask()}, "marks padding inside a real frame"),
    # not the processor's [samples, frames, ...] pixel values; videos
    ({"pixel_values": torch.rand(4, 3, 4, 4)}, "[samples, frames"),
]


@pytest.mark.parametrize(("changes", "words"), BAD_BATCHES)
def test_the_cutter_names_what_does_not_add_up(changes, words):
    with pytest.raises(ValueError) as raised:
        cut_items(_batch(**changes))
    assert words in str(raised.value)


def test_videos_are_refused_before_the_cutter():
    with pytest.raises(ValueError, match="images only"):
        vitpool.items_from(_batch(pixel_values_videos=torch.rand(1, 2, 3, 4, 4)), family="idefics3")


def test_the_full_processors_output_without_rows_and_cols_is_cut_frame_by_frame(kind, model, encoder):
    """Idefics3Processor and SmolVLMProcessor drop rows and cols, keeping the mask: found without
    family=, each real frame one item, and their tokens joined are the model's own for the batch
    (it drops the all-zero padding frames and encodes each frame alone)."""
    pytest.importorskip("PIL")
    processor = image_processor(kind)
    images = random_images(SIZES, seed=5)
    batch = dict(processor(images=[images[:1], images[1:]], return_tensors="pt"))  # two samples, padded
    batch["input_ids"] = torch.zeros(2, 3, dtype=torch.long)  # what the full processor adds
    batch["attention_mask"] = torch.ones(2, 3, dtype=torch.long)
    items = vitpool.items_from(batch)
    real = (batch["pixel_values"] != 0).flatten(2).any(dim=2)  # [samples, frames]
    assert len(items) == int(real.sum()) and all(len(item.pixel_values) == 1 for item in items)
    embeddings = encoder.encode(items)
    with torch.no_grad():
        want = model.model.get_image_features(
            pixel_values=batch["pixel_values"], pixel_attention_mask=batch["pixel_attention_mask"]
        ).pooler_output
    want = torch.cat([sample.reshape(-1, sample.shape[-1]) for sample in want])
    assert relative_error(torch.cat([e.tokens for e in embeddings]), want) <= TOLERANCE
    with pytest.raises(ValueError, match=r"(lacks|no) cols"):  # one of the two alone is a mistake
        vitpool.items_from({**batch, "rows": [[0]] * 2}, family="idefics3")


# ---- the transformers drop-in -----------------------------------------------------------------


def test_the_drop_in_answers_get_image_features_through_vitpool(kind, model, encoder):
    """`replace_vision_tower(model, encoder)`: the model's own `get_image_features` on a padded batch
    answers through vitpool, sample by sample, as its tower and connector did; then put back."""
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    pixel_values = torch.zeros(2, 5, *case.row_shape(kind))
    pixel_values[0] = splits(kind, 5, 60).pixel_values
    pixel_values[1, :2] = splits(kind, 2, 61).pixel_values
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=pixel_values).pooler_output
    vision_model, connector = model.model.vision_model, model.model.connector
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    try:
        with torch.no_grad():
            got = model.model.get_image_features(pixel_values=pixel_values).pooler_output
    finally:
        restore_vision_tower(model, original)
    assert model.model.vision_model is vision_model and model.model.connector is connector
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    for got_sample, want_sample in zip(got, want, strict=True):
        assert relative_error(got_sample, want_sample) <= TOLERANCE
