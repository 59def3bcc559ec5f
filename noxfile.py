"""The test suite against a chosen transformers release, each in a throw-away virtual environment.

    nox -s bounds                       # the lower and the upper bound pyproject.toml declares
    nox -s "bounds(bound='lower')"      # one of them
    nox -s transformers -- 5.21.0       # any release; arguments after the version go to pytest
    nox -s transformers -- 5.24.0 tests/unit -x

Each session installs the CPU build of torch that CI pins (a plain `torch` would pull the CUDA
build), the project with its test extra, then exactly that transformers, and runs the suite.
"""

from __future__ import annotations

import re
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.sessions = ["bounds"]

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"  # what .ci/run installs on a CPU machine


def declared_bounds() -> dict[str, str]:
    """The lower and upper transformers bound of pyproject.toml's dependencies
    (`transformers>=A,<=B`)."""
    [spec] = re.findall(r'"(transformers[^"]*)"', (ROOT / "pyproject.toml").read_text())
    lower = re.search(r">=\s*([\w.]+)", spec)
    upper = re.search(r"<=\s*([\w.]+)", spec)
    if not lower or not upper:
        raise ValueError(f"pyproject.toml's {spec!r} should read transformers>=LOWER,<=UPPER")
    return {"lower": lower.group(1), "upper": upper.group(1)}


def run_suite(session: nox.Session, version: str, pytest_args: list[str]) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]", f"transformers=={version}")
    session.run(
        "python",
        "-c",
        "import transformers, torch; print('transformers', transformers.__version__, "
        "'torch', torch.__version__)",
    )
    session.run("python", "-m", "pytest", "-q", *(pytest_args or []))


@nox.session
@nox.parametrize("bound", ["lower", "upper"])
def bounds(session: nox.Session, bound: str) -> None:
    """The suite on one bound of the declared transformers range."""
    run_suite(session, declared_bounds()[bound], session.posargs)


@nox.session
def transformers(session: nox.Session) -> None:
    """The suite on the transformers release given as the first argument."""
    if not session.posargs:
        session.error("name a transformers release: nox -s transformers -- 5.21.0 [pytest arguments]")
    version, *pytest_args = session.posargs
    run_suite(session, version, pytest_args)
