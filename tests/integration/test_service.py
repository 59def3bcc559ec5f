"""The pool as a cluster service, end to end on one machine: a Ray cluster started with
`ray start --head` (as a user would), a detached pool launched by a process that then exits,
other processes that find the cluster and the pool without an address, encode, and stop it; the
`vitpool` command line, its progress and its one-line errors.

Every pool here lives in its own processes, so the test process runs none of Ray itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ray_env, ray_head

from vitpool.transport.shared_memory import SEGMENT_PREFIX, shm_directory

# Ray's temp directory of this module's cluster: the `ray start` head writes its address file
# there, and the clients, given no address, find the head through it as ray.init() does; the
# address file of any other cluster on the machine (in Ray's default temp directory) they never see
RAY_TEMP_ROOT = Path(os.environ["RAY_TMPDIR"]) / "svc"  # tests/conftest.py made RAY_TMPDIR this run's own
ENV = ray_env(RAY_TEMP_ROOT)


@pytest.fixture(scope="module")
def ray_head_port():
    """A one-node cluster started by `ray start --head`, stopped afterwards (its processes only,
    by pid: other Ray clusters on the machine go on)."""
    with ray_head(RAY_TEMP_ROOT, "--num-cpus=6", "--num-gpus=0") as port:
        yield port


def run_python(code: str, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def vitpool(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vitpool", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def segments() -> set[str]:
    return {name for name in os.listdir(shm_directory()) if name.startswith(SEGMENT_PREFIX)}


def left_segments(before: set[str]) -> set[str]:
    """This user's segments made since `before` that no running process maps: left behind. Other
    processes on the machine (another test run's pools) make and unlink segments meanwhile; a
    segment in use stays mapped by the caller that made it until that caller unlinks it."""
    directory = Path(shm_directory())
    left = set()
    for name in segments() - before:
        try:
            if (directory / name).stat().st_uid == os.getuid():
                left.add(name)
        except FileNotFoundError:
            continue
    for maps in Path("/proc").glob("[0-9]*/maps"):
        if not left:
            break
        try:
            text = maps.read_text()
        except OSError:
            continue
        left = {name for name in left if name not in text}
    return left


LAUNCH_DETACHED = """
import sys, ray
from vitpool import EncoderPool
pool = EncoderPool.launch(budgets=[16, 64], device="cpu", actor_options={"num_gpus": 0}, name=sys.argv[1],
                          detached=True, num_actors=2)
print("gcs", ray.get_runtime_context().gcs_address)
print("actors", pool.num_actors)
# exits without shutdown: the pool is detached
"""

USE_AND_STOP = """
import sys, torch
from vitpool import EncoderPool, GraphEncoder, Image, Video
pool = EncoderPool.connect(sys.argv[1])
generator = torch.Generator().manual_seed(3)
items = [Image(torch.randn(16, 1536, generator=generator), (1, 4, 4)),
         Video(torch.randn(32, 1536, generator=generator), (2, 4, 4)),
         Image(torch.randn(64, 1536, generator=generator), (1, 8, 8))]
reference = GraphEncoder.from_pretrained(None, budgets=[16, 64], device="cpu", dtype=torch.float32)
for got, want in zip(pool.encode(items), reference.encode(items), strict=True):
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-5), float((g - w).abs().max())
print("equal", len(items))
pool.shutdown()
print("stopped")
"""

POOL_ACTORS = """
import sys, time, ray
ray.init()
deadline = time.monotonic() + 60
while True:
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(sys.argv[1]))
    if not names or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print("left", names)
"""


def test_a_detached_pool_outlives_its_launcher_and_another_process_stops_it(ray_head_port):
    before = segments()
    launched = run_python(LAUNCH_DETACHED, "svc-detached")
    assert launched.returncode == 0, launched.stderr[-3000:]
    # the launcher found the running cluster (no address given) and has exited
    assert f":{ray_head_port}\n" in launched.stdout
    assert "actors 2" in launched.stdout
    used = run_python(USE_AND_STOP, "svc-detached")
    assert used.returncode == 0, used.stderr[-3000:]
    assert "equal 3" in used.stdout and "stopped" in used.stdout
    left = run_python(POOL_ACTORS, "svc-detached")
    assert left.returncode == 0, left.stderr[-3000:]
    assert "left []" in left.stdout  # controller, encoder actors: none left
    left_behind = left_segments(before)
    if left_behind:  # a second look passes a segment that another process was just making at the first
        time.sleep(1)
        left_behind &= left_segments(before)
    assert not left_behind  # the callers unlinked their shared memory
    gone = run_python("import sys\nfrom vitpool import EncoderPool\nEncoderPool.connect('svc-detached')")
    assert gone.returncode != 0 and "no pool named 'svc-detached'" in gone.stderr


def test_the_command_line_serves_scales_benches_and_stops_a_pool(ray_head_port):
    assert shutil.which("vitpool") is not None  # the console script, besides `python -m vitpool`
    name = "svc-cli"
    served = vitpool(
        "serve",
        "--device",
        "cpu",
        "--num-actors",
        "1",
        "--budgets",
        "16,64",
        "--name",
        name,
        "--autoscale-interval",
        "3",
        "--warm-standby",
        "on",
        "--embedding-cache-bytes",
        "4096",
        "--embedding-cache-local-bytes",
        "1024",
        "--urgent-tokens",
        "256",
    )
    assert served.returncode == 0, served.stderr[-3000:]
    assert f"pool {name!r} serving with 1 encoder actor" in served.stdout
    assert "encoder actor 0 ready" in served.stderr  # progress is shown without configuring logging
    settings = run_python(
        f"from vitpool import EncoderPool\ns = EncoderPool.connect({name!r}).settings\n"
        "print(s.autoscale_interval_s, s.warm_standby, s.embedding_cache_bytes,"
        " s.local_cache_bytes, s.urgent_tokens)"
    )
    assert settings.stdout.split() == ["3.0", "True", "4096", "1024", "256"], settings.stderr[-2000:]

    status = vitpool("status", "--name", name)
    assert status.returncode == 0, status.stderr[-3000:]
    lines = status.stdout.splitlines()
    assert lines[0].startswith(
        f"pool {name!r}: 1 encoder actor taking work; since launch 0 items in 0 batches"
    )
    assert not any(line.startswith("this process:") for line in lines)  # the command made no call
    header = next(
        i for i, line in enumerate(lines) if line.startswith("| actor | device | batches | items |")
    )
    assert lines[header + 2].startswith("| 0 | cpu") and "- (CPU)" in lines[header + 2]

    scaled = vitpool("scale", "2", "--name", name)
    assert scaled.returncode == 0, scaled.stderr[-3000:]
    assert "1 -> 2 encoder actors" in scaled.stdout

    bench = subprocess.run(
        [
            "vitpool",
            "bench",
            "--name",
            name,
            "--calls",
            "5",
            "--warmup",
            "1",
            "--threads",
            "2",
            "--seconds",
            "1",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    row = bench.stdout.splitlines()[-1].split("|")
    assert row[1].strip() == name and row[2].strip() == "2" and float(row[5]) > 0

    # the pool's totals survive scaling down: the retired actor's items stay counted
    before = vitpool("status", "--name", name, "--quiet").stdout.splitlines()[0]
    assert vitpool("scale", "1", "--name", name, "--quiet").returncode == 0
    after = vitpool("status", "--name", name, "--quiet").stdout.splitlines()[0]
    items_before = int(before.split("since launch ")[1].split(" item")[0])
    assert items_before > 0 and f"since launch {items_before} item" in after
    assert "by 1 actor since retired or failed" in after and "1 encoder actor taking work" in after

    # mistakes: one line on stderr, exit status 1, no traceback
    for args, wanted in [
        (("serve", "--device", "cpu", "--num-actors", "1", "--name", name), "already running"),
        (("status", "--name", "nobody"), "no pool named 'nobody'"),
        (("scale", "0", "--name", name), "num_actors must be a positive integer"),
        (
            ("serve", "--device", "cpu", "--autoscale-interval", "0", "--name", "other"),
            "autoscale_interval_s must be positive",
        ),
    ]:
        failed = vitpool(*args, "--quiet")
        assert failed.returncode == 1, (args, failed.stdout, failed.stderr[-2000:])
        errors = [line for line in failed.stderr.splitlines() if line.startswith("vitpool ")]
        assert len(errors) == 1 and wanted in errors[0], failed.stderr[-2000:]
        assert "Traceback" not in failed.stderr

    # a vLLM gateway's embedding store of this pool (detached): stopping the pool stops it too
    store_code = (
        "import ray, sys\nfrom vitpool.integrations.vllm.store import find_store, open_store\n"
        "ray.init(address='auto', log_to_driver=False)\n"
    )
    opened = run_python(store_code + f"ray.get(open_store({name!r}).stats.remote())")
    assert opened.returncode == 0, opened.stderr[-3000:]
    stopped = vitpool("stop", "--name", name)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert f"pool {name!r} and its vLLM embedding store stopped" in stopped.stdout
    after = vitpool("status", "--name", name, "--quiet")
    assert after.returncode == 1 and f"no pool named {name!r}" in after.stderr
    gone = run_python(
        store_code + "import time\ndeadline = time.monotonic() + 30\n"
        f"while find_store({name!r}) is not None and time.monotonic() < deadline: time.sleep(0.2)\n"
        f"sys.exit(find_store({name!r}) is not None)"
    )
    assert gone.returncode == 0, gone.stderr[-3000:]


HELD_OPEN = """
import sys
from vitpool import EncoderPool
pool = EncoderPool.launch(budgets=[16], device="cpu", actor_options={"num_gpus": 0}, name=sys.argv[1],
                          num_actors=1)
print("ready", flush=True)
sys.stdin.readline()  # until the test lets go
pool.shutdown()
"""


def test_stop_refuses_a_pool_that_is_not_detached(ray_head_port):
    owner = subprocess.Popen(
        [sys.executable, "-c", HELD_OPEN, "svc-owned"],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout.readline().strip() == "ready", owner.stderr.read()[-3000:]
        refused = vitpool("stop", "--name", "svc-owned", "--quiet")
        assert (
            refused.returncode == 1
            and "is not detached: it stops with the process that launched it" in refused.stderr
        )
        still = vitpool("status", "--name", "svc-owned", "--quiet")
        assert still.returncode == 0 and "1 encoder actor taking work" in still.stdout
    finally:
        owner.communicate("\n", timeout=120)
    assert owner.returncode == 0


WITHOUT_A_CLUSTER = """
from vitpool import ConfigError, EncoderPool, PoolUnavailableError
try:
    EncoderPool.connect("anything")
except PoolUnavailableError as error:
    print("connect:", error)
try:
    EncoderPool.launch(device="cpu", actor_options={"num_gpus": 0}, detached=True)
except ConfigError as error:
    print("launch:", error)
import ray
print("ray initialised:", ray.is_initialized())
"""


def test_without_a_cluster_connect_and_a_detached_launch_say_so_and_start_nothing(tmp_path):
    # an empty temp directory of Ray's: as on a machine where no `ray start` cluster runs
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_A_CLUSTER],
        env=ray_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "connect: no pool named 'anything': no Ray cluster runs on this machine" in done.stdout
    assert "launch: a detached pool outlives this process" in done.stdout
    assert "ray initialised: False" in done.stdout
