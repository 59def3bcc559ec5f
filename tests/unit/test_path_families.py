"""Items of several inputs (`vitpool.rules.paths`): the rules split an item into its parts,
packing never mixes paths, the wire carries a part's path, a call's parts are joined in order; and
Step-3.7, the family of two paths, against its Hugging Face model: whole items (crops and global
view joined) in one call, loading from full and tower-only saves. CPU, fp32, tiny random models."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import relative_error
from family_cases import step3p7 as step3p7_case
from safetensors.torch import save_file

from vitpool import CheckpointError, Embedding, GraphEncoder, Image, InvalidItemError
from vitpool.items import prepare_item
from vitpool.packing import Budget, ItemCost, pack
from vitpool.pool.calls import Call, PartResults
from vitpool.rules.paths import PathRules, rules_of_part
from vitpool.rules.tiles import TileRules
from vitpool.specs import BatchPlan, plan_from_wire, plan_to_wire

TOLERANCE = 1e-5
GLOBAL, LOCAL = "pixel_values", "pixel_values_local"
RULES = PathRules(
    ((LOCAL, TileRules(3, 4, 1, ((8,),))), (GLOBAL, TileRules(3, 8, 4, ((8,),), max_tiles_per_item=1))),
    required=(GLOBAL,),
)


def test_an_item_is_its_parts_in_join_order():
    prepared = prepare_item(0, Image(torch.randn(1, 3, 8, 8), inputs={LOCAL: torch.randn(3, 3, 4, 4)}), RULES)
    assert [part.spec.path for part in prepared.parts] == [LOCAL, GLOBAL]  # crops first, as the model joins
    assert [part.spec.num_tokens for part in prepared.parts] == [3, 4] and prepared.num_tokens == 7
    alone = prepare_item(0, Image(torch.randn(1, 3, 8, 8)), RULES)  # an image too small for crops
    assert [part.spec.path for part in alone.parts] == [GLOBAL]
    no_crops = prepare_item(0, Image(torch.randn(1, 3, 8, 8), inputs={LOCAL: torch.randn(0, 3, 4, 4)}), RULES)
    assert [part.spec.path for part in no_crops.parts] == [GLOBAL]


@pytest.mark.parametrize(
    ("item", "words"),
    [
        (Image(None, inputs={LOCAL: torch.randn(2, 3, 4, 4)}), "has no ['pixel_values']"),
        (
            Image(torch.randn(1, 3, 8, 8), inputs={"crops": torch.randn(2, 3, 4, 4)}),
            "unknown inputs ['crops']",
        ),
        (Image(torch.randn(2, 3, 8, 8)), "at most 1"),  # two global views: two images
        (Image(torch.randn(1, 3, 8, 8), inputs={LOCAL: torch.randn(2, 3, 4, 5)}), "pixel_values_local: "),
        (Image(torch.randn(1, 3, 8, 8), inputs=[torch.randn(2, 3, 4, 4)]), "inputs must map"),
    ],
)
def test_a_bad_part_is_refused_naming_the_item(item, words):
    with pytest.raises(InvalidItemError) as raised:
        prepare_item(3, item, RULES)
    assert raised.value.index == 3 and words in str(raised.value)


def test_an_item_of_one_input_refuses_inputs():
    with pytest.raises(InvalidItemError, match="takes pixel_values alone"):
        prepare_item(
            0,
            Image(torch.randn(2, 3, 4, 4), inputs={LOCAL: torch.randn(1, 3, 4, 4)}),
            TileRules(3, 4, 1, ((8,),)),
        )


def test_rules_pickle_and_give_each_path_its_budgets():
    assert pickle.loads(pickle.dumps(RULES)) == RULES
    budgets = RULES.budgets([4, 8], None, {})
    assert sorted((b.path, b.num_tokens) for b in budgets) == [
        (GLOBAL, 4),
        (GLOBAL, 8),
        (LOCAL, 4),
        (LOCAL, 8),
    ]
    assert rules_of_part(RULES, LOCAL) is RULES.paths[0][1]
    with pytest.raises(ValueError, match="none of them"):
        rules_of_part(RULES, "other")
    with pytest.raises(ValueError, match="distinct"):
        PathRules(((GLOBAL, RULES.paths[1][1]), (GLOBAL, RULES.paths[1][1])), required=(GLOBAL,))


def test_packing_never_mixes_paths():
    budgets = [Budget(8, (), 4, GLOBAL), Budget(8, (), 4, LOCAL), Budget(4, (), 4, LOCAL)]
    items = [ItemCost(4, (), GLOBAL), ItemCost(2, (), LOCAL), ItemCost(4, (), GLOBAL), ItemCost(1, (), LOCAL)]
    batches = pack(items, budgets)
    for batch in batches:
        assert {items[i].path for i in batch.item_indices} == {batch.budget.path}
    assert sorted(i for batch in batches for i in batch.item_indices) == [0, 1, 2, 3]
    assert [batch.budget for batch in batches] == [Budget(8, (), 4, GLOBAL), Budget(4, (), 4, LOCAL)]
    [alone] = pack([ItemCost(2, (), "unknown path")], budgets)
    assert alone.budget is None  # no budget of its path: eager, alone


def test_a_plan_keeps_its_path_on_the_wire():
    spec = (
        prepare_item(0, Image(torch.randn(1, 3, 8, 8), inputs={LOCAL: torch.randn(2, 3, 4, 4)}), RULES)
        .parts[0]
        .spec
    )
    plan = BatchPlan(Budget(4, (), 4, LOCAL), (spec,))
    assert plan_from_wire(plan_to_wire(plan)) == plan


def test_a_call_joins_an_items_parts_and_takes_a_parts_error_as_the_items():
    call = Call(2, return_exceptions=True, num_parts=[2, 1])
    first, second = Embedding(torch.ones(3, 2)), Embedding(torch.zeros(4, 2))
    assert not call.complete_item(0, second, part=1)
    assert call.results[0] is None  # waits for its other part
    assert not call.complete_item(0, first, part=0)
    assert isinstance(call.results[0], PartResults)
    joined = Embedding.joined(call.results[0].parts)
    assert torch.equal(joined.tokens, torch.cat([torch.ones(3, 2), torch.zeros(4, 2)]))
    failing = Call(1, return_exceptions=True, num_parts=[2])
    error = InvalidItemError(0, "NaN")
    failing.complete_item(0, error, part=1)
    assert failing.done and failing.future.result() == [error]


# Step-3.7 against its Hugging Face model


@pytest.fixture(scope="module")
def model():
    return step3p7_case.hf_model(seed=5)


def step_item(crops: int, seed: int) -> Image:
    generator = torch.Generator().manual_seed(seed)
    global_view = torch.randn(1, *step3p7_case.GLOBAL_ROW_SHAPE, generator=generator)
    if not crops:
        return Image(global_view)
    return Image(
        global_view, inputs={LOCAL: torch.randn(crops, *step3p7_case.LOCAL_ROW_SHAPE, generator=generator)}
    )


def assert_matches(model, items, embeddings) -> None:
    for item, embedding in zip(items, embeddings, strict=True):
        expected = step3p7_case.image_features(model, item)
        assert embedding.tokens.shape == expected.shape
        assert torch.isfinite(embedding.tokens).all()
        assert relative_error(embedding.tokens, expected) <= TOLERANCE


def test_step3p7_images_of_several_crop_counts_in_one_call(model):
    encoder = step3p7_case.encoder_of(model, [4, 8])
    counts = (0, 3, 6, 2, 12)  # 12 crops: over every budget of the crops' path
    items = [step_item(count, seed) for seed, count in enumerate(counts)]
    embeddings = encoder.encode(items)
    tokens = [count * step3p7_case.TOKENS_PER_CROP + step3p7_case.TOKENS_PER_GLOBAL for count in counts]
    assert [e.tokens.shape[0] for e in embeddings] == tokens
    assert_matches(model, items, embeddings)
    assert encoder.stats().eager_batches == 1  # the 12 crops, alone at their own size


def test_step3p7_nan_in_one_items_crops_fails_that_item_alone(model):
    encoder = step3p7_case.encoder_of(model, [4, 8])
    items = [step_item(2, 1), step_item(3, 2)]
    items[1].inputs[LOCAL][0, 0, 0, 0] = float("nan")
    outcomes = encoder.encode(items, return_exceptions=True)
    assert isinstance(outcomes[1], InvalidItemError) and outcomes[1].index == 1
    assert_matches(model, items[:1], outcomes[:1])


def test_step3p7_loads_a_full_model_save(model, tmp_path):
    """transformers 5.24 writes the release's key layout (fused, interleaved q/k/v); the tiny
    model's crops are not the release's 504², so its config says their size."""
    model.config.vision_config.local_image_size = step3p7_case.LOCAL_SIZE
    model.save_pretrained(tmp_path, safe_serialization=True)
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=[4, 8], device="cpu", dtype=torch.float32)
    items = [step_item(3, 10), step_item(0, 11)]
    assert_matches(model, items, encoder.encode(items))


def test_step3p7_loads_a_tower_only_save_and_refuses_missing_weights(model, tmp_path):
    from vitpool.families.step3p7.adapter import tower_only_config

    config = tower_only_config(model.config)
    config.local_image_size = step3p7_case.LOCAL_SIZE
    config.save_pretrained(tmp_path)
    state = step3p7_case.encoder_of(model, [4]).adapter.tower.state_dict()
    save_file({key: value.contiguous() for key, value in state.items()}, str(tmp_path / "model.safetensors"))
    encoder = GraphEncoder.from_pretrained(tmp_path, budgets=[4, 8], device="cpu", dtype=torch.float32)
    items = [step_item(2, 12)]
    assert_matches(model, items, encoder.encode(items))
    del state["multi_modal_projector.weight"]
    save_file({key: value.contiguous() for key, value in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys.*multi_modal_projector.weight"):
        GraphEncoder.from_pretrained(tmp_path, budgets=[4], device="cpu")


def test_step3p7_default_budgets_are_whole_tiles_per_path(model):
    from vitpool.families.step3p7.adapter import MAX_GRAPH_TILES

    encoder = GraphEncoder(step3p7_case.encoder_of(model, [4]).adapter, device="cpu", dtype=torch.float32)
    per_tile = {GLOBAL: step3p7_case.TOKENS_PER_GLOBAL, LOCAL: step3p7_case.TOKENS_PER_CROP}
    for path, tokens in per_tile.items():
        own = [budget.num_tokens for budget in encoder.budgets if budget.path == path]
        assert own[0] == tokens and own[-1] == MAX_GRAPH_TILES[path] * tokens
        assert all(value % tokens == 0 for value in own)


def test_a_plan_of_one_path_reads_as_before_paths_existed():
    """A budget of the one path goes on the wire as before (three fields), so an actor and a
    caller of different releases still agree on plans of the other families."""
    plan = BatchPlan(Budget(16, (("sequences", 4),), 4), ())
    wire = plan_to_wire(plan)
    assert wire["budget"] == [16, [["sequences", 4]], 4]
    assert plan_from_wire(wire) == plan
    with pytest.raises(ValueError, match="one path string"):
        plan_from_wire({"budget": [16, [], 4, 5], "specs": []})


def test_the_primary_input_inside_inputs_is_refused():
    item = Image(torch.randn(1, 3, 8, 8), inputs={GLOBAL: torch.randn(1, 3, 8, 8)})
    with pytest.raises(InvalidItemError, match="pass pixel_values as the item's pixel_values"):
        prepare_item(0, item, RULES)
    unknown = Image(torch.randn(1, 3, 8, 8), inputs={"crops": torch.ones(2, 3, 4, 4, dtype=torch.int64)})
    with pytest.raises(InvalidItemError, match=r"unknown inputs \['crops'\]"):  # named before its dtype
        prepare_item(0, unknown, RULES)


def test_step3p7_every_item_refused_still_answers(model):
    """An encoder of several paths given only bad items (return_exceptions) answers each with its
    error and launches nothing."""
    encoder = step3p7_case.encoder_of(model, [4, 8])
    outcomes = encoder.encode(
        [Image(torch.randn(2, 3)), Image(torch.randn(1, 3, 9, 9))], return_exceptions=True
    )
    assert [type(outcome) for outcome in outcomes] == [InvalidItemError, InvalidItemError]
