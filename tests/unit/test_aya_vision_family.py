"""Aya Vision's own checks (the shared ones: test_adapter_conformance.py): tiles in and the LLM's
tokens out as Hugging Face's `get_image_features` hands them over (projector included), for one image,
several images of unlike tile counts in one call, padded budgets, an earlier `vision_feature_layer`;
what is refused (malformed items by their index, settings the model cannot run); loading from
tower-only saves, full saves (whole and sharded) and transformers 4.x's layout; the real image
processor's output cut by `vitpool.items_from`; the transformers drop-in. CPU, fp32, tiny random model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import aya_vision as case
from family_cases import internvl as internvl_case
from safetensors.torch import save_file

import vitpool
from vitpool import CheckpointError, ConfigError, GraphEncoder, Image, InvalidItemError
from vitpool.families.aya_vision import RECORD
from vitpool.families.aya_vision import adapter as aya_adapter

TOLERANCE = 1e-4
BUDGETS = [case.TOKENS_PER_TILE * tiles for tiles in (1, 2, 4)]
FULL_TYPE, SIGLIP = "aya_vision", "siglip_vision_model"  # a full checkpoint's model_type and its tower's
FAMILY = RECORD.towers[aya_adapter.TOWER_MODEL_TYPE]


@pytest.fixture(scope="module")
def model():
    return case.hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model):
    return case.encoder_of(model, BUDGETS)


def tiles(count: int, seed: int) -> Image:
    """One image's tiles [count, 3, S, S] of random pixels."""
    return Image(torch.randn(count, *case.ROW_SHAPE, generator=torch.Generator().manual_seed(seed)))


def assert_matches(model, items, embeddings) -> None:
    assert len(embeddings) == len(items)
    for item, embedding in zip(items, embeddings, strict=True):
        expected = case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


# ---- encoding ---------------------------------------------------------------------------------


def test_one_image_gives_hugging_faces_tokens(model, encoder):
    item = tiles(1, 0)
    [embedding] = encoder.encode([item])
    assert embedding.tokens.shape == (case.TOKENS_PER_TILE, case.TINY_TEXT["hidden_size"])
    assert_matches(model, [item], [embedding])


def test_images_of_several_tile_counts_in_one_call(model, encoder):
    counts = (1, 3, 2, 1, 5)  # 5 tiles (4 crops and a thumbnail): over every budget, run eager
    items = [tiles(count, 10 + seed) for seed, count in enumerate(counts)]
    before = encoder.stats().eager_batches
    embeddings = encoder.encode(items)
    assert [e.tokens.shape[0] for e in embeddings] == [case.TOKENS_PER_TILE * n for n in counts]
    assert_matches(model, items, embeddings)
    assert encoder.stats().eager_batches == before + 1
    # the model's own call over every tile of the batch, cut where each image ends
    pixels = torch.cat([item.pixel_values for item in items])
    with torch.no_grad():
        batch = model.model.get_image_features(pixel_values=pixels).pooler_output
    for embedding, want in zip(embeddings, batch.split(list(counts)), strict=True):
        assert relative_error(embedding.tokens, want.reshape(-1, want.shape[-1])) <= TOLERANCE


def test_padding_tiles_of_a_larger_budget_change_nothing(model):
    """One budget of 4 tiles: a 1-tile image runs with 3 padding tiles, after and before a 4-tile
    image filled the same buffers (stale rows must not leak into the next batch)."""
    encoder = case.encoder_of(model, [4 * case.TOKENS_PER_TILE])
    small, large = tiles(1, 30), tiles(4, 31)
    first = encoder.encode([small])
    assert_matches(model, [large, small], encoder.encode([large]) + encoder.encode([small]))
    assert torch.equal(encoder.encode([small])[0].tokens, first[0].tokens)


@pytest.mark.parametrize("layer", [-2, -4, 1])  # -4: the embeddings of the 3-layer tower
def test_an_earlier_feature_layer_runs_only_the_layers_up_to_it(layer):
    model = case.hf_model(seed=5, vision_feature_layer=layer)
    encoder = case.encoder_of(model, BUDGETS)
    layers = encoder.adapter.tower.vision_tower.encoder.layers
    ran = []
    hooks = [block.register_forward_hook(lambda *_, i=i: ran.append(i)) for i, block in enumerate(layers)]
    try:
        items = [tiles(2, 40), tiles(1, 41)]
        embeddings = encoder.encode(items)
    finally:
        for hook in hooks:
            hook.remove()
    assert set(ran) == set(range(layer % 4))  # the layers past the one read are not run
    assert_matches(model, items, embeddings)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"vision_feature_layer": [-1, -2]}, "must be one layer"),
        ({"vision_feature_layer": -5}, "outside the tower's 3 layers"),
        ({"vision_feature_select_strategy": "default"}, "vision_feature_select_strategy='full'"),
    ],
)
def test_a_feature_selection_the_model_cannot_run_is_refused(changes, words):
    config = case.full_config(**changes)
    with pytest.raises(ConfigError, match=words):
        aya_adapter.AyaVisionAdapter(aya_adapter.build_encoder(config))


def test_tiles_the_projector_cannot_shuffle_are_refused():
    config = case.full_config(downsample_factor=3)  # 4 x 4 patches a tile
    with pytest.raises(ValueError, match="downsample_factor 3 does not divide"):
        aya_adapter.AyaVisionAdapter(aya_adapter.build_encoder(config))


def test_default_budgets_are_whole_tiles(encoder):
    default = GraphEncoder(encoder.adapter, device="cpu", dtype=torch.float32)
    tokens = [budget.num_tokens for budget in default.budgets]
    assert tokens[0] == case.TOKENS_PER_TILE
    assert tokens[-1] == aya_adapter.MAX_GRAPH_TILES * case.TOKENS_PER_TILE
    assert all(value % case.TOKENS_PER_TILE == 0 for value in tokens)


def test_malformed_items_are_named_by_their_index_and_the_others_still_encode(model, encoder):
    good = tiles(2, 50)
    bad_items = (
        # tiles of another size (a processor whose size is not the tower's image_size)
        (Image(torch.randn(2, 3, case.TILE + 2, case.TILE + 2)), "image_size"),
        (Image(torch.randn(2, 3, case.TILE, case.TILE + 2)), "must be tiles"),
        (Image(torch.randn(1, 2, 3, case.TILE, case.TILE)), "must be tiles"),  # a batch of images
        (Image(torch.randn(0, *case.ROW_SHAPE)), "no tiles"),
        (Image(torch.randn(2, *case.ROW_SHAPE), (1, 2, 2)), "no grid"),
    )
    for position in (1, 2):
        for bad, words in bad_items:
            batch = [good, good]
            batch.insert(position, bad)
            with pytest.raises(InvalidItemError) as raised:
                encoder.encode(batch)
            assert raised.value.index == position and words in str(raised.value)
    assert_matches(model, [good], encoder.encode([good]))


# ---- loading ----------------------------------------------------------------------------------


def test_loads_a_tower_only_save_and_refuses_missing_weights(model, encoder, tmp_path):
    config = aya_adapter.tower_only_config(model.config)
    assert config.model_type == aya_adapter.TOWER_MODEL_TYPE  # not SigLIP's own, Gemma 3's family's
    config.save_pretrained(tmp_path)
    state = {key: value.contiguous() for key, value in encoder.adapter.tower.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [tiles(3, 60), tiles(1, 61)]
    assert_matches(model, items, loaded.encode(items))
    del state["multi_modal_projector.layernorm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys.*multi_modal_projector.layernorm.weight"):
        GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu")


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(model, tmp_path, max_shard_size):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        text = ("model.language_model", "lm_head")
        vision_shards = {shard for key, shard in weight_map.items() if not key.startswith(text)}
        assert len(vision_shards) > 2  # the vision weights span several shards
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    assert isinstance(encoder.adapter, aya_adapter.AyaVisionAdapter)
    items = [tiles(2, 70), tiles(5, 71)]
    assert_matches(model, items, encoder.encode(items))


def test_loads_transformers_4_layout(model, tmp_path):
    """Keys as transformers 4.x saved them before the `model.` level: the tower under
    `vision_tower.vision_model.`, the projector under `multi_modal_projector.`, the LLM beside them."""
    model.config.save_pretrained(tmp_path)
    state = {f"vision_tower.vision_model.{k}": v for k, v in model.model.vision_tower.state_dict().items()}
    state.update(
        {f"multi_modal_projector.{k}": v for k, v in model.model.multi_modal_projector.state_dict().items()}
    )
    state["language_model.model.embed_tokens.weight"] = torch.zeros(case.TINY_TEXT["vocab_size"], 48)
    save_file({key: value.contiguous() for key, value in state.items()}, str(tmp_path / "model.safetensors"))
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.float32)
    items = [tiles(3, 72)]
    assert_matches(model, items, encoder.encode(items))


def test_the_registry_gives_a_full_checkpoint_its_own_family():
    from vitpool.models.registry import tower_family

    assert tower_family(FULL_TYPE, SIGLIP) is FAMILY


def test_a_bare_siglip_save_stays_gemma_3s():
    from vitpool.models.registry import FAMILIES, record_of

    assert record_of(SIGLIP).name == "gemma3" and FAMILIES[SIGLIP] is not FAMILY
    assert record_of(aya_adapter.TOWER_MODEL_TYPE) is RECORD and record_of(FULL_TYPE) is RECORD


def test_a_vision_config_without_the_projectors_fields_is_refused(model):
    with pytest.raises(ValueError, match="text_hidden_size.*downsample_factor"):
        aya_adapter.build_encoder(model.config.vision_config)


def test_the_projectors_width_falls_back_to_the_llms_where_the_config_leaves_it_out(model):
    config = case.full_config()
    del config.alignment_intermediate_size  # AyaVisionConfig declares no such field: the releases set it
    assert aya_adapter.tower_only_config(config).alignment_intermediate_size == case.TINY_TEXT["hidden_size"]
    saved = aya_adapter.tower_only_config(model.config)
    assert saved.alignment_intermediate_size == case.ALIGNMENT_INTERMEDIATE_SIZE
    projector = aya_adapter.build_encoder(saved).multi_modal_projector
    assert projector.linear_1.out_features == case.ALIGNMENT_INTERMEDIATE_SIZE


def test_another_models_siglip_checkpoint_is_refused(model):
    config = case.full_config()
    config.model_type = "cohere2_vision"  # Command A Vision: a projector without its LayerNorm
    with pytest.raises(CheckpointError, match="runs Aya Vision's projector only"):
        aya_adapter.tower_only_config(config)


# ---- the real image processor and items_from --------------------------------------------------


def image_processor():
    from transformers import GotOcr2ImageProcessorPil

    # the tiny tower's tiles; up to 4 crops and a thumbnail an image
    return GotOcr2ImageProcessorPil(
        size={"height": case.TILE, "width": case.TILE}, crop_to_patches=True, max_patches=4
    )


def random_images(sizes, seed: int = 0) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def test_aya_visions_processors_are_the_ones_cut_here():
    """AyaVisionProcessor's image processor (the auto mapping's) is GotOcr2's, cropping to patches,
    and AyaVisionProcessor drops num_patches from its output."""
    from transformers import AyaVisionProcessor
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    assert IMAGE_PROCESSOR_MAPPING_NAMES[FULL_TYPE]["pil"] == "GotOcr2ImageProcessorPil"
    assert AyaVisionProcessor.images_kwargs["crop_to_patches"] is True
    assert "num_patches" in AyaVisionProcessor.unused_input_names.fget(None)


@pytest.mark.parametrize("family", [None, FULL_TYPE], ids=["by_keys", "named"])
def test_items_from_the_processor_are_the_images_alone_and_encode_as_hugging_face(model, encoder, family):
    pytest.importorskip("PIL")
    processor = image_processor()
    images = random_images(((8, 24), (8, 8), (20, 14)), seed=2)
    batch = processor(images=images, return_tensors="pt")
    counts = batch["num_patches"].tolist()
    assert len(set(counts)) == len(counts) and 1 in counts  # crops and a thumbnail, and a single tile
    items = vitpool.items_from(batch, family=family)
    assert [type(item) for item in items] == [Image] * len(images)
    for item, image in zip(items, images, strict=True):  # each as the processor makes it for that image alone
        assert torch.equal(
            torch.as_tensor(item.pixel_values), processor(images=[image], return_tensors="pt")["pixel_values"]
        )
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=batch["pixel_values"]).pooler_output
    for embedding, wanted in zip(encoder.encode(items), want.split(counts), strict=True):
        assert relative_error(embedding.tokens, wanted.reshape(-1, wanted.shape[-1])) <= TOLERANCE


def test_items_from_cuts_aya_visions_and_internvls_batches_alike():
    """Both families' processor output is GotOcr2ImageProcessor's: one cut, so a batch of its keys
    needs no family= and gives the same items whichever family it is named for."""
    batch = {"pixel_values": torch.randn(3 + 1 + 5, 3, 8, 8), "num_patches": torch.tensor([3, 1, 5])}
    cuts = [vitpool.items_from(batch, family=name) for name in (None, FULL_TYPE, "internvl")]
    assert [len(item.pixel_values) for item in cuts[0]] == [3, 1, 5]
    for cut in cuts[1:]:
        assert all(torch.equal(a.pixel_values, b.pixel_values) for a, b in zip(cuts[0], cut, strict=True))
    assert internvl_case.ROW_SHAPE == case.ROW_SHAPE  # the same tiles, whichever tower they are for


def test_numpy_output_cuts_as_tensors():
    pytest.importorskip("PIL")
    images = random_images(((8, 24), (20, 14)), seed=3)
    as_tensors = vitpool.items_from(image_processor()(images=images, return_tensors="pt"), family=FULL_TYPE)
    as_arrays = vitpool.items_from(
        dict(image_processor()(images=images, return_tensors="np")), family=FULL_TYPE
    )
    for array_item, tensor_item in zip(as_arrays, as_tensors, strict=True):
        assert isinstance(array_item.pixel_values, np.ndarray)
        assert np.array_equal(array_item.pixel_values, tensor_item.pixel_values.numpy())


def test_the_full_processors_output_without_num_patches_is_cut_per_tile():
    """AyaVisionProcessor drops num_patches: named, a tile an item (the tokens against the model:
    test_full_processor_outputs.py); counts that do not add up are still refused."""
    batch = {"pixel_values": torch.randn(4, 3, 8, 8), "input_ids": torch.zeros(1, 4, dtype=torch.long)}
    assert [item.pixel_values.shape[0] for item in vitpool.items_from(batch, family=FULL_TYPE)] == [1] * 4
    with pytest.raises(ValueError, match="accounts for"):
        vitpool.items_from({**batch, "num_patches": torch.tensor([3, 2])}, family=FULL_TYPE)


# ---- the transformers drop-in -----------------------------------------------------------------


def test_the_drop_in_answers_get_image_features_through_vitpool():
    """`replace_vision_tower(model, encoder)`: the model's own `get_image_features` answers through
    vitpool tile by tile, as its tower and projector did; then put back."""
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = case.hf_model(seed=8)
    pixel_values = torch.cat([tiles(3, 80).pixel_values, tiles(1, 81).pixel_values])
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=pixel_values).pooler_output
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    try:
        with torch.no_grad():
            got = model.model.get_image_features(pixel_values=pixel_values).pooler_output
            with pytest.raises(ConfigError, match="leave them unset"):
                model.model.get_image_features(pixel_values=pixel_values, vision_feature_layer=-2)
    finally:
        restore_vision_tower(model, original)
    assert model.model.vision_tower is tower and model.model.multi_modal_projector is projector
    assert got.shape == want.shape and relative_error(got, want) <= TOLERANCE
