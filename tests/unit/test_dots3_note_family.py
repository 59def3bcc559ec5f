"""dots.3 Note (`Dots3NoteVisionModel` with its merger and mixture-of-experts blocks): the static
forward against the Hugging Face model's own `get_image_features` / `get_video_features` (fp32,
SDPA, eager experts) on one image, on items of different sizes in one call and on the batch the
model runs, on videos, in every budget and padded into a larger one; the experts on their static
implementation; loading full checkpoints (as saved, sharded, in the model's state_dict layout) and a
tower-only save; bad items named by their index; `vitpool.items_from` on the real image processor's
output beside audio; the transformers drop-in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import relative_error
from family_cases import dots3_note as dots3_case
from family_cases.dots3_note import (
    MERGE,
    NUM_EXPERTS,
    PATCH,
    ROW_WIDTH,
    TEXT_WIDTH,
    encoder_of,
    hf_model,
    image_features,
)
from safetensors.torch import load_file, save_file

import vitpool
from vitpool import CheckpointError, GraphEncoder, Image, InvalidItemError, Video

pytestmark = pytest.mark.skipif(bool(dots3_case.TOO_OLD), reason=str(dots3_case.TOO_OLD))

TOLERANCE = 1e-4
BUDGETS = [16, 32, 64]


def item(t: int, h: int, w: int, seed: int) -> Image | Video:
    """An item of t frames of h x w patches with fresh random pixels, as the processors lay them out."""
    pixels = torch.randn(t * h * w, ROW_WIDTH, generator=torch.Generator().manual_seed(seed))
    return (Video if t > 1 else Image)(pixels, (t, h, w))


@pytest.fixture(scope="module")
def model():
    return hf_model(seed=3)


@pytest.fixture(scope="module")
def encoder(model) -> GraphEncoder:
    return encoder_of(model, BUDGETS)


def assert_matches(model, encoder: GraphEncoder, items: list) -> float:
    worst = 0.0
    for position, (embedding, one) in enumerate(zip(encoder.encode(items), items, strict=True)):
        t, h, w = one.grid_thw
        assert embedding.tokens.shape == (t * h * w // MERGE**2, TEXT_WIDTH), position
        assert torch.isfinite(embedding.tokens).all(), position
        error = relative_error(embedding.tokens, image_features(model, one))
        assert error <= TOLERANCE, position
        worst = max(worst, error)
    return worst


def test_one_image_matches_get_image_features(model, encoder):
    assert_matches(model, encoder, [item(1, 4, 6, seed=1)])


def test_images_of_different_sizes_in_one_call(model, encoder):
    items = [item(1, 4, 6, 2), item(1, 8, 2, 3), item(1, 6, 6, 4), item(1, 2, 2, 5), item(1, 2, 14, 6)]
    assert_matches(model, encoder, items)
    # what the model runs: all images in one call, split per image by get_image_features
    pixels = torch.cat([one.pixel_values for one in items])
    grids = torch.tensor([one.grid_thw for one in items])
    with torch.no_grad():
        wanted = model.model.get_image_features(pixels, grids).pooler_output
    for got, want in zip(encoder.encode(items), wanted, strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    # one larger than any budget (64 tokens): eager, alone
    assert_matches(model, encoder, [item(1, 20, 16, 7), item(1, 4, 2, 8)])


def test_videos_match_get_video_features(model, encoder):
    """One attention sequence per frame; the frames keep their tokens (no temporal patch)."""
    clips = [item(2, 4, 4, 9), item(3, 2, 6, 10)]
    assert_matches(model, encoder, clips)
    pixels = torch.cat([one.pixel_values for one in clips])
    grids = torch.tensor([one.grid_thw for one in clips])
    with torch.no_grad():
        wanted = model.model.get_video_features(pixels, grids).pooler_output
    for got, want in zip(encoder.encode(clips), wanted, strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE


def test_padding_rows_do_not_change_real_rows(encoder):
    """The same image alone in the smallest and the largest budget, and beside neighbours, with
    garbage in the padding rows' pixels (routed to experts too): its tokens are the same."""
    adapter = encoder.adapter
    one = item(1, 4, 6, 14)
    spec = adapter.item_rules.item_spec("image", (24, ROW_WIDTH), "float32", (1, 4, 6))
    alone = {}
    for budget in (encoder.budgets[0], encoder.budgets[-1]):
        rows = adapter.max_rows(budget.num_tokens)
        batch = torch.randn(rows, ROW_WIDTH) * 100
        batch[:24] = one.pixel_values
        metadata = adapter.build_metadata([spec], rows, budget)
        with torch.no_grad():
            alone[budget.num_tokens] = adapter.forward(batch, metadata)[0][: spec.num_tokens]
    crowded = encoder.encode([item(2, 4, 4, 15), one, item(1, 2, 2, 16)])[1].tokens
    first = alone[encoder.budgets[0].num_tokens]
    assert relative_error(alone[encoder.budgets[-1].num_tokens], first) <= TOLERANCE
    assert relative_error(crowded, first) <= TOLERANCE


def test_the_experts_run_their_static_implementation(model, encoder):
    """Every experts module of the adapter's tower is on "grouped_mm" (the eager loop syncs with
    the host); the model's own default agrees with its eager loop, so the reference is not special."""
    from vitpool.families.dots3_note.adapter import STATIC_EXPERTS

    experts = [m for m in encoder.adapter.tower.modules() if hasattr(m, "gate_up_proj")]
    assert len(experts) == 1 and experts[0].num_experts == NUM_EXPERTS
    assert all(m.config._experts_implementation == STATIC_EXPERTS for m in experts)
    assert all(
        m.config._experts_implementation == "eager" for m in model.modules() if hasattr(m, "gate_up_proj")
    )
    default = hf_model(seed=3)
    for part in default.modules():
        if hasattr(part, "gate_up_proj"):
            part.config._experts_implementation = STATIC_EXPERTS
    one = item(1, 6, 4, 17)
    assert relative_error(image_features(default, one), image_features(model, one)) <= TOLERANCE


@pytest.mark.parametrize("bad, words", dots3_case.CASE_FIELDS["bad_items"], ids=lambda v: str(v)[:40])
def test_bad_items_are_named(encoder, bad, words):
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([item(1, 4, 4, 18), bad])
    assert raised.value.index == 1 and words in str(raised.value)


def test_integer_pixels_and_a_temporal_patch_are_named(model, encoder):
    wrong_dtype = Image(torch.ones(16, ROW_WIDTH, dtype=torch.int64), (1, 4, 4))
    with pytest.raises(InvalidItemError, match="dtype torch.int64") as raised:
        encoder.encode([item(1, 4, 4, 19), wrong_dtype])
    assert raised.value.index == 1
    # rows of two frames (a Qwen processor's temporal_patch_size=2): the model fails on them too
    doubled = Image(torch.randn(16, 2 * ROW_WIDTH), (1, 4, 4))
    with pytest.raises(InvalidItemError, match=f"the model takes {ROW_WIDTH}") as raised:
        encoder.encode([doubled])
    assert raised.value.index == 0
    with pytest.raises(RuntimeError), torch.no_grad():
        model.model.get_image_features(doubled.pixel_values, torch.tensor([[1, 4, 4]]))


# Checkpoints: transformers writes the release layout back (`vision_encoder.`, per-expert weights)


def load(directory: Path) -> GraphEncoder:
    return GraphEncoder.from_pretrained(directory, budgets=BUDGETS, device="cpu", dtype=torch.float32)


def saved_state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def test_convert_checkpoint_layouts(model, tmp_path: Path):
    from vitpool.families.dots3_note.adapter import convert_checkpoint

    own = model.model.vision_tower.state_dict()
    in_memory = {k: v for k, v in model.state_dict().items() if k.startswith("model.vision_tower.")}
    assert convert_checkpoint(in_memory).keys() == own.keys()
    model.save_pretrained(tmp_path)
    release = {k: v for k, v in saved_state(tmp_path).items() if k.startswith("vision_encoder.")}
    assert any(".experts.3.fc3." in key for key in release)
    assert "vision_encoder.post_trunk_norm.weight" in release
    converted = convert_checkpoint(release)
    assert converted.keys() == own.keys()
    for key, tensor in own.items():
        assert torch.equal(converted[key], tensor), key
    del release["vision_encoder.blocks.1.mlp.experts.2.fc3.weight"]
    with pytest.raises(CheckpointError, match=r"experts\.2\.fc3\.weight"):
        convert_checkpoint(release)


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["whole", "sharded"])
def test_loads_a_full_model_save(model, tmp_path: Path, max_shard_size):
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        assert len({shard for key, shard in weight_map.items() if key.startswith("vision_encoder.")}) > 2
    assert_matches(model, load(tmp_path), [item(1, 4, 6, 20), item(2, 2, 4, 21)])


def test_loads_transformers_in_memory_layout(model, tmp_path: Path):
    model.config.save_pretrained(tmp_path)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_matches(model, load(tmp_path), [item(1, 6, 2, 22)])


def test_loads_a_tower_only_save_and_names_a_missing_key(model, tmp_path: Path):
    model.model.vision_tower.save_pretrained(tmp_path / "tower")
    written = json.loads((tmp_path / "tower" / "config.json").read_text())
    assert written["mlp_layer_types"] == ["dense", "sparse"]
    assert_matches(model, load(tmp_path / "tower"), [item(1, 4, 4, 23)])
    model.model.vision_tower.config.save_pretrained(tmp_path / "broken")
    state = {k: v.contiguous() for k, v in model.model.vision_tower.state_dict().items()}
    del state["blocks.1.mlp.gate.weight"]
    save_file(state, str(tmp_path / "broken" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"blocks\.1\.mlp\.gate\.weight"):
        load(tmp_path / "broken")


# vitpool.items_from on the processor's output


def test_items_from_the_image_processor_beside_audio(model, encoder):
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH, temporal_patch_size=1, merge_size=MERGE, min_pixels=16, max_pixels=16 * 16
    )
    rng = np.random.default_rng(1)
    pictures = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in ((12, 8), (8, 8))]
    batch = dict(processor(images=pictures, return_tensors="pt"))
    # what Dots3NoteProcessor adds for an audio clip: the audio tower's, not the vision encoder's
    batch.update(
        input_features=torch.randn(1, 16, 24),
        chunk_sample_lengths=torch.tensor([3840]),
        num_audio_tokens=torch.tensor([3]),
    )
    items = vitpool.items_from(batch, family="dots3_note")
    assert [tuple(one.grid_thw) for one in items] == [tuple(g) for g in batch["image_grid_thw"].tolist()]
    assert_matches(model, encoder, items)
    with torch.no_grad():
        wanted = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    for got, want in zip(encoder.encode(items), wanted, strict=True):
        assert relative_error(got.tokens, want) <= TOLERANCE
    with pytest.raises(ValueError, match="image_grid_thw"):
        vitpool.items_from({"pixel_values": batch["pixel_values"]}, family="dots3_note")
    short = {**batch, "pixel_values": batch["pixel_values"][:-4]}
    with pytest.raises(ValueError, match="accounts? for"):
        vitpool.items_from(short, family="dots3_note")


def test_items_from_cuts_videos_in_the_processors_keys(model, encoder):
    clips = [item(2, 4, 6, 30), item(3, 2, 4, 31)]
    batch = {
        "pixel_values_videos": torch.cat([one.pixel_values for one in clips]),
        "video_grid_thw": torch.tensor([one.grid_thw for one in clips]),
    }
    items = vitpool.items_from(batch, family="dots3_note")
    assert [type(one) for one in items] == [Video, Video]
    with torch.no_grad():
        wanted = model.model.get_video_features(*batch.values()).pooler_output
    for embedding, want in zip(encoder.encode(items), wanted, strict=True):
        assert relative_error(embedding.tokens, want) <= TOLERANCE


# The transformers drop-in: the tower stands in, get_image_features / get_video_features split its tokens


def test_the_drop_in_answers_get_image_and_video_features():
    from vitpool.integrations.transformers import (
        graph_encoder_for,
        replace_vision_tower,
        restore_vision_tower,
    )

    model = hf_model(seed=7)
    calls = []
    for group in ([item(1, 4, 6, 40), item(1, 2, 2, 41)], [item(2, 4, 4, 42)]):
        pixels = torch.cat([one.pixel_values for one in group])
        calls.append((pixels, torch.tensor([one.grid_thw for one in group])))
    with torch.no_grad():
        wanted = [model.model.get_image_features(*call).pooler_output for call in calls]
    original = replace_vision_tower(model, graph_encoder_for(model, budgets=BUDGETS))
    with torch.no_grad():
        got = [model.model.get_image_features(*calls[0]).pooler_output]
        got.append(model.model.get_video_features(*calls[1]).pooler_output)
    for got_group, want_group in zip(got, wanted, strict=True):
        assert [tuple(t.shape) for t in got_group] == [tuple(t.shape) for t in want_group]
        for got_tokens, want in zip(got_group, want_group, strict=True):
            assert relative_error(got_tokens, want) <= TOLERANCE
    restore_vision_tower(model, original)
    with torch.no_grad():
        assert torch.equal(model.model.get_image_features(*calls[0]).pooler_output[0], wanted[0][0])


def test_a_bf16_encoder_keeps_the_routers_in_fp32_as_from_pretrained_does(model, tmp_path: Path):
    """Hugging Face loads the routers' weight and correction bias in fp32 whatever the dtype asked
    (`_keep_in_fp32_modules_strict`); a bf16 encoder keeps them so too, and routes as that model."""
    from transformers import Dots3NoteForConditionalGeneration

    model.save_pretrained(tmp_path)
    loaded = Dots3NoteForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=BUDGETS, device="cpu", dtype=torch.bfloat16)
    for tower in (loaded.model.vision_tower, encoder.adapter.tower):
        routers = {name: p.dtype for name, p in tower.named_parameters() if name.endswith("mlp.gate.weight")}
        assert routers and set(routers.values()) == {torch.float32}, routers
        assert {p.dtype for name, p in tower.named_parameters() if name.endswith("qkv.weight")} == {
            torch.bfloat16
        }
    one = item(1, 6, 4, 23)
    [embedding] = encoder.encode([one])
    with torch.no_grad():
        want = loaded.model.get_image_features(
            torch.as_tensor(one.pixel_values).bfloat16(), torch.tensor([list(one.grid_thw)])
        ).pooler_output[0]
    assert torch.isfinite(embedding.tokens).all()
    assert relative_error(embedding.tokens.float(), want.float()) <= 2e-2
