"""Every family's adapter derives from one base (`vitpool.models.adapter_base.AdapterBase`) and its
item rules from another (`vitpool.rules.base.RulesBase`), which give the protocol's members with
defaults; what they own is written once, in them, not again in each family."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import vitpool.families
import vitpool.rules
from vitpool.errors import CheckpointError
from vitpool.models.adapter_base import AdapterBase, ConfigField, renames, sample_block_parts
from vitpool.models.family import named_object, vision_config_of
from vitpool.models.protocol import check_adapter
from vitpool.models.registry import RECORDS
from vitpool.packing import SEQUENCES, Budget, make_budgets, plain_budgets
from vitpool.rules.base import RulesBase

FAMILIES_DIR = Path(vitpool.families.__file__).parent
MODELS_DIR = FAMILIES_DIR.parent / "models"
TOWERS = [(record.name, tower, family) for record in RECORDS for tower, family in record.towers.items()]

# Families whose adapter is on no base, each with why. None today: a family added without the base
# names itself here, with its reason, or derives from it.
NOT_ON_THE_BASE: dict[str, str] = {}
# Rules that write their own budgets (the default bounds tokens, items and attention sequences), and why.
OWN_BUDGETS = {
    "TileRules": "whole tiles: tokens bound a batch, its tiles only where the user sets a limit",
    "PathRules": "every input's budgets, each marked with its path",
    "WindowedMergeRules": "also bound windows (Qwen2.5-VL's window attention)",
    "TemporalMergeRules": "also bound rows (ERNIE-4.5-VL's videos take twice an image's)",
    "KimiK25Rules": "a clip path of its own, bounded by its extra rows",
    "LlavaOnevisionRules": "bound tiles by the most a budget's tokens can have",
    "Phi4MultimodalRules": "bound crops by the most a budget's tokens can have",
    "MllamaRules": "bound images by the tiles a budget holds (each runs all its canvas's tiles)",
    "VideoLlama3Rules": "a merged path of its own, bounded by its extra rows",
    "Molmo2Rules": "bound crops by the most a budget's tokens can have (its pooled tokens a crop)",
}
# What the bases own: defined there, never again in a family (module level or a class's own).
OWNED_FUNCTIONS = {
    "projector_config",
    "tower_only_config",
    "convert_checkpoint",
    "crop_size",
    "connector_config",
    "resampler_config",
    "renamed_key",
}


def adapter_class(family) -> type:
    return named_object(family.adapter.target)


@pytest.mark.parametrize("name, tower, family", TOWERS, ids=[f"{name}-{tower}" for name, tower, _ in TOWERS])
def test_every_familys_adapter_derives_from_the_base(name, tower, family):
    cls = adapter_class(family)
    if name in NOT_ON_THE_BASE:
        assert not issubclass(cls, AdapterBase), f"{name} is on the base now: drop it from NOT_ON_THE_BASE"
        return
    assert issubclass(cls, AdapterBase), f"{cls.__qualname__} is on no base; derive it or say why"
    for member in ("paths", "fp8_refused", "budget_range", "row_shape", "output_row_shapes"):
        assert hasattr(cls, member)


@pytest.mark.parametrize("name, tower, family", TOWERS, ids=[f"{name}-{tower}" for name, tower, _ in TOWERS])
def test_a_familys_checkpoints_are_read_through_its_adapter_class(name, tower, family):
    """A layout that reads more than the default (the vision config, keys less their prefix) reads
    it through the adapter class's `tower_only_config` and `convert_checkpoint`."""
    layout, cls = family.checkpoint, adapter_class(family)
    hooks = {"tower_only_config": layout.tower_config, "convert_checkpoint": layout.convert}
    defaults = {"tower_only_config": vision_config_of, "convert_checkpoint": None}  # Qwen's and GLM's
    for method, hook in hooks.items():
        if hook is not defaults[method]:
            assert getattr(hook, "target", None) == f"{cls.__module__}:{cls.__name__}.{method}"
            assert callable(getattr(cls, method))


def _modules(directory: Path):
    for path in sorted(directory.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_what_the_bases_own_is_defined_once():
    offenders = []
    for directory in (FAMILIES_DIR, MODELS_DIR):
        for path, tree in _modules(directory):
            if path.name == "adapter_base.py" or path.parent.name == "checkpoints":
                continue
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else []
                if any(isinstance(t, ast.Name) and t.id == "MAX_SAMPLED_ITEMS" for t in targets):
                    offenders.append(f"{path.name}:{node.lineno} MAX_SAMPLED_ITEMS (set the class attribute)")
                if isinstance(node, ast.FunctionDef) and node.name in OWNED_FUNCTIONS:
                    offenders.append(f"{path.relative_to(FAMILIES_DIR.parent)}:{node.lineno} def {node.name}")
    assert not offenders, "defined outside the bases:\n" + "\n".join(offenders)


def _rules_classes() -> list[type]:
    modules = [
        importlib.import_module(f"vitpool.rules.{info.name}")
        for info in pkgutil.iter_modules(vitpool.rules.__path__)
    ]
    for info in pkgutil.iter_modules(vitpool.families.__path__):
        if (FAMILIES_DIR / info.name / "rules.py").is_file():
            modules.append(importlib.import_module(f"vitpool.families.{info.name}.rules"))
    return [
        cls
        for module in modules
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__ and hasattr(cls, "item_spec")
    ]


def test_every_rules_class_derives_from_the_rules_base_and_own_budgets_say_why():
    classes = _rules_classes()
    assert len(classes) >= 15
    own = set()
    for cls in classes:
        assert issubclass(cls, RulesBase), f"{cls.__qualname__} is not on RulesBase"
        if "budgets" in vars(cls):
            own.add(cls.__name__)
    assert own == set(OWN_BUDGETS), "rules with their own budgets must say why in OWN_BUDGETS"


def test_the_rules_bases_defaults():
    class Plain(RulesBase):
        capacities = ()

    class Sequences(RulesBase):
        capacities = (SEQUENCES,)

    class Windows(RulesBase):
        capacities = (SEQUENCES, "windows")

    pixels = torch.zeros(3, 4)
    assert Plain().pixel_rows(pixels) is pixels and Plain().parts == ()
    assert Plain().budgets([64, 128], 4, {}) == plain_budgets([64, 128], 4)
    assert Sequences().budgets([64, 512], 4, {SEQUENCES: 8}) == make_budgets([64, 512], 4, 8)
    with pytest.raises(ValueError, match="bounds no 'sequences'"):
        Plain().budgets([64], None, {SEQUENCES: 8})
    with pytest.raises(NotImplementedError, match="windows"):
        Windows().budgets([64], None, {})


class ToyRules(RulesBase):
    capacities = ()
    row_shape = (6,)
    output_row_shapes = ((5,),)
    merge_unit = 4


class Toy(AdapterBase):
    """An adapter on the base with a projector after its tower, and the base's defaults."""

    PROJECTOR_FIELDS = (
        ConfigField("text_hidden_size", "text_config.hidden_size", int),
        ConfigField("text_eps", "text_config.rms_norm_eps"),
        ConfigField("act", "projector_hidden_act"),
    )
    PROJECTOR_SUBJECT = "a toy vision config"
    PROJECTOR_ADVICE = "to build its projector"
    FULL_MODEL_TYPES = ("toy",)
    OTHER_MODEL = "a {model_type} checkpoint is no toy ({expected})"
    CHECKPOINT_RENAMES = renames((r"^model\.", ""))

    def __init__(self) -> None:
        self.tower = torch.nn.Identity()
        self.item_rules = ToyRules()


def full_config(model_type: str = "toy") -> SimpleNamespace:
    return SimpleNamespace(
        model_type=model_type,
        vision_config=SimpleNamespace(hidden_size=8),
        text_config=SimpleNamespace(hidden_size=16.0, rms_norm_eps=1e-6),
        projector_hidden_act="gelu",
    )


def test_the_adapter_bases_defaults():
    adapter = check_adapter(Toy())
    assert adapter.paths == {"": adapter} and adapter.budget_range(torch.device("cpu")) is None
    assert adapter.fp8_refused is None
    assert adapter.row_shape == (6,) and adapter.output_row_shapes == ((5,),) and adapter.max_rows(3) == 12
    adapter.paths = {"a": "path adapter"}
    assert adapter.paths == {"a": "path adapter"} and Toy().paths != adapter.paths
    assert adapter.sampled_items(Budget(64, (), 32)) == AdapterBase.MAX_SAMPLED_ITEMS
    assert adapter.sampled_items(Budget(64, (), 2)) == 2


def test_a_tower_only_config_carries_what_the_projector_reads():
    full = full_config()
    tower_only = Toy.tower_only_config(full)
    assert tower_only is not full.vision_config and tower_only.hidden_size == 8
    assert (tower_only.text_hidden_size, tower_only.text_eps, tower_only.act) == (16, 1e-6, "gelu")
    assert isinstance(tower_only.text_hidden_size, int)
    projector = Toy.projector_config(tower_only)
    assert projector.vision_config is tower_only
    assert vars(projector.text_config) == {"hidden_size": 16, "rms_norm_eps": 1e-6}
    assert projector.projector_hidden_act == "gelu"
    assert Toy.projector_config(full) is full  # a full config holds what the projector reads
    with pytest.raises(
        ValueError, match=r"a toy vision config needs \['text_eps', 'act'\] to build its projector"
    ):
        Toy.projector_config(SimpleNamespace(text_hidden_size=16, model_type="toy_vision"))
    with pytest.raises(CheckpointError, match=r"a 'other' checkpoint is no toy \('toy'\)"):
        Toy.tower_only_config(full_config("other"))


def test_a_checkpoints_keys_are_renamed_first_match():
    state = {"model.a": 1, "b": 2, "model.model.c": 3}
    assert Toy.convert_checkpoint(state) == {"a": 1, "b": 2, "model.c": 3}


def test_an_adapter_on_no_base_is_refused_by_name():
    bare = SimpleNamespace(tower=None, item_rules=SimpleNamespace(), paths={})
    with pytest.raises(TypeError, match=r"lacks \['fp8_refused', 'budget_range', 'item_rules.parts'"):
        check_adapter(bare)


def test_the_block_sampler_keeps_to_its_bounds():
    rng = random.Random(0)
    for _ in range(200):
        blocks, sequences, items, parts = rng.randint(1, 64), rng.randint(1, 8), rng.randint(1, 8), 3
        drawn = sample_block_parts(rng, blocks, sequences, items, parts)
        assert 1 <= len(drawn) <= items
        assert sum(len(item) for item in drawn) <= sequences
        assert all(1 <= len(item) <= parts for item in drawn)
        assert sum(h * w for item in drawn for h, w in item) <= blocks
