"""The pool's metrics read back from Ray's Prometheus endpoint after a known number of calls.

Runs in a process of its own: its Ray instance exports metrics on a port chosen here and reports
them every half second (the module's other tests share a Ray instance without a metrics agent).
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import free_port, ray_env

METERED = r"""
import json, sys, time, urllib.request
import ray, torch
from vitpool import EncoderPool, Image, InvalidItemError

port = int(sys.argv[1])
ray.init(address="local", num_cpus=4, _metrics_export_port=port,
         _system_config={"metrics_report_interval_ms": 500})
pool = EncoderPool.launch(budgets=[16, 64], device="cpu", actor_options={"num_gpus": 0}, name="metered",
                          metrics_interval_s=0.5)
for _ in range(7):  # 7 calls of 2 items, 4 + 16 tokens
    pool.encode([Image(torch.randn(16, 1536), (1, 4, 4)), Image(torch.randn(64, 1536), (1, 8, 8))])
outcomes = pool.encode([Image(torch.randn(16, 1536), (1, 4, 4)), Image(torch.randn(15, 1536), (1, 4, 4))],
                       return_exceptions=True)  # the second item's rows do not match its grid
assert isinstance(outcomes[1], InvalidItemError)


def read() -> dict:
    # series of the "metered" pool, each by name and its labels but Ray's own
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = {}
    for line in text.splitlines():
        if not line.startswith("ray_vitpool_") or 'pool="metered"' not in line:
            continue
        name, rest = line.split("{", 1)
        labels, value = rest.rsplit("} ", 1)
        keep = sorted(part for part in labels.split(",") if part.startswith(("actor=", "le=")))
        key = name + ("{" + ",".join(keep) + "}" if keep else "")
        found[key] = found.get(key, 0.0) + float(value)
    return found


deadline = time.monotonic() + 60
while True:
    found = read()
    if (found.get("ray_vitpool_calls_total") == 8
            and found.get('ray_vitpool_actor_items_total{actor="0"}') == 15):
        break
    if time.monotonic() > deadline:
        break
    time.sleep(0.5)
pool.shutdown()
print(json.dumps(found))
"""


def test_metrics_count_the_calls_items_tokens_and_actors_of_a_pool():
    done = subprocess.run(
        [sys.executable, "-c", METERED, str(free_port())],
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["ray_vitpool_calls_total"] == 8
    assert found["ray_vitpool_items_total"] == 15  # the bad item was not encoded...
    assert found["ray_vitpool_rejected_items_total"] == 1  # ... but counted as rejected
    assert found["ray_vitpool_tokens_total"] == 7 * (4 + 16) + 4
    assert found["ray_vitpool_call_latency_seconds_count"] == 8
    assert found['ray_vitpool_call_latency_seconds_bucket{le="+Inf"}'] == 8
    assert found.get("ray_vitpool_failed_calls_total", 0) == 0  # a counter never raised has no series
    assert found["ray_vitpool_queue_items"] == 0 and found["ray_vitpool_batches_in_flight"] == 0
    assert found["ray_vitpool_actors"] == 1
    assert found['ray_vitpool_actor_items_total{actor="0"}'] == 15
    assert 0.0 <= found['ray_vitpool_actor_busy_fraction{actor="0"}'] <= 1.0
    assert (
        'ray_vitpool_actor_graph_hit_rate{actor="0"}' not in found
    )  # a CPU actor captures no graph: no series, not 0.0
    assert 0.0 <= found['ray_vitpool_actor_padding_waste{actor="0"}'] < 1.0
