"""Run a benchmark script with one module constant of vitpool set, before any encoder is built: the
same tree timed with two settings in one session (e.g. which budgets get a few-sequence variant).

    cd benchmarks && python studies/with_constant.py vitpool.packing.budgets.FEW_SEQUENCES_FROM_TOKENS 0 \
        size_sweep.py --sides 224,448 --runs 30
"""

from __future__ import annotations

import ast
import importlib
import logging
import runpy
import sys

logger = logging.getLogger(__name__)

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    target, value = sys.argv[1], ast.literal_eval(sys.argv[2])
    module_name, name = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"{module_name} has no {name}")
    logger.info("%s: %r -> %r", target, getattr(module, name), value)
    setattr(module, name, value)
    sys.argv = sys.argv[3:]
    sys.path.insert(0, ".")
    runpy.run_path(sys.argv[0], run_name="__main__")
