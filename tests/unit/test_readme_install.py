"""The README's install section gives what its own snippets import: the processor snippets need
Pillow, which only the `processors` extra installs."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_the_install_section_installs_what_the_processor_snippets_import():
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Install and a first encode", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^pip install .*$", install, flags=re.MULTILINE)
    extras = {
        extra
        for command in commands
        for group in re.findall(r"\[([a-z0-9_,]+)\]", command)
        for extra in group.split(",")
    }
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    if "from PIL import" in readme:
        assert any(dep.lower().startswith("pillow") for extra in extras for dep in declared.get(extra, ())), (
            f"the install section's extras {sorted(extras)} leave out Pillow, "
            "which the README's snippets import"
        )
