"""PaliGemma's own checks (the shared ones: test_adapter_conformance.py): views in and the LLM's
tokens out as Hugging Face's `get_image_features` hands them over (the projector included, no
scaling), for one image, several images in one call and padded budgets; loading from full
checkpoints of PaliGemma and PaliGemma 2 (whole, sharded, the releases' `vision_tower.vision_model.*`
keys) and tower-only saves; malformed items named by their index; `SiglipImageProcessor`'s and
`PaliGemmaProcessor`'s output cut by `vitpool.items_from`, and batches of other families left to
them; the transformers drop-in. CPU, fp32, tiny random models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import paligemma as case
from safetensors.torch import save_file

import vitpool
from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError
from vitpool.families.paligemma import adapter as paligemma_adapter
from vitpool.families.paligemma import processor as paligemma_processor

TOLERANCE = 1e-4
BUDGETS = [case.TOKENS_PER_VIEW * views for views in (1, 2, 4)]


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model):
    return case.encoder_of(model, BUDGETS)


def views(count: int, seed: int) -> Image:
    """Views [count, 3, S, S] of random pixels: one an image."""
    return Image(torch.randn(count, *case.ROW_SHAPE, generator=torch.Generator().manual_seed(seed)))


def assert_matches(model, items, embeddings) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings, strict=True):
        expected = case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def test_one_image_gives_hugging_faces_tokens(model, encoder):
    item = views(1, 0)
    [embedding] = encoder.encode([item])
    assert embedding.tokens.shape == (case.TOKENS_PER_VIEW, case.TEXT_WIDTH)  # one token a patch
    assert_matches(model, [item], [embedding])


def test_several_images_in_one_call(model, encoder):
    """Images of one view each, and items of several views (a prompt's images stacked): 9 views in
    all, over the largest budget, so the call runs in several batches, one of them eager."""
    counts = (1, 1, 3, 1, 5, 1)  # the 5-view item is over every budget: eager at its own size
    items = [views(count, 10 + seed) for seed, count in enumerate(counts)]
    before = encoder.stats().eager_batches
    embeddings = encoder.encode(items)
    assert [e.tokens.shape[0] for e in embeddings] == [case.TOKENS_PER_VIEW * n for n in counts]
    assert_matches(model, items, embeddings)
    assert encoder.stats().eager_batches == before + 1
    # a prompt's images as one item: the model's tokens for all of them, in order
    with torch.no_grad():
        batch = torch.cat([torch.as_tensor(item.pixel_values) for item in items[:4]])
        whole = model.model.get_image_features(pixel_values=batch).pooler_output
    joined = torch.cat([e.tokens for e in embeddings[:4]])
    assert relative_error(joined, whole.reshape(-1, whole.shape[-1])) <= TOLERANCE


def test_padding_views_of_a_larger_budget_change_nothing(model):
    """One budget of 4 views: a 1-view image runs with 3 padding views, after and before a 4-view
    item filled the same buffers (stale rows must not leak into the next batch)."""
    encoder = case.encoder_of(model, [4 * case.TOKENS_PER_VIEW])
    small, large = views(1, 20), views(4, 21)
    first = encoder.encode([small])
    assert_matches(model, [large, small], encoder.encode([large]) + encoder.encode([small]))
    assert torch.equal(encoder.encode([small])[0].tokens, first[0].tokens)
    assert encoder.stats().replays_per_budget[4 * case.TOKENS_PER_VIEW] == 4


def test_malformed_items_are_named_by_their_index_and_the_others_still_encode(model, encoder):
    good = views(1, 40)
    malformed = (
        (Image(torch.randn(1, 3, case.VIEW - 8, case.VIEW - 8)), "must be tiles"),  # another view size
        (Image(torch.randn(1, 3 * case.VIEW * case.VIEW)), "must be tiles"),  # flattened
        (Image(torch.randn(1, *case.ROW_SHAPE), (1, 8, 8)), "no grid"),  # a patch family's grid
        (Image(torch.randn(0, *case.ROW_SHAPE)), "no tiles"),
    )
    for index, (bad, words) in enumerate(malformed, start=1):
        items = [good] * index + [bad, good]
        with pytest.raises(InvalidItemError) as raised:
            encoder.encode(items)
        assert raised.value.index == index and words in str(raised.value)
    assert_matches(model, [good], encoder.encode([good]))


def test_default_budgets_are_whole_views(encoder):
    defaults = GraphEncoder(encoder.adapter, device="cpu", dtype=torch.float32)
    tokens = [budget.num_tokens for budget in defaults.budgets]
    assert tokens[0] == case.TOKENS_PER_VIEW
    assert tokens[-1] == paligemma_adapter.MAX_GRAPH_VIEWS * case.TOKENS_PER_VIEW
    assert all(value % case.TOKENS_PER_VIEW == 0 for value in tokens)
    # the releases' views (patches of 14 pixels): 224², 448², 896²
    assert [paligemma_adapter.graph_views((side // 14) ** 2) for side in (224, 448, 896)] == [16, 16, 4]


# ---- checkpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["gemma", "gemma2"], ids=["paligemma", "paligemma2"])
@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(tmp_path, text, max_shard_size):
    model = case.hf_model(seed=5, text=text)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(set(weight_map.values())) > 2  # the vision weights span several shards
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert isinstance(encoder.adapter, paligemma_adapter.PaliGemmaAdapter)  # not Gemma 3's, by model_type
    items = [views(2, 30), views(1, 31)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_the_releases_layout(model, tmp_path):
    """google/paligemma*'s safetensors keep SigLIP one level down (`vision_tower.vision_model.*`)
    and the LLM under `language_model.model.*`."""
    state = {
        f"vision_tower.vision_model.{key}": value.contiguous()
        for key, value in model.model.vision_tower.state_dict().items()
    }
    state.update(
        {
            f"multi_modal_projector.{key}": value.contiguous()
            for key, value in model.model.multi_modal_projector.state_dict().items()
        }
    )
    state["language_model.model.embed_tokens.weight"] = torch.zeros(4, 4)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [views(1, 32), views(1, 33)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_a_tower_only_save_and_refuses_missing_weights(model, encoder, tmp_path):
    config = paligemma_adapter.tower_only_config(model.config)
    assert config.model_type == "paligemma_vision" and config.projection_dim == case.TEXT_WIDTH
    config.save_pretrained(tmp_path)
    state = {key: value.contiguous() for key, value in encoder.adapter.tower.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [views(2, 34)]
    assert_matches(model, items, loaded.encode(items))
    del state["multi_modal_projector.linear.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys.*multi_modal_projector\.linear\.weight"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


def test_a_vision_config_without_the_projectors_width_is_refused():
    from transformers import SiglipVisionConfig

    plain = SiglipVisionConfig(**{k: v for k, v in case.TINY_VISION.items() if k != "model_type"})
    with pytest.raises(ValueError, match=r"a PaliGemma vision config needs \['projection_dim'\]"):
        paligemma_adapter.build_encoder(plain)
    with pytest.raises(CheckpointError, match="'gemma3' checkpoint: vitpool's paligemma family"):
        paligemma_adapter.tower_only_config(type("Other", (), {"model_type": "gemma3"})())


# ---- vitpool.items_from -------------------------------------------------------------------------


def image_processor():
    """PaliGemma's image processor at the tiny view size, with the releases' other settings (the
    PIL backend of `SiglipImageProcessor`, which falls back to it without torchvision)."""
    from transformers import SiglipImageProcessorPil

    processor = SiglipImageProcessorPil(
        size={"height": case.VIEW, "width": case.VIEW},
        resample=3,  # bicubic
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    processor.image_seq_length = case.TOKENS_PER_VIEW  # what PaliGemmaProcessor reads of it
    return processor


def random_images(sizes, seed: int) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def assert_cut_as_the_model_runs(model, encoder, processor, images, batch) -> None:
    """`items_from(batch)` (no family named): one item an image, each what the image processor
    gives that image alone, encoding to the model's tokens for the whole batch, split by image."""
    items = vitpool.items_from(batch)
    assert [type(item) for item in items] == [Image] * len(images)
    for item, image in zip(items, images, strict=True):
        alone = processor(images=[image], return_tensors="pt")
        assert torch.equal(torch.as_tensor(item.pixel_values), alone["pixel_values"])
    with torch.no_grad():
        wanted = model.model.get_image_features(pixel_values=batch["pixel_values"]).pooler_output
    for embedding, want in zip(encoder.encode(items), wanted, strict=True):
        assert embedding.tokens.shape == want.shape
        assert relative_error(embedding.tokens, want) <= TOLERANCE


def test_items_from_the_image_processors_output_encode_as_hugging_face(model, encoder):
    pytest.importorskip("PIL")
    processor = image_processor()
    images = random_images(((40, 100), (48, 48), (60, 30)), seed=0)
    batch = processor(images=images, return_tensors="pt")
    assert set(batch) == {"pixel_values"}
    assert_cut_as_the_model_runs(model, encoder, processor, images, batch)
    as_arrays = vitpool.items_from(dict(processor(images=images, return_tensors="np")), family="paligemma")
    assert isinstance(as_arrays[0].pixel_values, np.ndarray) and as_arrays[0].pixel_values.shape == (
        1,
        *case.ROW_SHAPE,
    )


def tiny_tokenizer():
    """A character-level tokenizer with the special tokens PaliGemmaProcessor reads (bos, eos);
    the processor adds its image token and its location and segmentation tokens. No download."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<bos>": 2, "<eos>": 3, **{chr(c): c - 28 for c in range(32, 127)}}
    backend = Tokenizer(models.WordLevel({**vocab, "\n": len(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def test_items_from_the_full_processors_output_and_a_prompt_without_its_labels(model, encoder):
    """PaliGemmaProcessor's output (two prompts, of two images and one) is found by its keys:
    `labels` comes with its prompt; without them the keys are Gemma3Processor's too."""
    pytest.importorskip("PIL")
    from transformers import PaliGemmaProcessor

    processor = PaliGemmaProcessor(image_processor=image_processor(), tokenizer=tiny_tokenizer())
    images = random_images(((40, 100), (48, 48), (60, 30)), seed=1)
    out = processor(
        images=[images[:2], images[2:]],
        text=["<image><image>ab", "<image>c"],
        return_tensors="pt",
        padding=True,
    )
    assert "labels" in out and out["pixel_values"].shape[0] == 3
    assert_cut_as_the_model_runs(model, encoder, processor.image_processor, images, out)
    without_labels = {key: value for key, value in out.items() if key != "labels"}
    with pytest.raises(ValueError, match="are no family's processor output"):
        vitpool.items_from(without_labels)
    with pytest.raises(ValueError, match="without labels, which PaliGemmaProcessor returns"):
        vitpool.items_from(without_labels, family="paligemma")


def test_other_families_batches_stay_theirs_and_what_does_not_add_up_is_named():
    pixels = torch.randn(3, *case.ROW_SHAPE)
    # pixels alone: PaliGemma's, one item an image
    assert [item.pixel_values.shape[0] for item in vitpool.items_from({"pixel_values": pixels})] == [1, 1, 1]
    # Gemma 3's image processor output: its num_crops say where an image ends
    [gemma3_item] = vitpool.items_from({"pixel_values": pixels, "num_crops": torch.tensor([2])})
    assert gemma3_item.pixel_values.shape[0] == 3
    # Gemma3Processor's output (it drops num_crops): not cut as PaliGemma's one view an image
    gemma3_processor = {
        "pixel_values": pixels,
        "input_ids": torch.zeros(1, 5, dtype=torch.long),
        "attention_mask": torch.ones(1, 5, dtype=torch.long),
        "token_type_ids": torch.zeros(1, 5, dtype=torch.long),
    }
    with pytest.raises(ValueError, match="are no family's processor output"):
        vitpool.items_from(gemma3_processor)
    # named, it is Gemma 3's: a view an item (test_full_processor_outputs.py)
    assert len(vitpool.items_from(gemma3_processor, family="gemma3")) == len(pixels)
    # another family's keys, named with the family
    with pytest.raises(ValueError, match=r"num_crops \(gemma3\).*pass that family's name"):
        vitpool.items_from({"pixel_values": pixels, "num_crops": torch.tensor([2])}, family="paligemma")
    assert paligemma_processor.other_families_keys(["pixel_values", "input_ids", "labels"]) == {}
    with pytest.raises(ValueError, match="one view an image"):
        vitpool.items_from({"pixel_values": pixels[None]}, family="paligemma")
    with pytest.raises(ValueError, match="return_tensors='pt'"):
        vitpool.items_from({"pixel_values": list(pixels)}, family="paligemma")
    with pytest.raises(ValueError, match="takes images only"):
        vitpool.items_from({"pixel_values": pixels, "pixel_values_videos": pixels}, family="paligemma")


# ---- the transformers drop-in -------------------------------------------------------------------


def test_the_drop_in_answers_get_image_features_and_the_models_forward(model):
    """`replace_vision_tower`: the model's own `get_image_features`, and its forward over a prompt
    of two images, answer through a GraphEncoder over its own vision weights; `restore_vision_tower`
    puts the modules back."""
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    pixel_values = views(2, 50).pixel_values
    prompt = [case.IMAGE_TOKEN_ID] * (2 * case.TOKENS_PER_VIEW) + [2, 5, 7]
    inputs = {"input_ids": torch.tensor([prompt]), "pixel_values": pixel_values}
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=pixel_values).pooler_output
        want_logits = model(**inputs).logits
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    try:
        with torch.no_grad():
            got = model.model.get_image_features(pixel_values=pixel_values).pooler_output
            got_logits = model(**inputs).logits
    finally:
        restore_vision_tower(model, original)
    assert model.model.vision_tower is tower and model.model.multi_modal_projector is projector
    assert got.shape == want.shape
    assert relative_error(got, want) <= TOLERANCE
    assert relative_error(got_logits, want_logits) <= TOLERANCE
