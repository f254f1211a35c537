"""Where a grid's units run, and where finished items go.

- :class:`ItemStore`: one JSON file per finished item, ``DIR/items/<id[:2]>/<id>.json``, written once through a
  temporary file and ``os.replace`` by the driver alone (workers return rows; they never write), so an item is
  either there complete or not at all, and no two writers ever race for a row.
- :class:`Worker`: runs units in one process, loading each model once and keeping it while its units come.
- :class:`LocalBackend`: one worker in this process. :class:`RayBackend`: one Ray actor per worker (``num_gpus``
  when asked for, restarted on a crash with its in-flight unit retried), fed one unit at a time from a queue
  sorted by model.

Both backends call ``done(unit, result)`` or ``failed(unit, reason)`` once per unit.

Failure injection for tests: ``RANDATTN_GRID_FAIL="at=N[,how=raise|exit][,once=MARKER]"`` makes each worker
fail when it starts its Nth unit, by raising or by exiting its process (a killed worker); with ``once`` only the
first worker to get there fails (it creates the file MARKER).
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from analysis.rows import BadRow, check_row

from . import units
from .units import Unit

FAIL_ENV = "RANDATTN_GRID_FAIL"


class BackendError(RuntimeError):
    """A backend cannot start (the message names the flag and the fix)."""


class ItemStore:
    """Finished items, one file each, keyed by item id."""

    def __init__(self, root: "str | Path"):
        self.dir = Path(root) / "items"

    def path(self, item_id: str) -> Path:
        return self.dir / item_id[:2] / f"{item_id}.json"

    def done(self) -> set[str]:
        """Ids of the items on disk. A damaged item file (cut short, not JSON, not an item record) counts as not done:
        it is moved aside to ``<id>.json.damaged[-N]`` (never deleted) with a message naming it, and recomputed."""
        ids = set()
        for p in sorted(self.dir.glob("*/*.json")):
            problem = self._problem(p)
            if problem is None:
                ids.add(p.stem)
                continue
            aside, n = p.with_name(p.name + ".damaged"), 1
            while aside.exists():
                n += 1
                aside = p.with_name(f"{p.name}.damaged-{n}")
            p.rename(aside)
            print(f"grid: item file {p} is damaged ({problem}); moved aside to {aside.name}, the item will be "
                  "recomputed", file=sys.stderr)
        return ids

    @staticmethod
    def _problem(path: Path) -> Optional[str]:
        try:
            record = json.loads(path.read_text())
        except (ValueError, OSError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            return f"{type(exc).__name__}: {str(exc)[:80]}"
        if not isinstance(record, dict) or record.get("id") != path.stem or not isinstance(record.get("rows"), list):
            return "not an item record with its id and rows"
        order = record.get("order", list(range(len(record["rows"]))))
        if not isinstance(order, list) or len(order) != len(record["rows"]) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in order):
            return "its 'order' does not give one place per row"
        for n, row in enumerate(record["rows"]):  # valid JSON can still hold rows no summary could use
            if not isinstance(row, dict):
                return f"row {n} is not a JSON object"
            try:
                check_row(row, f"row {n}")
            except BadRow as exc:
                return str(exc)
        return None

    def write(self, item_id: str, record: dict) -> bool:
        """Write one item unless it is already there; False when it was."""
        path = self.path(item_id)
        if path.exists():
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True

    def read(self, item_id: str) -> dict:
        return json.loads(self.path(item_id).read_text())


@dataclass
class FailAt:
    """Test-only: fail when starting the ``at``-th unit of a worker."""

    at: int
    how: str = "raise"
    once: Optional[str] = None

    @classmethod
    def from_env(cls) -> Optional["FailAt"]:
        text = os.environ.get(FAIL_ENV)
        if not text:
            return None
        fields = dict(part.split("=", 1) for part in text.split(","))
        return cls(int(fields["at"]), fields.get("how", "raise"), fields.get("once"))

    def trigger(self, n: int) -> None:
        if n != self.at:
            return
        if self.once:
            try:
                Path(self.once).touch(exist_ok=False)  # atomic: only one worker wins
            except FileExistsError:
                return
        if self.how == "exit":
            os._exit(3)  # like a worker killed mid-run: no exception, no cleanup
        raise RuntimeError(f"{FAIL_ENV}: injected failure at unit {n} of this worker")


class Worker:
    """Runs units in one process (the driver's, or a Ray actor's)."""

    def __init__(self, device: str = "auto", threads: Optional[int] = None, cwd: Optional[str] = None,
                 fail: Optional[FailAt] = None):
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)  # so relative paths and MODULE:CALLABLE selectors resolve as on the driver
        if threads:
            torch.set_num_threads(threads)
        self.device, self.fail, self.started = device, fail, 0
        self.model_name, self.model, self.tok = None, None, None
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def _load(self, name: str):
        if name != self.model_name:
            import randattn

            self.model = self.tok = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.model, self.tok = randattn.load_model(name, device=self.device)
            self.model_name = name
        return self.model, self.tok

    def run(self, unit: Unit) -> dict:
        """Run one unit of any registered kind (``probes.units``): its rows, tokens generated or replayed, time."""
        self.started += 1
        if self.fail:
            self.fail.trigger(self.started)
        model, tok = self._load(unit.model)
        t0 = time.perf_counter()
        with torch.inference_mode():
            rows = units.unit_rows(units.kind(unit.kind), model, tok, unit)
        tokens = sum(r.get("gen_len", 0) for r in rows) or len(rows) * unit.work.get("length", 0)
        return {"unit": unit.id, "rows": rows, "tokens": tokens, "seconds": time.perf_counter() - t0,
                "worker": self.name, "device": str(model.device)}


Done = Callable[[Unit, dict], None]
Failed = Callable[[Unit, str], None]


class LocalBackend:
    """Every unit in this process, one after the other: the reference the Ray backend must reproduce."""

    name = "local"

    def __init__(self, worker: dict):
        self.worker = worker
        self.workers = 1

    def start(self) -> str:
        return "1 worker in this process"

    def run(self, units: list[Unit], done: Done, failed: Failed) -> None:
        threads = torch.get_num_threads()
        try:
            worker = Worker(**self.worker)
            for unit in units:
                try:
                    result = worker.run(unit)
                except Exception as exc:  # one unit's failure does not stop the others (as on Ray)
                    failed(unit, f"{type(exc).__name__}: {exc}")
                    continue
                done(unit, result)
        finally:
            torch.set_num_threads(threads)

    def close(self) -> None:
        pass


class RayBackend:
    """One Ray actor per worker; a unit at a time per actor, so a crash loses one unit at most."""

    name = "ray"

    def __init__(self, worker: dict, *, address: Optional[str], workers: Optional[int], gpus: float, cpus: int,
                 retries: int):
        self.worker = dict(worker, threads=worker.get("threads") or cpus, cwd=os.getcwd())
        self.address, self.workers, self.gpus, self.cpus, self.retries = address, workers, gpus, cpus, retries
        self.owns = False

    def start(self) -> str:
        try:
            import ray
        except ImportError:
            raise BackendError("--backend ray needs Ray: pip install 'randattn[grid]' (or pip install 'ray>=2.9'), "
                               "or use --backend local") from None
        if not ray.is_initialized():
            try:
                ray.init(address=self.address) if self.address else ray.init()
            except Exception as exc:
                raise BackendError(f"--address {self.address}: cannot connect to a Ray cluster ({exc}); start one with "
                                   "`ray start --head` or drop --address for a local one") from None
            self.owns = True
        resources = ray.cluster_resources()
        cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
        if self.gpus > 0 and gpus < self.gpus:
            raise BackendError(f"--gpus-per-worker {self.gpus:g}: the Ray cluster has {gpus:g} GPUs; add GPU nodes or "
                               "use --gpus-per-worker 0 (CPU workers)")
        if cpus < self.cpus:
            raise BackendError(f"--cpus-per-worker {self.cpus}: the Ray cluster has {cpus:g} CPUs")
        fit = int(gpus // self.gpus) if self.gpus > 0 else int(cpus // self.cpus)
        self.workers = self.workers or max(1, fit)
        return (f"{self.workers} Ray workers ({self.cpus} CPU{'s' if self.cpus > 1 else ''}"
                + (f", {self.gpus:g} GPU" if self.gpus else "")
                + f" each) on a cluster of {cpus:g} CPUs, {gpus:g} GPUs")

    def run(self, units: list[Unit], done: Done, failed: Failed) -> None:
        import ray
        from ray.exceptions import RayActorError

        try:  # Ray >= 2.10: a call in flight when the actor's process or node went away, while it restarts
            from ray.exceptions import ActorUnavailableError
        except ImportError:  # pragma: no cover
            ActorUnavailableError = ()

        actor = ray.remote(Worker).options(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=self.retries,
                                           max_task_retries=self.retries)
        actors = [actor.remote(**self.worker) for _ in range(min(self.workers, len(units)))]
        queue, running, tries = deque(units), {}, {}

        def submit(a):
            if queue:
                unit = queue.popleft()
                running[a.run.remote(unit)] = (a, unit)

        def drop(a):  # a worker gone for good; with none left, what is queued cannot run
            actors.remove(a)
            if not actors:
                for u in queue:
                    failed(u, "not run: every worker died")
                queue.clear()

        for a in actors:
            submit(a)
        try:
            while running:
                (ref,), _ = ray.wait(list(running), num_returns=1)
                a, unit = running.pop(ref)
                try:
                    result = ray.get(ref)
                except ActorUnavailableError as exc:
                    # The actor is being restarted (its node was lost): hand it the same unit again, up to --retries
                    # times (a unit is idempotent: its items are written once, by this driver).
                    tries[unit.id] = tries.get(unit.id, 0) + 1
                    if tries[unit.id] <= self.retries:
                        running[a.run.remote(unit)] = (a, unit)
                        continue
                    failed(unit, f"worker unavailable after {self.retries} retries ({type(exc).__name__})")
                    drop(a)
                    continue
                except RayActorError as exc:  # the worker died and its restarts are used up: drop it
                    failed(unit, f"worker died ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
                    drop(a)
                    continue
                except Exception as exc:  # the unit raised: a bug or a bad setting; the worker goes on
                    failed(unit, _last_line(exc))
                else:
                    done(unit, result)
                submit(a)
        finally:
            for a in actors:
                ray.kill(a)

    def close(self) -> None:
        if self.owns:
            import ray

            ray.shutdown()


def _last_line(exc: Exception) -> str:
    """A remote exception's own message (Ray prefixes the worker's traceback)."""
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
