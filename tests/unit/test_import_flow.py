"""The one-way import flow, checked on the source (parsed with `ast`, never imported): a module of
vitpool imports only its own package and packages of lower layers.

Every import counts: at module level, inside a function (a lazy import runs the same code, only
later, so an upward one is refused like any other), and the names a package's `__init__` exports
through `vitpool._lazy.lazy_exports`. Only imports under `if TYPE_CHECKING:` are left out: they
never run. Whether a caller's process loads transformers or modeling code at run time is
tests/unit/test_caller_imports.py's concern, not this file's.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "vitpool"

# The layers, lowest first, as the README's layout section draws them: errors, packing -> specs ->
# rules -> transport, kernels -> items -> models -> families -> ... -> vitpool's public names.
# integrations/ sit above the pool and the public names (an integration "uses the pool's public
# API": the gateway, Dynamo and the vLLM store start or join a pool), and the command line with
# `python -m vitpool` sit on top of everything. Packages of one layer are siblings that import
# none of each other (the transport "knows no model"). A new top-level package or module is its
# name added to a layer, or a new layer: one line.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "_lazy"),  # exception classes; the lazy exports of package __init__s
    ("dtypes", "packing"),  # dtype names (torch only); budgets and bin-packing (no torch, no Ray)
    ("specs", "encoder_spec"),  # what every layer agrees on about an item and a batch; an encoder's settings
    ("rules",),  # the item rules families build on (plain Python: the callers check items with them)
    ("transport", "kernels"),  # how a batch travels; what makes every tower fast, knowing no family
    ("items",),  # Image, Video (and Embedding, defined in transport/) and the checks at the boundary
    ("models",),  # the adapter protocol, the family record and registry, loading, shared blocks
    ("families",),  # one package per family: its record, adapter, rules, checkpoint conversion
    ("from_processor",),  # items_from: a processor's output cut into items, by the family's record
    ("graphs", "codec"),  # GraphEncoder; the msgpack format for bytes from outside the cluster
    ("actors",),  # an encoder actor: one GraphEncoder on one GPU
    ("pool",),  # the caller's side: EncoderPool and its coordinator
    ("__init__",),  # vitpool's public names (`import vitpool`)
    ("integrations",),  # transformers, vLLM and Dynamo, on the pool's public API
    ("cli_flags",),  # `vitpool serve`'s flags, one per pool setting
    ("cli",),  # the `vitpool` command line
    ("__main__",),  # `python -m vitpool`
]

# Packages that count as one (none now; a package split in two while it moves can be named here).
SAME_PACKAGE_AS: dict[str, str] = {}

# Arrows against the flow that are known and left for now: (importing module, imported module)
# -> why. Each is checked to still exist, so a fixed one is removed here too. None now: keep it so.
ALLOWED_ARROWS: dict[tuple[str, str], str] = {}

# Modules that must not load the engine whatever their layer allows: the vLLM gateway and the
# Dynamo backend parse dtypes through vitpool.dtypes and reach the encoders through a pool.
NO_ENGINE_MODULES = {
    "vitpool.integrations.vllm.gateway": ("vitpool.graphs",),
    "vitpool.integrations.vllm.gateway_checks": ("vitpool.graphs",),
    "vitpool.integrations.vllm.gateway_cli": ("vitpool.graphs",),
    "vitpool.integrations.vllm.gateway_fetch": ("vitpool.graphs",),
    "vitpool.integrations.vllm.gateway_stats": ("vitpool.graphs",),
    "vitpool.integrations.dynamo": ("vitpool.graphs",),
}


@dataclass(frozen=True)
class Arrow:
    importer: str  # a module, "vitpool.pool.dispatcher"
    imported: str  # a module or package, "vitpool.transport.link"
    line: int
    lazy: bool  # inside a function, or a lazy export

    def __str__(self) -> str:
        how = " (lazy)" if self.lazy else ""
        return f"{self.importer}:{self.line} imports {self.imported}{how}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The top-level package (or module) that holds `module`; "__init__" for vitpool itself."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    return SAME_PACKAGE_AS.get(name, name)


LAYER_OF = {name: index for index, layer in enumerate(LAYERS) for name in layer}


def is_module(name: str) -> bool:
    path = PACKAGE_ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@functools.cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def lazy_exports_call(tree: ast.Module) -> tuple[dict[str, str], int]:
    """What a package exports through `lazy_exports(__name__, table)` (name -> module; the table
    as a literal or a module-level name bound to one), and the call's line; ({}, 0) if it does not."""
    tables = {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    for node in ast.walk(tree):
        is_the_call = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports"
        if is_the_call and len(node.args) == 2:
            table = node.args[1]
            if isinstance(table, ast.Name):
                table = tables.get(table.id)
            if isinstance(table, ast.Dict):
                return ast.literal_eval(table), node.lineno
    return {}, 0


@functools.cache
def lazy_exports_by_package() -> dict[str, dict[str, str]]:
    return {module: lazy_exports_call(parse(path))[0] for module, path in all_modules().items()}


def resolve(package: str, name: str) -> str:
    """What `from package import name` loads: the submodule, the module a lazy export names, or
    the package itself."""
    if is_module(f"{package}.{name}"):
        return f"{package}.{name}"
    return lazy_exports_by_package().get(package, {}).get(name, package)


def arrows_of(module: str, tree: ast.Module, is_package: bool, annotations: bool = False) -> list[Arrow]:
    """Every import of a vitpool module in `tree`, but those under `if TYPE_CHECKING:` (with
    `annotations`, those too)."""
    never_run: set[int] = set()  # ids of nodes
    inside_functions: set[int] = set()
    for node in ast.walk(tree):
        if (
            not annotations
            and isinstance(node, ast.If)
            and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        ):
            never_run.update(id(child) for statement in node.body for child in ast.walk(statement))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside_functions.update(id(child) for child in ast.walk(node) if child is not node)
    arrows = []
    for node in ast.walk(tree):
        if id(node) in never_run:
            continue
        lazy = id(node) in inside_functions
        if isinstance(node, ast.Import):
            arrows += [Arrow(module, alias.name, node.lineno, lazy) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = node.module or ""
            if node.level:  # relative to the package that holds the module (or that it is)
                parts = module.split(".")
                parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
                package = ".".join([*parts, node.module] if node.module else parts)
            arrows += [Arrow(module, resolve(package, alias.name), node.lineno, lazy) for alias in node.names]
    exports, line = lazy_exports_call(tree)
    arrows += [Arrow(module, target, line, lazy=True) for target in exports.values()]
    arrows = [
        arrow for arrow in arrows if arrow.imported == "vitpool" or arrow.imported.startswith("vitpool.")
    ]
    return list(dict.fromkeys(arrows))  # one per line and module imported


def all_arrows(annotations: bool = False) -> list[Arrow]:
    return [
        arrow
        for module, path in all_modules().items()
        for arrow in arrows_of(module, parse(path), path.name == "__init__.py", annotations)
    ]


def is_against_the_flow(arrow: Arrow) -> bool:
    importer, imported = package_of(arrow.importer), package_of(arrow.imported)
    if importer not in LAYER_OF or imported not in LAYER_OF:
        return False  # test_every_package_has_a_layer names it
    return importer != imported and LAYER_OF[imported] >= LAYER_OF[importer]


def test_every_package_has_a_layer():
    packages = {package_of(module) for module in all_modules()}
    missing = sorted(packages - LAYER_OF.keys())
    assert missing == [], f"add {', '.join(missing)} (under vitpool/) to LAYERS in {Path(__file__).name}"


def test_imports_run_down_the_layers():
    against = [
        str(arrow)
        for arrow in all_arrows()
        if is_against_the_flow(arrow) and (arrow.importer, arrow.imported) not in ALLOWED_ARROWS
    ]
    assert against == [], (
        "imports against the one-way flow (a module imports its own package and lower layers; "
        f"LAYERS in {Path(__file__).name}):\n" + "\n".join(against)
    )


def test_no_arrow_runs_back_up_not_even_for_an_annotation():
    """The house holds without exceptions: no known arrow against the flow is left, and imports
    made only for type checkers (which never run) follow the layers too."""
    assert ALLOWED_ARROWS == {}, "an arrow against the flow is a module in the wrong layer: move it instead"
    against = [str(arrow) for arrow in all_arrows(annotations=True) if is_against_the_flow(arrow)]
    assert against == [], "annotation imports against the one-way flow:\n" + "\n".join(against)


def test_allowed_arrows_still_exist():
    found = {(arrow.importer, arrow.imported) for arrow in all_arrows() if is_against_the_flow(arrow)}
    gone = sorted(set(ALLOWED_ARROWS) - found)
    assert gone == [], f"these arrows are gone or now allowed: remove them from ALLOWED_ARROWS: {gone}"


@pytest.mark.parametrize("module", sorted(NO_ENGINE_MODULES))
def test_gateway_and_dynamo_import_no_engine(module: str):
    path = all_modules()[module]
    forbidden = NO_ENGINE_MODULES[module]
    loaded = [
        str(arrow)
        for arrow in arrows_of(module, parse(path), path.name == "__init__.py")
        if arrow.imported.startswith(forbidden)
    ]
    assert loaded == [], f"{module} loads the engine (parse dtypes with vitpool.dtypes):\n" + "\n".join(
        loaded
    )


# What the checker sees, on snippets: (module, is a package, its source, the arrows: (imported, lazy)).
PARSING_CASES = [
    # a plain import, and one inside a function (lazy)
    (
        "vitpool.pool.x",
        False,
        """
        import vitpool.errors
        def f():
            import vitpool.graphs
        """,
        [("vitpool.errors", False), ("vitpool.graphs", True)],
    ),
    # under TYPE_CHECKING: never runs, not an arrow
    (
        "vitpool.pool.x",
        False,
        """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import vitpool.graphs
        """,
        [],
    ),
    # relative imports, from a module and from a package's __init__
    (
        "vitpool.transport.link",
        False,
        """
        from .wire import to_array
        from .. import specs
        """,
        [("vitpool.transport.wire", False), ("vitpool.specs", False)],
    ),
    ("vitpool.transport", True, "from .wire import to_array", [("vitpool.transport.wire", False)]),
    # a name of vitpool's lazy exports is the module that defines it
    (
        "vitpool.integrations.dynamo",
        False,
        "from vitpool import GraphEncoder, errors",
        [("vitpool.graphs", False), ("vitpool.errors", False)],
    ),
    # a package's own lazy exports are lazy imports of their modules
    (
        "vitpool.actors",
        True,
        """
        from vitpool._lazy import lazy_exports
        _NAMES = {"EncoderActor": "vitpool.actors.encoder_actor"}
        __getattr__, __dir__ = lazy_exports(__name__, _NAMES)
        """,
        [("vitpool._lazy", False), ("vitpool.actors.encoder_actor", True)],
    ),
    # other libraries are not vitpool's flow
    ("vitpool.pool.x", False, "import torch\nfrom ray import exceptions", []),
]


@pytest.mark.parametrize(("module", "is_package", "source", "expected"), PARSING_CASES)
def test_the_checker_sees_every_kind_of_import(module, is_package, source, expected):
    arrows = arrows_of(module, ast.parse(textwrap.dedent(source)), is_package)
    assert [(arrow.imported, arrow.lazy) for arrow in arrows] == expected
