"""The command line's checks and small commands without a Ray cluster: `--budgets` refused before
anything starts, `--cpus-per-actor` and the flags named in actor-option errors, `serve`'s flags
made from PoolSettings' fields (today's spellings; the removed `--small-first-stream` refused),
`--version`, `list` (over a faked cluster), `stop` printing its result once, and help text on
every flag."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging
import subprocess
import sys

import pytest
import ray

import vitpool
from vitpool import cli, cli_flags
from vitpool.errors import ConfigError, PoolNotFoundError
from vitpool.pool import EncoderPool, cluster
from vitpool.pool.controller import NAMESPACE, Membership
from vitpool.pool.settings import MAX_BUDGET_TOKENS, PoolSettings


class LaunchRecorder:
    """Stands in for EncoderPool.launch: records its keyword arguments, starts nothing."""

    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[dict] = []
        self.error = error

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.error is not None:
            raise self.error
        return FakePool(num_actors=kwargs["num_actors"] or 1)


class FakePool:
    def __init__(self, num_actors: int = 1, detached: bool = True) -> None:
        self.num_actors = num_actors
        self.settings = PoolSettings(detached=detached)
        self.closed = self.shut_down = False

    def close(self) -> None:
        self.closed = True

    def shutdown(self) -> None:
        # as EncoderPool._shutdown does once the controller is stopped
        logging.getLogger("vitpool.pool.encoder_pool").info("pool %r stopped", "svc")
        self.shut_down = True


@pytest.fixture(autouse=True)
def ray_logs_left_alone(monkeypatch):
    """main() quiets Ray's own log for its process; here it records that it would, instead."""
    calls = []
    monkeypatch.setattr(cluster, "quiet_ray_logs", lambda: calls.append(True))
    return calls


@pytest.fixture(autouse=True)
def restore_vitpool_logger():
    """main() sets the library logger's level and handler; leave it as found for other tests."""
    library = logging.getLogger("vitpool")
    level, handlers = library.level, list(library.handlers)
    yield
    library.setLevel(level)
    library.handlers[:] = handlers


# ---- --budgets --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budgets", "wanted"),
    [
        ("abc", "'abc' is not a whole number"),  # was a bare "invalid literal for int()"
        ("64,abc", "'abc' is not a whole number"),  # the wrong one among good ones
        ("64,", "'' is not a whole number"),  # a trailing comma
        # the pool's own rule (vitpool.encoder_spec.check_budgets), word for word
        (
            "3,5000000",
            f"budgets: 5000000 tokens is above the largest budget a pool captures ({MAX_BUDGET_TOKENS}",
        ),
        (f"{MAX_BUDGET_TOKENS + 1}", f"({MAX_BUDGET_TOKENS} tokens"),  # one past the bound
        ("0,64", "budgets must be positive integers (output tokens); got 0"),
        ("-16", "budgets must be positive integers (output tokens); got -16"),
        ("16,16", "budgets has duplicates"),  # was refused only after parsing, by PoolSettings
    ],
)
def test_bad_budgets_are_refused_naming_the_flag_before_any_launch(budgets, wanted, monkeypatch, capsys):
    launch = LaunchRecorder()
    monkeypatch.setattr(EncoderPool, "launch", launch)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--device", "cpu", "--budgets", budgets])
    assert exit_info.value.code == 2
    [error] = capsys.readouterr().err.strip().splitlines()  # one line, not the usage first
    assert error.startswith("vitpool serve: error: argument --budgets: ") and wanted in error, error
    assert error.endswith("(`vitpool serve --help` lists the flags)")
    assert launch.calls == []  # refused before any actor (or Ray) starts


def test_good_budgets_reach_the_launch_as_integers(monkeypatch, capsys):
    launch = LaunchRecorder()
    monkeypatch.setattr(EncoderPool, "launch", launch)
    assert cli.main(["serve", "--device", "cpu", "--budgets", f"16, 64,{MAX_BUDGET_TOKENS}", "--quiet"]) == 0
    assert launch.calls[0]["budgets"] == [16, 64, MAX_BUDGET_TOKENS]
    assert "serving with 1 encoder actor" in capsys.readouterr().out


def test_pool_settings_refuse_an_absurd_budget_too():
    # the library's own guard, for callers of EncoderPool.launch that never pass through the CLI
    with pytest.raises(
        ConfigError, match=rf"budgets: 5000000 tokens is above .*\({MAX_BUDGET_TOKENS} tokens"
    ):
        PoolSettings(budgets=[3, 5_000_000])
    assert PoolSettings(budgets=[16, MAX_BUDGET_TOKENS]).budgets == (16, MAX_BUDGET_TOKENS)


# ---- settings flags ---------------------------------------------------------------------------

LAUNCH_KEYWORDS = {"num_actors", "name", "address", "actor_options", "detached"}  # serve's own, always passed


def serve_flags() -> dict[str, argparse.Action]:
    """`serve`'s flags by their destination."""
    commands = next(
        action for action in cli._parser()._actions if isinstance(action, argparse._SubParsersAction)
    )
    return {action.dest: action for action in commands.choices["serve"]._actions}


def test_every_pool_setting_has_a_serve_flag_or_a_reason_not_to():
    flags = serve_flags()
    fields = {field.name for field in dataclasses.fields(PoolSettings)}
    assert sorted(fields - set(flags) - set(cli_flags.NOT_SERVE_FLAGS)) == []
    assert set(cli_flags.NOT_SERVE_FLAGS) <= fields and all(
        cli_flags.NOT_SERVE_FLAGS.values()
    )  # no stale entry, each says why
    assert not set(cli_flags.NOT_SERVE_FLAGS) & set(flags)
    for exception_table in (cli_flags.SETTING_CHOICES, cli_flags.SETTING_PARSERS):
        assert set(exception_table) <= fields


@pytest.mark.parametrize(
    ("flags", "settings"),
    [
        # today's spellings, as the docs and tests/integration/test_service.py give them
        (["--budgets", "16,64"], {"budgets": [16, 64]}),
        (["--autoscale-interval", "3"], {"autoscale_interval_s": 3.0}),  # seconds: the flag drops `_s`
        (["--warm-standby", "on"], {"warm_standby": True}),
        (
            ["--embedding-cache-bytes", "4096", "--embedding-cache-local-bytes", "1024"],
            {"embedding_cache_bytes": 4096, "embedding_cache_local_bytes": 1024},
        ),
        (["--precision", "fp8", "--dtype", "bfloat16"], {"precision": "fp8", "dtype": "bfloat16"}),
        (["--device", "cpu"], {"device": "cpu"}),
        (["--autoscale", "1,4"], {"autoscale": (1, 4)}),
        # flags no line of cli.py or cli_flags.py names: made from the fields
        (["--urgent-tokens", "256"], {"urgent_tokens": 256}),
        (["--overlap-runs", "off", "--fused-ops", "off"], {"overlap_runs": False, "fused_ops": False}),
        (["--small-first-tokens", "none"], {"small_first_tokens": None}),  # None where it is not the default
        (
            ["--metrics-interval", "none", "--batch-window", "0"],
            {"metrics_interval_s": None, "batch_window_s": 0.0},
        ),
        (["--capacity-limits", "sequences=8"], {"capacity_limits": {"sequences": 8}}),
        (
            ["--model", "/models/m", "--max-queued-items", "64"],
            {"model": "/models/m", "max_queued_items": 64},
        ),
        ([], {}),  # a flag left out leaves the pool's default
    ],
)
def test_setting_flags_reach_the_launch_as_settings(flags, settings, monkeypatch):
    launch = LaunchRecorder()
    monkeypatch.setattr(EncoderPool, "launch", launch)
    assert cli.main(["serve", "--quiet", *flags]) == 0
    passed = {key: value for key, value in launch.calls[0].items() if key not in LAUNCH_KEYWORDS}
    assert passed == settings
    PoolSettings(**passed)  # what the pool takes


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--warm-standby", "yes"], "argument --warm-standby: 'yes': use on or off"),
        (["--autoscale", "4"], "argument --autoscale: '4': use MIN,MAX"),  # was a ConfigError after parsing
        (["--max-item-tokens", "many"], "argument --max-item-tokens: invalid int value: 'many'"),
        (["--attention", "fa3"], "argument --attention: invalid choice: 'fa3'"),
        (["--capacity-limits", "windows"], "argument --capacity-limits: 'windows': use NAME=N pairs"),
    ],
)
def test_a_bad_setting_flag_is_refused_before_any_launch(flags, words, monkeypatch, capsys):
    launch = LaunchRecorder()
    monkeypatch.setattr(EncoderPool, "launch", launch)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *flags])
    assert exit_info.value.code == 2 and words in capsys.readouterr().err
    assert launch.calls == []


@pytest.mark.parametrize("flags", [["--small-first-stream", "on"], ["--small-first-stream"]])
def test_small_first_stream_is_refused_naming_urgent_tokens(flags, monkeypatch, capsys):
    launch = LaunchRecorder()
    monkeypatch.setattr(EncoderPool, "launch", launch)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *flags])
    assert exit_info.value.code == 2 and launch.calls == []
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("vitpool serve: error: --small-first-stream was removed"), error
    assert "use --urgent-tokens N" in error
    assert "--small-first-stream" not in serve_flags_help()  # hidden from --help


def serve_flags_help() -> str:
    commands = next(
        action for action in cli._parser()._actions if isinstance(action, argparse._SubParsersAction)
    )
    return commands.choices["serve"].format_help()


def test_a_flags_help_is_its_fields_documentation():
    flags = serve_flags()
    assert flags["autoscale_interval_s"].help.startswith("how often the autoscaler reads")
    assert "(default: 5.0)" in flags["autoscale_interval_s"].help
    assert "(default: 256; none: one lane, oldest first)" in flags["small_first_tokens"].help
    assert "(default: no urgent lane)" in flags["urgent_tokens"].help
    assert flags["budgets"].help.startswith("token budgets") and "In a pool, at most" in flags["budgets"].help


# ---- actor options ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "options"),
    [
        ([], None),  # the pool's defaults: a GPU each where the cluster has some, one CPU
        (["--device", "cpu"], {"num_gpus": 0}),
        (["--cpus-per-actor", "0.5"], {"num_cpus": 0.5}),
        (["--device", "cpu", "--cpus-per-actor", "0.5"], {"num_gpus": 0, "num_cpus": 0.5}),
        (["--gpus-per-actor", "0.5", "--cpus-per-actor", "2"], {"num_gpus": 0.5, "num_cpus": 2.0}),
        (["--device", "cpu", "--gpus-per-actor", "1"], {"num_gpus": 1.0}),  # an explicit share wins
    ],
)
def test_serve_flags_become_actor_options(flags, options, monkeypatch):
    launch = LaunchRecorder()
    monkeypatch.setattr(EncoderPool, "launch", launch)
    assert cli.main(["serve", "--num-actors", "4", "--quiet", *flags]) == 0
    assert launch.calls[0]["actor_options"] == options
    assert launch.calls[0]["num_actors"] == 4


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "inf"])
def test_a_share_per_actor_must_be_a_number_of_at_least_zero(value, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--cpus-per-actor", value])
    assert "argument --cpus-per-actor: " in capsys.readouterr().err


def test_four_cpu_actors_on_two_cpus_are_told_the_flag_that_fits_them(monkeypatch, capsys):
    # the library's own refusal, as on a 2-core machine: it names actor_options, which the CLI cannot pass
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(ConfigError) as refusal:
        cluster.check_capacity({"num_gpus": 0, "num_cpus": 1}, 4)
    monkeypatch.setattr(EncoderPool, "launch", LaunchRecorder(error=refusal.value))
    assert cli.main(["serve", "--device", "cpu", "--num-actors", "4", "--quiet"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("vitpool serve: error: ConfigError: 4 encoder actors with num_cpus=1")
    assert "actor_options={'num_cpus': ...}" in error and error.endswith("(vitpool serve: --cpus-per-actor)")


@pytest.mark.parametrize(
    ("message", "wanted"),
    [
        # the no-GPU refusal: both of the flags that do what it asks
        (
            "leave num_gpus out of actor_options (or set it to 0) and launch with device='cpu'",
            "(vitpool serve: --gpus-per-actor, --device cpu)",
        ),
        # no actor_options named: nothing added (this one is about the precision, not a flag to set)
        ("precision 'fp8' needs GPU actors (FP8 tensor cores), not device='cpu'", ""),
        # the flag already named by the library: not said twice
        ("a fractional share (actor_options={'num_cpus': ...}, --cpus-per-actor)", ""),
    ],
)
def test_actor_option_errors_name_the_serve_flags_once(message, wanted):
    assert cli.with_serve_flags(message) == f"{message} {wanted}".strip()


def test_other_commands_get_no_serve_flags(monkeypatch, capsys):
    # `scale` keeps the options the pool was served with: no flag of its own would help
    def refuse(name, address):
        raise ConfigError("2 encoder actors with num_cpus=1 need 2 CPUs; (actor_options={'num_cpus': ...})")

    monkeypatch.setattr(EncoderPool, "connect", refuse)
    assert cli.main(["scale", "2", "--quiet"]) == 1
    assert "--cpus-per-actor" not in capsys.readouterr().err


# ---- --version, list, stop, help ----------------------------------------------------------------


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"vitpool {importlib.metadata.version('vitpool')}"


def test_version_falls_back_to_the_package_from_a_source_tree(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.version() == vitpool.__version__


def test_list_without_a_cluster_says_no_pools_and_starts_none(monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "running_local_cluster", lambda: None)
    monkeypatch.setattr(cluster, "join_ray", lambda address: pytest.fail("list joined (or started) Ray"))
    monkeypatch.setattr(cluster, "clusters_on_this_machine", list)
    assert cli.main(["list", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("no pools: no Ray cluster runs on this machine")


class FakeMethod:
    def __init__(self, result) -> None:
        self.result = result

    def remote(self):
        return self.result


class FakeController:
    def __init__(self, membership) -> None:
        self.membership = FakeMethod(membership)


class FakeEncoderActor:
    """An encoder actor (or standby) named in vitpool's namespace: it has no `membership`."""


def fake_cluster(monkeypatch, named: dict[tuple[str, str], object]) -> None:
    """A running cluster whose named actors are `named` ((namespace, name) -> handle)."""
    monkeypatch.setattr(cluster, "running_local_cluster", lambda: "127.0.0.1:6379")
    monkeypatch.setattr(cluster, "join_ray", lambda address: True)
    monkeypatch.setattr(
        ray.util,
        "list_named_actors",
        lambda all_namespaces=False: [{"namespace": namespace, "name": name} for namespace, name in named],
    )
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: named[(namespace, name)])

    def get(ref, timeout=None):
        if isinstance(ref, Exception):
            raise ref
        return ref

    monkeypatch.setattr(ray, "get", get)


def test_list_shows_each_pool_with_its_model_and_actors(monkeypatch, capsys):
    served = Membership(
        3, {0: object(), 1: object()}, {}, PoolSettings(model="/models/qwen3-vl-8b", detached=True)
    )
    owned = Membership(1, {0: object()}, {}, PoolSettings())
    fake_cluster(
        monkeypatch,
        {
            (NAMESPACE, "svc"): FakeController(served),
            (NAMESPACE, "svc-encoder-0"): FakeEncoderActor(),  # the pools' actors are not pools
            (NAMESPACE, "svc-standby-0"): FakeEncoderActor(),
            (NAMESPACE, "mine"): FakeController(owned),
            (NAMESPACE, "gone"): FakeController(ray.exceptions.GetTimeoutError("no answer")),
            ("other-app", "svc2"): FakeController(served),  # another namespace: not vitpool's
        },
    )
    assert cli.main(["list", "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "| pool | model | actors | detached |",
        "|---|---|---|---|",
        f"| gone | ? | controller did not answer in {cli.LIST_TIMEOUT_S:.0f} s | ? |",
        "| mine | shipped tiny model | 1 | no |",
        "| svc | /models/qwen3-vl-8b | 2 | yes |",
    ]


def test_list_says_no_pools_in_a_cluster_without_any(monkeypatch, capsys):
    fake_cluster(monkeypatch, {("other-app", "model-server"): FakeEncoderActor()})
    assert cli.main(["list", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == "no pools"


def test_stop_says_stopped_once(monkeypatch, capsys):
    from vitpool.integrations.vllm import store

    pool = FakePool()
    monkeypatch.setattr(EncoderPool, "connect", lambda name, address: pool)
    stores = {"svc": False}
    monkeypatch.setattr(store, "stop_store", lambda name: stores.pop(name, True))
    assert cli.main(["stop", "--name", "svc"]) == 0  # not quiet: progress lines are on
    captured = capsys.readouterr()
    assert pool.shut_down
    assert captured.out.strip() == "pool 'svc' stopped"
    assert "stopped" not in captured.err  # was also the library's progress line
    assert cli.main(["stop", "--name", "svc"]) == 0  # now with the vLLM gateway's store
    assert capsys.readouterr().out.strip() == "pool 'svc' and its vLLM embedding store stopped"


def test_main_run_twice_in_one_process_shows_each_progress_line_once(monkeypatch, capsys):
    def connect(name, address):
        logging.getLogger("vitpool.pool.launcher").info("connecting to %s", name)
        raise ConfigError("no such pool")

    monkeypatch.setattr(EncoderPool, "connect", connect)
    cli.main(["status"])
    capsys.readouterr()
    cli.main(["status"])
    assert capsys.readouterr().err.count("connecting to vitpool") == 1


def test_every_flag_of_every_command_has_help():
    parser = cli._parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    missing = [
        f"{name} {action.dest}"
        for name, command in commands.choices.items()
        for action in command._actions
        if not action.help
    ]
    assert missing == []  # bench's --calls, --warmup, --threads and --seconds had none
    assert "list" in commands.choices and "--name" not in commands.choices["list"].format_usage()


def test_version_and_help_import_neither_ray_nor_torch():
    for argv in (["--version"], ["--help"], ["serve", "--help"]):
        probe = "\n".join(
            [
                "import sys",
                "from vitpool import cli",
                "try:",
                f"    cli.main({argv!r})",
                "except SystemExit:",
                "    pass",
                "print(sorted({'ray', 'torch'} & set(sys.modules)), file=sys.stderr)",
            ]
        )
        result = subprocess.run(
            [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60
        )
        assert result.stderr.strip().splitlines()[-1] == "[]", (argv, result.stderr)
        assert result.stdout.strip(), argv  # it printed the version or the help


def test_a_bad_command_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sevre"])
    assert exit_info.value.code == 2
    [error] = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("vitpool: error: argument command: invalid choice: 'sevre'"), error


def test_ray_logs_are_quiet_unless_verbose(monkeypatch, ray_logs_left_alone):
    def refuse(name, address):
        raise ConfigError("no such pool")

    monkeypatch.setattr(EncoderPool, "connect", refuse)
    assert cli.main(["status", "--quiet"]) == 1
    assert ray_logs_left_alone == [True]
    assert cli.main(["status", "--quiet", "--verbose"]) == 1
    assert ray_logs_left_alone == [True]  # --verbose: Ray's lines as Ray prints them


def test_stop_of_a_pool_that_does_not_run_has_nothing_to_do(monkeypatch, capsys):
    where = "Ray cluster at 127.0.0.1:6379 (from the address argument; with this machine's token: ...)"

    def missing(name, address):
        raise PoolNotFoundError(
            f"no pool named {name!r} in the {where}; pass address= (--address) or set RAY_ADDRESS to look "
            "in another, or start one with EncoderPool.launch or `vitpool serve`",
            where=where,
        )

    monkeypatch.setattr(EncoderPool, "connect", missing)
    assert cli.main(["stop", "--name", "svc", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == f"nothing to stop: no pool named 'svc' in the {where}"
    assert "start one" not in captured.out + captured.err
    assert cli.main(["status", "--name", "svc", "--quiet"]) == 1  # the other commands: an error
    error = capsys.readouterr().err
    assert "pass --address or set RAY_ADDRESS to look in another, or start one with `vitpool serve`" in error
    assert "address=" not in error and "EncoderPool" not in error  # Python's words, not the command line's


def test_list_names_the_clusters_that_run_when_none_is_joined_by_default(monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "running_local_cluster", lambda: None)  # a stale address file
    monkeypatch.setattr(cluster, "join_ray", lambda address: pytest.fail("list joined (or started) Ray"))
    monkeypatch.setattr(cluster, "clusters_on_this_machine", lambda: ["10.0.0.5:6379"])
    assert cli.main(["list", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no pools found: 1 Ray cluster runs on this machine (10.0.0.5:6379)"), out
    assert "--address names the one to look in" in out
