"""Scale-out faults on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head without CPUs and three
1-CPU worker nodes, reached through ``--address`` as a user's cluster would be):

- a worker node removed while the grid runs: its actor's unit is retried on the spare node and the grid finishes
  with exactly the rows of a local run;
- the driver SIGKILLed in the middle of the merge (after a merged file's temporary copy is written, before it
  replaces the file): a rerun finishes with exactly the rows of a local run.

Slow (Ray starts four raylets), so marked ``slow``; CI runs it (``python -m pytest -q`` runs every marker).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_kill_resume import GRID, _grid_rows

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

FLAGS = ["--no-figure", "--cpus-per-worker", "1"]


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'randattn[grid]'")
    from ray.cluster_utils import Cluster

    fast = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 3}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "object_store_memory": 80 * 2**20, "_system_config": fast})
    workers = [c.add_node(num_cpus=1, object_store_memory=80 * 2**20) for _ in range(3)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield ray, c, workers
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def spec_and_local(tiny_dir, tmp_path_factory):
    from probes import grid

    tmp = tmp_path_factory.mktemp("faults")
    spec = tmp / "acc.toml"
    spec.write_text(GRID.format(model=tiny_dir))
    assert grid.main([str(spec), "--out", str(tmp / "local"), *FLAGS]) == 0
    return spec, _grid_rows(tmp / "local")


def _raylet_pid(node) -> int:
    from ray._private import ray_constants

    return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def _node_of(pid: int, nodes):
    """The cluster node whose raylet started the worker process ``pid``."""
    import psutil

    raylets = {_raylet_pid(n): n for n in nodes}
    for parent in psutil.Process(pid).parents():
        if parent.pid in raylets:
            return raylets[parent.pid]
    return None


def test_a_worker_node_removed_mid_grid_is_survived_with_the_local_rows(cluster, spec_and_local, tmp_path, capsys):
    from probes import grid

    ray, c, workers = cluster
    spec, local = spec_and_local
    out = tmp_path / "grid"
    result = {}
    run = threading.Thread(target=lambda: result.setdefault("status", grid.main(
        [str(spec), "--out", str(out), "--backend", "ray", "--address", c.address, "--workers", "2", "--retries", "2",
         *FLAGS])))
    run.start()
    deadline = time.monotonic() + 240
    victim = None
    while victim is None and run.is_alive() and time.monotonic() < deadline:
        items = list((out / "items").glob("*/*.json"))
        if items:  # both actors are up and one unit is in; the node of a worker that wrote one goes away
            pid = int(json.loads(items[0].read_text())["worker"].rsplit(":", 1)[1])
            victim = _node_of(pid, workers)
        time.sleep(0.05)
    assert victim is not None, "no item was written by a worker node in time"
    c.remove_node(victim, allow_graceful=False)
    run.join(300)
    assert not run.is_alive() and result.get("status") == 0, capsys.readouterr().out[-3000:]
    assert _grid_rows(out) == local
    records = [json.loads(p.read_text()) for p in (out / "items").rglob("*.json")]
    assert len(records) == 12 and len({r["id"] for r in records}) == 12


DRIVER = """
import os, signal, sys
from probes.results import ResultsFile
original = ResultsFile.append
def append_then_die(self, rows):
    written = original(self, rows)
    if self.path.name.endswith(".tmp"):  # the merged file's copy is on disk, the file itself not yet replaced
        os.kill(os.getpid(), signal.SIGKILL)
    return written
ResultsFile.append = append_then_die
from probes import grid
sys.exit(grid.main(sys.argv[1:]))
"""


def test_a_driver_killed_mid_merge_reruns_to_the_local_rows(cluster, spec_and_local, tmp_path):
    from probes import grid

    ray, c, _ = cluster
    spec, local = spec_and_local
    out = tmp_path / "grid"
    argv = [str(spec), "--out", str(out), "--backend", "ray", "--address", c.address, *FLAGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", DRIVER, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert list((out / "accuracy").rglob(".*.tmp")), "killed before the merge"
    assert len(list((out / "items").rglob("*.json"))) == 12  # every item was in before the kill
    assert grid.main(argv) == 0  # the rerun computes nothing and merges again
    assert _grid_rows(out) == local
    assert not list((out / "accuracy").rglob(".*.tmp"))
