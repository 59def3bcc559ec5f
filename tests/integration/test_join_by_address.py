"""Joining a Ray cluster by its address from the command line, as the default install does: a
`ray start --head` cluster with token authentication on this machine is joined with this
machine's token, and an address where nothing listens is one line at once."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, ray_env, ray_head

pytestmark = pytest.mark.ray

RAY_TEMP_ROOT = Path(os.environ["RAY_TMPDIR"]) / "token"  # tests/conftest.py made RAY_TMPDIR this run's own


def vitpool(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vitpool", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_list_by_address_joins_a_token_cluster_with_this_machines_token(tmp_path):
    token = tmp_path / "auth_token"  # this machine's token, as ~/.ray/auth_token would hold it
    token.write_text(secrets.token_hex(32))
    head = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    with ray_head(RAY_TEMP_ROOT, "--num-cpus=1", "--num-gpus=0", environment=head) as port:
        client = {**ray_env(RAY_TEMP_ROOT), "RAY_AUTH_TOKEN_PATH": str(token)}
        client.pop("RAY_AUTH_MODE")  # a user's shell: no mode set, the token file where Ray keeps it
        result = vitpool("list", "--address", f"127.0.0.1:{port}", env=client)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no pools"
    assert "with this machine's token: RAY_AUTH_MODE=token for this process" in result.stderr
    assert "InvalidAuthToken" not in result.stderr and "gcs_client" not in result.stderr


def test_list_by_an_address_where_nothing_listens_is_one_line():
    address = f"127.0.0.1:{free_port()}"
    result = vitpool("list", "--address", address, env=ray_env(RAY_TEMP_ROOT))
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"vitpool list: error: ConnectionError: nothing answers at {address}"), line
