"""Every module of the library holds one idea, and no file grows past the size at which one idea
stops being readable in one sitting."""

from __future__ import annotations

from pathlib import Path

MAX_LINES = 450
PACKAGE = Path(__file__).resolve().parents[2] / "vitpool"


def test_no_library_file_is_over_the_line_limit() -> None:
    lengths = {path: len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(lengths) > 100, f"found only {len(lengths)} modules under {PACKAGE}"
    too_long = {str(path.relative_to(PACKAGE.parent)): n for path, n in lengths.items() if n > MAX_LINES}
    assert not too_long, f"split these by idea (at most {MAX_LINES} lines each): {too_long}"
