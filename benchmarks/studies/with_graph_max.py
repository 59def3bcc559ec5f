"""Run a benchmark script with the GPU ladder's top (`GRAPH_MAX_TOKENS`) set, before any encoder is
built: the same tree timed with two ladders in one session.

    cd benchmarks && python studies/with_graph_max.py 1024 size_sweep.py --sides 896,1120 --runs 20
"""

from __future__ import annotations

import runpy
import sys

from vitpool.graphs import defaults

if __name__ == "__main__":
    defaults.GRAPH_MAX_TOKENS = int(sys.argv[1])
    sys.argv = sys.argv[2:]
    sys.path.insert(0, ".")
    runpy.run_path(sys.argv[0], run_name="__main__")
