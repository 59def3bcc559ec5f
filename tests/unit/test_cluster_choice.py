"""Which cluster a launch counts as joining, and an address file another user's `ray start` left."""

from __future__ import annotations

import logging
import types

import pytest

from vitpool.pool import cluster


@pytest.mark.parametrize(
    "address, env, local, joins",
    [
        (None, None, None, False),  # nothing runs: a private cluster
        (None, None, "10.0.0.1:6379", True),  # the running `ray start` cluster
        ("local", None, "10.0.0.1:6379", False),  # asked for a private one beside it
        (None, "local", "10.0.0.1:6379", False),  # RAY_ADDRESS=local too
        (None, "10.0.0.2:6379", None, True),
        ("10.0.0.3:6379", "local", None, True),  # the argument wins
    ],
)
def test_a_launch_joins_the_cluster_its_address_names(monkeypatch, address, env, local, joins):
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster, "running_local_cluster", lambda: local)
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    assert cluster.joins_a_cluster(address) is joins


def test_a_process_already_connected_joins_a_cluster_only_of_several_nodes(monkeypatch):
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: True)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")  # the connection, not the variable, decides
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [{"Alive": True}, {"Alive": False}])
    assert cluster.joins_a_cluster(None) is False
    monkeypatch.setattr(cluster.ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    assert cluster.joins_a_cluster(None) is True


def test_another_users_address_file_is_not_followed(monkeypatch, caplog):
    from ray._private import services, utils

    monkeypatch.setattr(utils, "read_ray_address", lambda: "127.0.0.1:6379")
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: ["127.0.0.1:6379"])
    monkeypatch.setattr(
        cluster.os, "stat", lambda path: types.SimpleNamespace(st_uid=cluster.os.getuid() + 1)
    )
    with caplog.at_level(logging.WARNING, logger="vitpool.pool.cluster"):
        assert cluster.running_local_cluster() is None
    assert "another user" in caplog.text and "RAY_ADDRESS" in caplog.text
    monkeypatch.setattr(cluster.os, "stat", lambda path: types.SimpleNamespace(st_uid=cluster.os.getuid()))
    assert cluster.running_local_cluster() == "127.0.0.1:6379"
