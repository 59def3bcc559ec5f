"""Joining a Ray cluster in its authentication mode (Ray 2.60's tokens): one unauthenticated call
to the cluster's GCS tells whether it wants a token, so that a process that cannot join is told at
once what to set, and an open cluster is not joined in token mode (`vitpool.pool.cluster.join_ray`)."""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)

AUTH_PROBE_TIMEOUT_S = 3.0  # one unauthenticated call to the GCS; Ray's own connect retries for ~20 s

# Token authentication. Ray 2.60 turns it on for every new local `ray.init()` cluster, and for a
# `ray start --head` cluster where this machine has a token (~/.ray/auth_token); a cluster started
# with RAY_AUTH_MODE=disabled has none. A driver must be in the cluster's mode both ways: without
# a token a token cluster answers it with ~20 s of InvalidAuthToken retries, then a bare
# ConnectionError; in token mode it refuses an open cluster's calls to it, and every actor it
# creates dies unstarted ("cancelled before it started running"). `ray.init()` without an address
# turns token mode on wherever this machine has a token, whatever the cluster's mode.


def match_authentication(address: str) -> str:
    """Before joining the cluster at `address`, put this process in the cluster's authentication
    mode, or say at once what to set. Returns a note for the reason the cluster was joined where
    this process now sends this machine's token, else "". One call to the cluster without a
    token tells its mode:

    - it answers: the cluster is open. RAY_AUTH_MODE unset: set it to "disabled" for this
      process (Ray would turn token mode on by itself); set to "token": raise.
    - it refuses the call: the cluster wants a token. RAY_AUTH_MODE=token: the token this
      process sends must be accepted. Unset, on a cluster on this machine that takes this
      machine's token (the one `ray start` used): turn token mode on for this process, as
      `ray.init()` without an address would. Else raise. This machine's token is never sent
      to a cluster elsewhere unless RAY_AUTH_MODE=token says so.
    - no answer in AUTH_PROBE_TIMEOUT_S (or TLS, or Ray's stubs moved), or Kubernetes token
      authentication here: Ray's own connect decides.

    Raises:
        ConnectionError: nothing listens at `address`, or this process cannot be put in the
            cluster's mode (one line saying what to set).
    """
    mode = (os.environ.get("RAY_AUTH_MODE") or "").lower() or None
    kubernetes_tokens = os.environ.get("RAY_ENABLE_K8S_TOKEN_AUTH", "").lower() in ("1", "true")
    if kubernetes_tokens or mode not in (None, "token", "disabled"):
        return ""  # not a mode this check knows (Kubernetes tokens are not in Ray's token file)
    is_open = _gcs_accepts(address, {})
    if is_open is None:
        return ""
    if is_open:
        if mode == "token":
            raise ConnectionError(
                f"the Ray cluster at {address} does not use token authentication, but RAY_AUTH_MODE=token "
                "here, so this process would refuse the cluster's calls and its actors would die unstarted: "
                "unset RAY_AUTH_MODE (or set it to disabled), or join a cluster started with token "
                "authentication"
            )
        if mode is None:
            _set_authentication_mode("disabled")
            logger.debug(
                "the Ray cluster at %s does not use token authentication: RAY_AUTH_MODE=disabled here",
                address,
            )
        return ""
    where = "RAY_AUTH_TOKEN, or the file RAY_AUTH_TOKEN_PATH names (default ~/.ray/auth_token)"
    if mode == "token":
        header = _local_token_header()
        if header and _gcs_accepts(address, header) is not False:
            return ""
        problem = (
            "refused this process's authentication token"
            if header
            else ("uses token authentication, and this process has no token (RAY_AUTH_MODE=token)")
        )
        raise ConnectionError(
            f"the Ray cluster at {address} {problem}: put that cluster's token (`ray get-auth-token` "
            f"on its head node) in {where}"
        )
    if mode is None and _runs_on_this_machine(address):
        header = _local_token_header()
        if header and _gcs_accepts(address, header):
            _set_authentication_mode("token")
            return "; with this machine's token: RAY_AUTH_MODE=token for this process"
    raise ConnectionError(
        f"the Ray cluster at {address} uses token authentication and this process sends no token "
        f"(RAY_AUTH_MODE is {mode or 'unset'}): set RAY_AUTH_MODE=token, with the cluster's token in {where}"
    )


def _check_something_listens(address: str) -> None:
    """ConnectionError at once where no process accepts a connection at `address` (host:port):
    Ray's own connect would retry for minutes. Addresses of another form are left to Ray."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=AUTH_PROBE_TIMEOUT_S).close()
    except OSError as error:
        reason = "no answer" if isinstance(error, TimeoutError) else (error.strerror or type(error).__name__)
        raise ConnectionError(
            f"nothing answers at {address} ({reason}): no Ray cluster listens there; check the address "
            "(a head node's GCS port, 6379 by default) or start one with `ray start --head`"
        ) from None


def _local_token_header() -> dict[str, str]:
    """The token Ray would send (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) as a
    gRPC header, whatever RAY_AUTH_MODE says; empty where there is none."""
    try:
        from ray._raylet import AuthenticationTokenLoader

        loader = AuthenticationTokenLoader.instance()
    except Exception as error:  # noqa: BLE001 - Ray's token loader moved: behave as without a token
        logger.debug("could not read Ray's authentication token: %s", error)
        return {}
    try:
        return dict(loader.get_token_for_http_header(ignore_auth_mode=True))
    finally:
        # A token left in the loader's cache makes this process check one on every call the
        # cluster makes to it, whatever the mode: an open cluster's actors would die unstarted.
        loader.reset_cache()


def _gcs_accepts(address: str, header: dict[str, str]) -> bool | None:
    """Whether the GCS at `address` answers a call that carries `header`: True; False where it
    refuses it as unauthenticated; None where it could not be asked (no answer in time, TLS,
    Ray's generated stubs moved); ConnectionError where nothing listens there."""
    _check_something_listens(address)
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError as error:  # grpcio is a dependency; an install without it loses only this check
        logger.warning(
            "cannot ask the Ray cluster at %s whether it wants a token (%s; `pip install grpcio`): "
            "Ray's own connect decides, and a refusal takes it about 20 s",
            address,
            error,
        )
        return None
    with grpc.insecure_channel(address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(),
                timeout=AUTH_PROBE_TIMEOUT_S,
                metadata=list(header.items()) or None,
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                return False
            logger.debug("the Ray cluster at %s did not answer: %s", address, error.code())
            return None
    return True


def _runs_on_this_machine(address: str) -> bool:
    """Whether `address` is the GCS of a cluster running on this machine (by its port, reached
    by this machine's name, its address or a loopback address)."""
    try:
        from ray._private import services

        running = services.find_gcs_addresses()
        host, _, port = address.rpartition(":")
        ip = socket.gethostbyname(host)
        for candidate in running:
            candidate_host, _, candidate_port = str(candidate).rpartition(":")
            if candidate_port == port and (
                ip.startswith("127.") or ip == socket.gethostbyname(candidate_host)
            ):
                return True
    except Exception as error:  # noqa: BLE001 - unresolvable name, Ray's helper moved: not known to be here
        logger.debug("could not tell whether %s runs on this machine: %s", address, error)
    return False


def _set_authentication_mode(mode: str) -> None:
    """RAY_AUTH_MODE for this process (and its children), as `ray.init()` sets it itself."""
    os.environ["RAY_AUTH_MODE"] = mode
    try:
        from ray._raylet import Config

        Config.initialize("")  # Ray caches its configuration: read RAY_AUTH_MODE again
    except Exception as error:  # noqa: BLE001 - Ray moved it: the variable alone is read at ray.init
        logger.debug("could not refresh Ray's configuration: %s", error)
