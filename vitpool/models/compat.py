"""Which transformers releases vitpool's adapters are tested on, and the error for one they do not fit.

Adapters reuse Hugging Face's towers and weights, and pass every grid-dependent tensor in through
the keywords `transformers.vision_utils` defines. Where an adapter runs a tower's parts itself
(one function per family, its compatibility seam), the parts it needs are checked when the
adapter is built, so a release that renames them fails there with the version named, instead of
deep inside a capture.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from vitpool.errors import ConfigError

# The range pyproject.toml declares and `nox -s bounds` runs the suite on.
TESTED_TRANSFORMERS = ("5.17.0", "5.24.0")


def installed_transformers() -> str:
    import transformers

    return transformers.__version__


def incompatible(family: str, what: str) -> ConfigError:
    """The error for a tower whose Hugging Face code no longer has what the adapter uses."""
    lower, upper = TESTED_TRANSFORMERS
    return ConfigError(
        f"{family}: transformers {installed_transformers()} changed the tower's code ({what}); vitpool "
        f"is tested with transformers {lower} to {upper}: install one of those "
        f"(pip install 'transformers>={lower},<={upper}')"
    )


def check_tower_parts(family: str, tower: torch.nn.Module, parts: Sequence[str]) -> None:
    """Raise `incompatible` unless `tower` has every dotted attribute in `parts`.

    Raises:
        ConfigError: a part is missing.
    """
    for part in parts:
        try:
            operator.attrgetter(part)(tower)
        except AttributeError:
            raise incompatible(family, f"{type(tower).__name__} has no {part!r}") from None
