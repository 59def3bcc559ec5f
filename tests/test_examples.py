"""The README's main command runs and prints one line per item."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_encode_example_runs():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "encode.py"), "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines[:4]] == ["Image", "Image", "Video", "Image"]
    assert "tokens (196, 128)" in lines[2]  # 4 x 14 x 14 patches / 4
    assert lines[-1].startswith("graph items 0, eager items 4")
