"""Crops of a size the encoder was not built for (Step-3.7, DeepSeek-OCR-2): the encoder's crop
path has buffers and graphs of its one crop size, and square crops of another side the tower takes
are accepted, sized by their own shape and tokens, and run eagerly, alone, at their own size
(`vitpool.models.tiled`), with one warning per encoder and size. Malformed crops are still refused,
naming the item, and cost the other items of the call nothing.

Each family's tiny random model (family_cases), CPU, fp32, against Hugging Face's
`get_image_features` on the same image (relative error <= 1e-4); one GPU test runs such crops
beside captured graphs (tests/gpu/test_undeclared_crops_gpu.py).
"""

from __future__ import annotations

import logging
import pickle
from types import ModuleType

import pytest
import torch
from conftest import relative_error
from family_cases import deepseek_ocr2 as deepseek_case
from family_cases import step3p7 as step_case

from vitpool import Embedding, GraphEncoder, Image, InvalidItemError
from vitpool.items import prepare_item
from vitpool.packing import pack
from vitpool.specs import BatchPlan, plan_from_wire, plan_to_wire

TOLERANCE = 1e-4
LOCAL = "pixel_values_local"
WARNING_WORDS = "no graph serves them"

# (family case, a crop side the case's encoder was not built for, that side's tokens a crop)
UNDECLARED = {
    # 6 x 6 whole patches of 7 pixels and 3 unread pixels a side, 2 x 2 after the 4x reduction
    "step3p7": (step_case, 45, 4),
    # 40 x 40 patches of 16 pixels, 10 x 10 SAM tokens: the 144 queries, as the declared 768² crops
    "deepseek_ocr2": (deepseek_case, 640, 144),
}
# Each tiny tower's patch side in pixels
PATCH_SIZE = {"step3p7": step_case.TINY_VISION["patch_size"], "deepseek_ocr2": 16}  # SAM's default
# A second undeclared side per family, of other tokens than the first
OTHER_UNDECLARED = {
    "step3p7": (84, 9),  # 12 x 12 patches: larger than the 56² global view, positions interpolated up
    "deepseek_ocr2": (1024, 256),  # 16 x 16 SAM tokens: the tower takes its 256-query table
}


@pytest.fixture(scope="module", params=sorted(UNDECLARED))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return UNDECLARED[family][0].hf_model(seed=21)


def encoder_of(family: str, model) -> GraphEncoder:
    """A fresh encoder (its own warnings) of the case's crop size, with the case's budgets."""
    case = UNDECLARED[family][0]
    return case.encoder_of(model, list(case.CASE_FIELDS["budgets"]))


def image(case: ModuleType, num_crops: int, crop_shape: tuple[int, ...] | None, seed: int) -> Image:
    """One image: a global view of the case's size and `num_crops` crops [C, S, S] (None: the case's)."""
    generator = torch.Generator().manual_seed(seed)
    view = torch.randn(1, *case.GLOBAL_ROW_SHAPE, generator=generator)
    shape = case.LOCAL_ROW_SHAPE if crop_shape is None else crop_shape
    return Image(view, inputs={LOCAL: torch.randn(num_crops, *shape, generator=generator)})


def assert_matches_hf(model, case: ModuleType, item: Image, embedding, tokens_per_crop: int) -> None:
    expected = case.image_features(model, item)
    num_crops = item.inputs[LOCAL].shape[0]
    assert embedding.tokens.shape == expected.shape
    assert expected.shape[0] == num_crops * tokens_per_crop + case.TOKENS_PER_GLOBAL
    assert relative_error(embedding.tokens, expected) <= TOLERANCE


def eager_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if WARNING_WORDS in record.getMessage()]


def test_undeclared_crops_are_sized_by_their_own_shape_and_served_by_no_graph(family, model):
    """In a caller's process, by the rules it was handed (pickled): the crops' part has its pixels'
    real shape and the tokens the tower gives them, and no budget of the crop path holds it."""
    case, side, tokens_per_crop = UNDECLARED[family]
    encoder = encoder_of(family, model)
    rules = pickle.loads(pickle.dumps(encoder.adapter.item_rules))
    crops, view = prepare_item(0, image(case, 3, (3, side, side), 1), rules).parts
    assert crops.spec.path == LOCAL and crops.spec.pixel_shape == (3, 3, side, side)
    assert crops.spec.num_tokens == 3 * tokens_per_crop and not crops.spec.served_by_graph
    assert view.spec.served_by_graph
    declared, _ = prepare_item(0, image(case, 3, None, 2), rules).parts
    assert declared.spec.served_by_graph
    assert all(budget.limit("no_graph") == 0 for budget in encoder.budgets if budget.path == LOCAL)
    [alone] = pack([crops.spec], encoder.budgets)
    assert alone.budget is None  # eager, alone, wherever it is planned
    together = pack([declared.spec, crops.spec, declared.spec], encoder.budgets)
    assert sorted(batch.item_indices for batch in together if batch.budget is None) == [(1,)]


def test_undeclared_crops_match_hf_beside_declared_ones_in_one_call(family, model):
    case, side, tokens_per_crop = UNDECLARED[family]
    other_side, other_tokens = OTHER_UNDECLARED[family]
    encoder = encoder_of(family, model)
    items = [
        image(case, 2, None, 3),  # the encoder's crop size: the graph path
        image(case, 2, (3, side, side), 4),
        image(case, 1, None, 5),
        image(case, 1, (3, other_side, other_side), 6),
    ]
    embeddings = encoder.encode(items)
    assert_matches_hf(model, case, items[0], embeddings[0], case.TOKENS_PER_CROP)
    assert_matches_hf(model, case, items[1], embeddings[1], tokens_per_crop)
    assert_matches_hf(model, case, items[2], embeddings[2], case.TOKENS_PER_CROP)
    assert_matches_hf(model, case, items[3], embeddings[3], other_tokens)
    # each undeclared item's crops ran alone at their own size; the others in budgets
    assert encoder.stats().eager_batches == 2


def test_the_warning_comes_once_per_encoder_and_crop_size(family, model, caplog):
    case, side, _ = UNDECLARED[family]
    other_side, _ = OTHER_UNDECLARED[family]
    encoder = encoder_of(family, model)
    with caplog.at_level(logging.WARNING, logger="vitpool.models.tiled"):
        for seed in (7, 8):  # two calls
            encoder.encode([image(case, 1, (3, side, side), seed), image(case, 1, None, seed + 10)])
        [message] = eager_warnings(caplog)
        assert message.startswith(
            f"crops of {side} pixels: no graph serves them (the encoder's crops are {case.LOCAL_SIZE}, "
            "from the local_image_size the encoder module was built with); they run eagerly at their own size"
        )
        assert f"To make crops of {side} pixels the fast path (graphs)" in message
        encoder.encode([image(case, 1, (3, other_side, other_side), 9)])
        assert len(eager_warnings(caplog)) == 2  # another size: its own warning
        encoder_of(family, model).encode([image(case, 1, (3, side, side), 7)])
        assert len(eager_warnings(caplog)) == 3  # another encoder: its own warning


@pytest.mark.parametrize(
    ("crops", "words"),
    [
        # not square
        ("non-square", "pixel_values_local: pixel_values must be tiles [tiles, 3, "),
        # a side under one patch, which the tower's patch convolution cannot cut
        ("under a patch", "pixels are smaller than one"),
        # four channels
        ("channels", "got shape (1, 4, "),
    ],
)
def test_a_malformed_crop_is_refused_naming_its_item_and_the_others_are_unharmed(family, model, crops, words):
    case, side, tokens_per_crop = UNDECLARED[family]
    patch = PATCH_SIZE[family]
    shape = {"non-square": (3, side, side + patch), "under a patch": (3, patch - 1, patch - 1)}
    shape["channels"] = (4, side, side)
    encoder = encoder_of(family, model)
    good = [image(case, 1, (3, side, side), 11), image(case, 2, None, 12)]
    bad = image(case, 1, shape[crops], 13)
    with pytest.raises(InvalidItemError) as raised:
        encoder.encode([good[0], bad, good[1]])
    assert raised.value.index == 1 and words in str(raised.value)
    first, error, second = encoder.encode_each([good[0], bad, good[1]])
    assert isinstance(error, InvalidItemError) and error.index == 1 and words in str(error)
    assert_matches_hf(model, case, good[0], first, tokens_per_crop)
    assert_matches_hf(model, case, good[1], second, case.TOKENS_PER_CROP)


def test_plans_of_a_pools_planner_run_undeclared_crops_alone(family, model):
    """As a pool runs them: the parts packed into the budgets the encoder captured, each batch's
    plan over the wire and checked where it arrives, the parts' outputs joined per item; a plan that
    puts undeclared crops beside another item is refused as a whole."""
    case, side, tokens_per_crop = UNDECLARED[family]
    encoder = encoder_of(family, model)
    items = [image(case, 2, (3, side, side), 14), image(case, 1, None, 15)]
    owners, parts = [], []  # per part: its item's index, the part
    for index, item in enumerate(items):
        for part in prepare_item(index, item, encoder.adapter.item_rules).parts:
            owners.append(index)
            parts.append(part)
    batches = pack([part.spec for part in parts], encoder.budgets)
    assert [batch.item_indices for batch in batches if batch.budget is None] == [(0,)]  # the 2 crops
    groups = []
    for batch in batches:
        plan = plan_from_wire(
            plan_to_wire(BatchPlan(batch.budget, tuple(parts[i].spec for i in batch.item_indices)))
        )
        groups.append(encoder.check_plan(plan, [parts[i].pixels for i in batch.item_indices]))
    outcomes = {}
    for batch, results in zip(batches, encoder.run_plans(groups)):
        outcomes.update(zip(batch.item_indices, results))
    for index, (item, tokens) in enumerate(zip(items, (tokens_per_crop, case.TOKENS_PER_CROP))):
        joined = Embedding.joined([outcomes[p] for p, owner in enumerate(owners) if owner == index])
        assert_matches_hf(model, case, item, joined, tokens)
    undeclared, declared = parts[0], parts[2]
    with pytest.raises(ValueError, match="holds one that no graph serves, which runs alone"):
        encoder.check_plan(
            BatchPlan(None, (undeclared.spec, declared.spec)), [undeclared.pixels, declared.pixels]
        )
