"""Every benchmark script imports on a CPU machine without starting anything: a name a script
takes from vitpool that moved fails here, in CI, not in the next GPU run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# Run in a fresh interpreter: the scripts put their folder on sys.path and may set up logging.
_IMPORT_ALL = """
import importlib.util, json, sys, traceback
from pathlib import Path

benchmarks = Path(sys.argv[1])
sys.path[:0] = [str(benchmarks), str(benchmarks / "studies")]
failures = {}
for path in sys.argv[2:]:
    path = Path(path)
    name = "vitpool_benchmark_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        failures[str(path.relative_to(benchmarks))] = traceback.format_exc(limit=3)
print(json.dumps(failures))
"""


def benchmark_scripts() -> list[Path]:
    return sorted([*BENCHMARKS.glob("*.py"), *(BENCHMARKS / "studies").glob("*.py")])


def test_there_are_benchmark_scripts_to_import():
    names = {path.name for path in benchmark_scripts()}
    assert {"pool_throughput.py", "size_sweep.py", "call_phases.py", "common.py"} <= names


def test_every_benchmark_script_imports_without_running():
    scripts = [str(path) for path in benchmark_scripts()]
    finished = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, str(BENCHMARKS), *scripts],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    # a script that runs at import time prints: only the JSON line may come out
    *printed, last = finished.stdout.strip().splitlines() or [""]
    failures = json.loads(last)
    assert failures == {}, "\n".join(f"{name}:\n{error}" for name, error in failures.items())
    assert printed == [], f"scripts printed while imported: {printed[:5]}"
