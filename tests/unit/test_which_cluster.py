"""Which Ray cluster a launch or connect joins, and why, without a cluster: `join_ray`'s record of
the cluster and its reason, the errors that name it (no pool found, a controller that died as the
pool started, an actor that never started), and the authentication check that puts this process
in the cluster's mode or fails at once with what to set (tried against a small gRPC server that
answers as a GCS does)."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
import pytest
import ray
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

from vitpool.errors import PoolUnavailableError, VitpoolError
from vitpool.pool import cluster, launcher, ray_auth
from vitpool.pool.cluster import JoinedCluster
from vitpool.pool.settings import PoolSettings
from vitpool.pool.start_errors import start_failure

GCS = "10.0.0.1:6379"
TOKEN_HEADER = {"authorization": "Bearer right"}
MATCH_AUTHENTICATION = cluster.match_authentication  # the fixture below stands it in


class FakeContext:
    gcs_address = GCS


@pytest.fixture
def fake_ray(monkeypatch):
    """Ray not initialised; `ray.init` records its address and joins `GCS`; no authentication check."""
    calls = []
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(cluster.ray, "init", lambda address=None: calls.append(address))
    monkeypatch.setattr(cluster.ray, "get_runtime_context", lambda: FakeContext())
    monkeypatch.setattr(cluster, "match_authentication", lambda address: "")
    monkeypatch.setattr(cluster, "_last_joined", None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


# ---- which cluster, and why ----

ADDRESS_FILE = cluster._address_file()

JOIN_CASES = [
    # (address argument, RAY_ADDRESS, cluster in the address file, what ray.init gets, the reason)
    # an argument wins over RAY_ADDRESS, and says so
    (GCS, "10.0.0.2:6379", None, GCS, "from the address argument"),
    # RAY_ADDRESS where no argument is given
    (None, GCS, None, GCS, "from RAY_ADDRESS"),
    # the cluster `ray start` last started here: Ray's own lookup, and the file that named it
    (None, None, GCS, None, f"from {ADDRESS_FILE}, the cluster last started on this machine"),
    # nothing runs here: a new local cluster
    (None, None, None, "local", "a new local cluster for this process: none runs here"),
    # asked for by name
    ("local", None, GCS, "local", "a new local cluster for this process (address='local')"),
]


@pytest.mark.parametrize("address, ray_address, local, init_address, reason", JOIN_CASES)
def test_join_ray_says_which_cluster_it_joined_and_why(
    fake_ray, monkeypatch, caplog, address, ray_address, local, init_address, reason
):
    if ray_address:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    monkeypatch.setattr(cluster, "running_local_cluster", lambda: local)
    with caplog.at_level(logging.INFO, logger="vitpool"):
        joined = cluster.join_ray(address)
    assert fake_ray == [init_address]
    assert joined.address == GCS and joined.reason.startswith(reason) and joined.connected_here
    assert cluster.last_joined() == joined
    assert f"Ray cluster at {GCS} ({joined.reason})" in caplog.messages


def test_an_already_connected_process_keeps_the_reason_it_joined_for(fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", GCS)
    first = cluster.join_ray(None)
    again = cluster.join_ray("10.0.0.9:6379")  # Ray is initialised: the argument cannot apply
    assert (again.address, again.reason, again.connected_here) == (GCS, "from RAY_ADDRESS", False)
    assert first.connected_here


def test_a_failed_connect_names_the_cluster_and_why_it_was_chosen(fake_ray, monkeypatch):
    def refuse(address=None):
        raise ConnectionError("Failed to connect to Ray cluster\nmore lines")

    monkeypatch.setattr(cluster.ray, "init", refuse)
    monkeypatch.setenv("RAY_ADDRESS", GCS)
    with pytest.raises(ConnectionError) as raised:
        cluster.join_ray(None)
    assert str(raised.value) == (
        f"could not join the Ray cluster at {GCS} (from RAY_ADDRESS): Failed to connect to Ray cluster"
    )


# ---- errors that name the cluster ----

FROM_THE_FILE = JoinedCluster(GCS, f"from {ADDRESS_FILE}, the cluster last started on this machine", True)


def test_no_pool_found_names_the_cluster_looked_in_and_how_to_look_in_another(monkeypatch):
    monkeypatch.setattr(launcher, "join_ray", lambda address: FROM_THE_FILE)
    monkeypatch.setattr(launcher.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(
        launcher.ray, "get_actor", lambda name, namespace: (_ for _ in ()).throw(ValueError(name))
    )
    shutdowns = []
    monkeypatch.setattr(launcher.ray, "shutdown", lambda: shutdowns.append(True))
    with pytest.raises(PoolUnavailableError) as raised:
        launcher.find_pool("encoders", None, 1.0)
    assert str(raised.value).startswith(
        f"no pool named 'encoders' in the Ray cluster at {GCS} (from {ADDRESS_FILE}, "
        "the cluster last started on this machine); pass address= (--address) or set RAY_ADDRESS to look "
        "in another"
    )
    assert shutdowns == [True]  # what the lookup joined, it leaves


def test_no_pool_found_by_an_already_connected_process_says_to_disconnect_first(monkeypatch):
    joined = JoinedCluster(GCS, "this process was already connected to it", connected_here=False)
    monkeypatch.setattr(launcher, "join_ray", lambda address: joined)
    monkeypatch.setattr(launcher.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(
        launcher.ray, "get_actor", lambda name, namespace: (_ for _ in ()).throw(ValueError(name))
    )
    with pytest.raises(PoolUnavailableError, match=r"already connected to it: call ray.shutdown\(\) first"):
        launcher.find_pool("encoders", None, 1.0)


class FakeController:
    """A controller handle whose every method returns a reference that `ray.get` turns into `error`."""

    def __getattr__(self, name):
        return type("Method", (), {"remote": staticmethod(lambda *args: name)})()


def test_a_controller_that_dies_as_the_pool_starts_is_one_error_naming_the_cluster(monkeypatch):
    died = ray.exceptions.ActorDiedError()  # "The actor died unexpectedly before finishing this task."
    stopped, shutdowns = [], []
    monkeypatch.setattr(launcher, "join_ray", lambda address: FROM_THE_FILE)
    monkeypatch.setattr(launcher, "checked_model_directory", lambda model, joins: model)
    monkeypatch.setattr(launcher, "joins_a_cluster", lambda address: True)
    monkeypatch.setattr(launcher, "cluster_gpus", lambda: 0.0)
    monkeypatch.setattr(launcher, "check_capacity", lambda options, num_actors: None)
    monkeypatch.setattr(launcher, "check_device", lambda device, options, gpus: None)
    monkeypatch.setattr(launcher, "check_family", lambda model, modules: None)
    monkeypatch.setattr(launcher, "family_modules_for_actors", lambda options: ())
    monkeypatch.setattr(launcher, "default_threads", lambda options, num_actors: 1)
    monkeypatch.setattr(launcher, "stop_controller", stopped.append)
    monkeypatch.setattr(launcher.ray, "shutdown", lambda: shutdowns.append(True))
    monkeypatch.setattr(launcher.ray, "is_initialized", lambda: True)
    controller = FakeController()
    remote_class = type(
        "Remote",
        (),
        {
            "options": lambda self, **options: type(
                "Options", (), {"remote": lambda self, *args: controller}
            )()
        },
    )()
    monkeypatch.setattr(launcher.ray, "remote", lambda **options: lambda cls: remote_class)

    def get(ref, timeout=None):
        raise died

    monkeypatch.setattr(launcher.ray, "get", get)
    with pytest.raises(VitpoolError) as raised:
        launcher.launch_pool(PoolSettings(device="cpu"), 1, "encoders", None, {"num_gpus": 0}, None)
    assert str(raised.value) == (
        f"the pool's controller died before the pool was ready, in the Ray cluster at {GCS} "
        f"(from {ADDRESS_FILE}, the cluster last started on this machine): ActorDiedError: "
        "The actor died unexpectedly before finishing this task; pass address= (--address) or set "
        "RAY_ADDRESS to launch in another"
    )
    assert raised.value.__cause__ is died
    assert stopped == [controller] and shutdowns == [True]  # nothing the launch started is left


def test_an_encoder_actor_that_never_started_names_the_cluster():
    died = ray.exceptions.ActorDiedError()
    error = start_failure([(0, died)], 1, str(FROM_THE_FILE), "pass address= to launch in another")
    assert type(error) is VitpoolError and error.__cause__ is died
    assert str(error) == (
        f"encoder actor 0 failed to start in the Ray cluster at {GCS} (from {ADDRESS_FILE}, the cluster last "
        "started on this machine): ActorDiedError: The actor died unexpectedly before finishing this task; "
        "pass address= to launch in another"
    )


# ---- authentication: this process in the cluster's mode, or one line saying what to set ----


class Answers:
    """What a cluster answers a call without a token, and with this machine's token."""

    def __init__(self, without_token: bool | None, with_token: bool | None = None) -> None:
        self.answers = {False: without_token, True: with_token}
        self.headers: list[dict] = []

    def __call__(self, address: str, header: dict) -> bool | None:
        self.headers.append(header)
        return self.answers[bool(header)]


OPEN, WANTS_TOKEN, UNREACHABLE = Answers(True, True), Answers(False, True), Answers(None, None)

AUTH_CASES = [
    # (the cluster's answers, RAY_AUTH_MODE here, cluster on this machine, RAY_AUTH_MODE after, error)
    # an open cluster: never joined in token mode (Ray's lookup would turn it on where a token exists)
    (OPEN, None, True, "disabled", None),
    (OPEN, "disabled", True, "disabled", None),
    (OPEN, "token", True, "token", "does not use token authentication, but RAY_AUTH_MODE=token here"),
    # a token cluster on this machine that takes this machine's token: joined with it
    (WANTS_TOKEN, None, True, "token", None),
    # ... elsewhere: this machine's token is not offered
    (
        WANTS_TOKEN,
        None,
        False,
        None,
        "uses token authentication and this process sends no token (RAY_AUTH_MODE is unset)",
    ),
    (
        WANTS_TOKEN,
        "disabled",
        True,
        "disabled",
        "sends no token (RAY_AUTH_MODE is disabled): set RAY_AUTH_MODE=token",
    ),
    (WANTS_TOKEN, "token", False, "token", None),
    (Answers(False, False), "token", False, "token", "refused this process's authentication token"),
    # token mode, but no token to send
    (Answers(False, None), "token", False, "token", "this process has no token (RAY_AUTH_MODE=token): put"),
    # a token this machine has, but not the cluster's
    (Answers(False, False), None, True, None, "sends no token (RAY_AUTH_MODE is unset)"),
    # no answer: Ray's own connect decides
    (UNREACHABLE, None, False, None, None),
]


@pytest.mark.parametrize("answers, mode, on_this_machine, mode_after, error", AUTH_CASES)
def test_authentication_matches_the_cluster_or_says_what_to_set(
    monkeypatch, answers, mode, on_this_machine, mode_after, error
):
    answers.headers.clear()
    if mode is None:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
    monkeypatch.setattr(ray_auth, "_gcs_accepts", answers)
    has_token = answers.answers[True] is not None
    monkeypatch.setattr(ray_auth, "_local_token_header", lambda: dict(TOKEN_HEADER) if has_token else {})
    monkeypatch.setattr(ray_auth, "_runs_on_this_machine", lambda address: on_this_machine)
    monkeypatch.setattr(
        ray_auth, "_set_authentication_mode", lambda value: monkeypatch.setenv("RAY_AUTH_MODE", value)
    )
    if error is None:
        note = ray_auth.match_authentication(GCS)
        # the reason the cluster was joined says where this machine's token went
        assert ("with this machine's token" in note) == (mode is None and mode_after == "token")
    else:
        with pytest.raises(ConnectionError, match=error.replace("(", r"\(").replace(")", r"\)")) as raised:
            ray_auth.match_authentication(GCS)
        assert "\n" not in str(raised.value) and str(raised.value).startswith(f"the Ray cluster at {GCS} ")
    assert cluster.os.environ.get("RAY_AUTH_MODE") == mode_after
    if mode != "token" and not on_this_machine:
        assert all(not header for header in answers.headers)  # this machine's token stays here


def test_kubernetes_token_authentication_is_left_to_ray(monkeypatch):
    """Its tokens are not in Ray's token file: asking the cluster with that file's would mislead."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_ENABLE_K8S_TOKEN_AUTH", "true")
    answers = Answers(False, False)
    monkeypatch.setattr(ray_auth, "_gcs_accepts", answers)
    assert ray_auth.match_authentication(GCS) == "" and answers.headers == []


def test_a_token_cluster_at_an_explicit_address_fails_before_ray_init(fake_ray, monkeypatch):
    """Ray's own connect would retry for ~20 s, printing InvalidAuthToken, then raise a bare
    ConnectionError."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setattr(cluster, "match_authentication", MATCH_AUTHENTICATION)
    monkeypatch.setattr(ray_auth, "_gcs_accepts", Answers(False, True))
    monkeypatch.setattr(ray_auth, "_local_token_header", dict)
    monkeypatch.setattr(ray_auth, "_runs_on_this_machine", lambda address: True)
    with pytest.raises(ConnectionError, match="set RAY_AUTH_MODE=token"):
        cluster.join_ray(GCS)
    assert fake_ray == []  # ray.init never ran


def test_joining_with_this_machines_token_says_so_in_the_reason(fake_ray, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setattr(cluster, "match_authentication", MATCH_AUTHENTICATION)
    monkeypatch.setattr(ray_auth, "_gcs_accepts", Answers(False, True))
    monkeypatch.setattr(ray_auth, "_local_token_header", lambda: dict(TOKEN_HEADER))
    monkeypatch.setattr(ray_auth, "_runs_on_this_machine", lambda address: True)
    monkeypatch.setattr(
        ray_auth, "_set_authentication_mode", lambda value: monkeypatch.setenv("RAY_AUTH_MODE", value)
    )
    joined = cluster.join_ray(GCS)
    assert str(joined) == (
        f"Ray cluster at {GCS} (from the address argument; with this machine's token: RAY_AUTH_MODE=token "
        "for this process)"
    )


def test_reading_the_token_leaves_it_out_of_rays_cache(monkeypatch):
    """A token left in Ray's loader makes this process check one on the cluster's calls, whatever
    the mode: an open cluster's actors would die unstarted ("cancelled before it started running")."""
    events = []

    class FakeLoader:
        @staticmethod
        def instance():
            return FakeLoader()

        def get_token_for_http_header(self, ignore_auth_mode=False):
            events.append(("read", ignore_auth_mode))
            return dict(TOKEN_HEADER)

        def reset_cache(self):
            events.append(("reset",))

    monkeypatch.setattr(ray._raylet, "AuthenticationTokenLoader", FakeLoader)
    assert ray_auth._local_token_header() == TOKEN_HEADER
    assert events == [("read", True), ("reset",)]


# ---- the probe itself, against a gRPC server that answers as a GCS does ----


class FakeGcs(gcs_service_pb2_grpc.NodeInfoGcsServiceServicer):
    """Answers GetClusterId; with `token`, only a call carrying it (as Ray's GCS in token mode)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def GetClusterId(self, request, context):
        sent = dict(context.invocation_metadata()).get("authorization")
        if self.token is not None and sent != f"Bearer {self.token}":
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "InvalidAuthToken: Authentication token is missing or incorrect",
            )
        return gcs_service_pb2.GetClusterIdReply()


@pytest.fixture
def fake_gcs():
    servers = []

    def start(token: str | None) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        gcs_service_pb2_grpc.add_NodeInfoGcsServiceServicer_to_server(FakeGcs(token), server)
        port = server.add_insecure_port("127.0.0.1:0")  # any free port
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(grace=None)


def test_the_probe_tells_an_open_cluster_from_one_that_wants_a_token(fake_gcs):
    open_cluster, token_cluster = fake_gcs(None), fake_gcs("right")
    assert ray_auth._gcs_accepts(open_cluster, {}) is True
    assert ray_auth._gcs_accepts(token_cluster, {}) is False
    assert ray_auth._gcs_accepts(token_cluster, {"authorization": "Bearer wrong"}) is False
    assert ray_auth._gcs_accepts(token_cluster, TOKEN_HEADER) is True


def test_the_probe_leaves_a_cluster_it_cannot_ask_to_ray(monkeypatch):
    """Something listens but gives no gRPC answer in time (TLS, a proxy, a slow head): Ray decides."""
    import socket

    monkeypatch.setattr(ray_auth, "AUTH_PROBE_TIMEOUT_S", 0.5)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert ray_auth._gcs_accepts(f"127.0.0.1:{listener.getsockname()[1]}", {}) is None


def test_an_address_where_nothing_listens_is_one_error_at_once():
    """Ray's own connect would retry there for minutes; the check says so in one line."""
    import socket
    import time

    with socket.socket() as probe:  # a port that was free a moment ago, closed again
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"nothing answers at {address}") as error:
        ray_auth.match_authentication(address)
    assert time.monotonic() - start < ray_auth.AUTH_PROBE_TIMEOUT_S + 1
    assert "\n" not in str(error.value) and "ray start --head" in str(error.value)
