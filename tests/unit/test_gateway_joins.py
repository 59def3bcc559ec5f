"""The vLLM gateway and the Dynamo backend join Ray as the pool does (`join_ray`), without a
cluster: a cluster that wants an authentication token this process does not send (Ray 2.60's
`ray start --head`) stops them at once with one line saying what to set, never Ray's own ~20 s
of InvalidAuthToken retries (tried against a small gRPC server that answers as a GCS in token
mode does); a pool the gateway launches runs in the LLM's dtype."""

from __future__ import annotations

import sys
import types
from concurrent import futures

import grpc
import pytest
import ray
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

from vitpool.pool import cluster, ray_auth


class TokenGcs(gcs_service_pb2_grpc.NodeInfoGcsServiceServicer):
    """Answers GetClusterId only to a call carrying the token, as Ray's GCS in token mode."""

    def GetClusterId(self, request, context):
        if dict(context.invocation_metadata()).get("authorization") != "Bearer right":
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "InvalidAuthToken: Authentication token is missing or incorrect",
            )
        return gcs_service_pb2.GetClusterIdReply()


@pytest.fixture
def token_cluster(monkeypatch):
    """The address of a GCS that wants a token; this process has none and Ray is not initialised.
    A raw `ray.init` fails the test: joining must go through join_ray's check."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    gcs_service_pb2_grpc.add_NodeInfoGcsServiceServicer_to_server(TokenGcs(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def raw_init(*args, **kwargs):
        raise AssertionError(f"ray.init{args or ''}{kwargs} ran: Ray would retry InvalidAuthToken for ~20 s")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", raw_init)
    monkeypatch.setattr(ray_auth, "_local_token_header", dict)  # this machine has no token
    monkeypatch.setattr(cluster, "_last_joined", None)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_the_gateway_stops_at_once_on_a_cluster_that_wants_a_token(token_cluster, tmp_path):
    """Connecting to the running pool (it was a raw ray.init(address=...)); with --launch-actors the
    pool's launch joins through join_ray too."""
    from vitpool.integrations.vllm.gateway_cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["--model", str(tmp_path), "--upstream", "http://127.0.0.1:1", "--address", token_cluster])
    message = str(stopped.value.code)
    assert message.startswith("vitpool gateway: ") and "\n" not in message
    assert f"the Ray cluster at {token_cluster} uses token authentication" in message
    assert "set RAY_AUTH_MODE=token" in message


def test_the_dynamo_backend_joins_through_join_ray(token_cluster, tmp_path, monkeypatch):
    """Dynamo builds the backend with no arguments: RAY_ADDRESS names the cluster."""
    interface = types.ModuleType("dynamo.vllm.multimodal_utils.custom_encoder")  # ai-dynamo's, where absent
    interface.Preprocessed = interface.Qwen3VLImageEncoding = object
    interface.VisionEncoderBackend = type("VisionEncoderBackend", (), {})
    monkeypatch.setitem(sys.modules, interface.__name__, interface)
    monkeypatch.delitem(sys.modules, "vitpool.integrations.dynamo", raising=False)
    from vitpool.integrations import dynamo

    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl"}')
    (tmp_path / "preprocessor_config.json").write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')
    monkeypatch.setenv("RAY_ADDRESS", token_cluster)
    with pytest.raises(ConnectionError, match="set RAY_AUTH_MODE=token"):
        dynamo.VitpoolEncoderBackend().build(str(tmp_path))


def test_a_pool_the_gateway_launches_runs_in_the_llms_dtype(tmp_path, monkeypatch):
    from vitpool.integrations.vllm.gateway_cli import main
    from vitpool.pool import EncoderPool

    launched = {}

    def launch(cls, model, **options):
        launched.update(options)
        raise ConnectionError("stop here")

    monkeypatch.setattr(EncoderPool, "launch", classmethod(launch))
    with pytest.raises(SystemExit, match="stop here"):
        main(
            [
                "--model",
                str(tmp_path),
                "--upstream",
                "http://127.0.0.1:1",
                "--launch-actors",
                "2",
                "--dtype",
                "float32",
            ]
        )
    assert launched["dtype"] == "float32" and launched["num_actors"] == 2
