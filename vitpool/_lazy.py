"""Public names that load on first use. A package's `__init__` maps each name it exports to the
module that defines it, so importing the package imports none of them: `import vitpool` loads no
torch, `vitpool.pool.policy` imports without Ray, a caller unpickles item rules without transformers.

    _NAMES = {"EncoderPool": "vitpool.pool.encoder_pool", ...}
    __getattr__, __dir__ = lazy_exports(__name__, _NAMES)

tests/unit/test_import_flow.py reads these tables as the package's (lazy) imports.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    module_name: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` (PEP 562) of the module `module_name`.

    Args:
        module_name: the exporting module's `__name__`.
        names: each exported name -> the module that defines it under that name.

    Returns:
        `__getattr__`, which imports a name's module when the name is first read (AttributeError
        for a name not in `names`), and `__dir__`, the module's globals and `names`.
    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return getattr(importlib.import_module(names[name]), name)

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[module_name]), *names})

    return __getattr__, __dir__
