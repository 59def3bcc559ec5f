"""A pool's callers load no engine: no transformers, no modeling code, no graphs."""

from __future__ import annotations

import subprocess
import sys

ENGINE_MODULES = (
    "transformers",
    "vitpool.graphs",
    "vitpool.models.loading",
    "vitpool.families.qwen3_vl.adapter",
    "vitpool.actors.encoder_actor",
)


def engine_modules_loaded_by(code: str) -> list[str]:
    check = (
        f"{code}\nimport sys\n"
        f"print(','.join(sorted(m for m in sys.modules if m.startswith({ENGINE_MODULES!r}))))"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    return [name for name in result.stdout.strip().split(",") if name]


def test_the_caller_side_imports_no_engine():
    code = (
        "import vitpool\n"
        "from vitpool import EncoderPool, Image, Video, Embedding, PoolSettings, InvalidItemError\n"
        "from vitpool import received_embeddings, decode_request, encode_results\n"
        "import vitpool.pool.encoder_pool, vitpool.pool.dispatcher, vitpool.actors.reports\n"
        "import vitpool.rules.grids\n"
    )
    assert engine_modules_loaded_by(code) == []


def test_the_engine_loads_when_used():
    assert "vitpool.graphs" in engine_modules_loaded_by("from vitpool import GraphEncoder")
