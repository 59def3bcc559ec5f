"""Which transformers releases vitpool's adapters are tested on, and the error for one they do not fit.

Adapters reuse Hugging Face's towers and weights, and pass every grid-dependent tensor in through
the keywords `transformers.vision_utils` defines. Where an adapter runs a tower's parts itself
(one function per family, its compatibility seam), the parts it needs are checked when the
adapter is built, so a release that renames them fails there with the version named, instead of
deep inside a capture.
"""

from __future__ import annotations

import importlib.metadata
import operator
from collections.abc import Sequence

import torch

from vitpool.errors import ConfigError


def tested_transformers() -> str:
    """The transformers requirement vitpool declares (pyproject.toml; `nox -s bounds` runs the
    suite on both its bounds), e.g. "transformers<=5.24.0,>=5.17.0"."""
    try:
        for requirement in importlib.metadata.requires("vitpool") or []:
            if requirement.startswith("transformers"):
                return requirement.split(";")[0].strip()
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        pass
    return "the transformers range in vitpool's pyproject.toml"


def installed_transformers() -> str:
    import transformers

    return transformers.__version__


def incompatible(family: str, what: str) -> ConfigError:
    """The error for a tower whose Hugging Face code no longer has what the adapter uses."""
    tested = tested_transformers()
    return ConfigError(
        f"{family}: transformers {installed_transformers()} changed the tower's code ({what}); vitpool "
        f"is tested with {tested}: pip install '{tested}'"
    )


def require_transformers(family: str, minimum: str, why: str) -> None:
    """A family whose Hugging Face code is usable only from a later release than the range's
    lower bound: ConfigError where the installed transformers is older than `minimum`."""
    from packaging.version import Version

    installed = installed_transformers()
    if Version(installed) < Version(minimum):
        raise ConfigError(
            f"{family} needs transformers>={minimum} ({why}); transformers {installed} is installed: "
            f"pip install 'transformers>={minimum}'"
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
