"""Units side by side on a CPU: a pool of worker processes, one torch thread each, rows written in plan order.

On this project's 2-core machines a probe's forwards are GEMM-bound and torch's second thread adds only ~1.4x
(measured: 8.5 ms vs 6.0 ms for one layer's matrices at 128 rows, issue 36); two processes of one thread each run two
units in the time one two-thread process runs 1.4 of them, and the Python between the kernels runs in parallel too.
Every float is the same: a GEMM row does not depend on the thread count or the batch around it (checked bit for bit
by ``bench.main_job`` and the tests). Rows are appended by the driver alone, unit after unit in the plan's order, as
the one-process loop appends them, so the files are byte-identical and a killed run loses at most the units still
in flight (resumed like any other).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Container, Optional

import torch

_WORKER: dict = {}  # this process's device and loaded model (in a pool process)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _ram() -> Optional[int]:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def pool_size(processes: int, model, units: list, known: Container[str]) -> int:
    """How many processes run ``units``: 1 when any unit is ``serial`` (it extends a file the units before it
    wrote, or it is timed); ``processes`` when given (>= 1); else (0, auto) 2 on a CPU with two or more
    cores where torch may use two or more threads (``OMP_NUM_THREADS=1`` asks for one core: one process), when two
    more copies of the model fit in a quarter of the RAM and every unit is of a kind in ``known`` (the registered
    kinds, which a new process can import) and pickles, else 1 (a GPU, a large model, a kind made in this process,
    or fewer than two units)."""
    if any(getattr(u, "serial", False) for u in units):
        return 1
    if processes:
        return max(1, min(processes, len(units)))
    if (len(units) < 2 or getattr(model, "device", torch.device("cpu")).type != "cpu" or _cores() < 2
            or torch.get_num_threads() < 2):
        return 1
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ram = _ram()
    if ram is None or 2 * weights > ram / 4 or any(u.kind not in known for u in units):
        return 1
    try:
        pickle.dumps(units)
    except Exception:  # a custom selector defined where a new process cannot import it
        return 1
    return 2


def _start(device: str, cwd: str, resolve: Callable) -> None:
    # The worker's own set-up, not grid_backends.Worker's: that module imports probes.units, which imports this one.
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)  # so relative paths and MODULE:CALLABLE selectors resolve as on the driver
    torch.set_num_threads(1)
    _WORKER.update(device=device, resolve=resolve, name=None, model=None)


def _load(name: str):
    if name != _WORKER["name"]:
        import randattn

        _WORKER["model"] = None
        _WORKER["model"] = randattn.load_model(name, device=_WORKER["device"])
        _WORKER["name"] = name
    return _WORKER["model"]


def _run(unit) -> list[list[dict]]:
    """One unit's rows, part by part (in a pool process)."""
    model, tok = _load(unit.model)
    with torch.no_grad():
        return [list(rows) for rows in _WORKER["resolve"](unit.kind).run_unit(model, tok, unit)]


def run_pool(todo: list, files: dict, n: int, device: str, bar, resolve: Callable) -> None:
    """Run ``todo`` in ``n`` processes; append each part's rows to its file in plan order as the loop would.
    ``resolve(name)`` is the kind of that name (``probes.units.kind``, passed by reference: this module is imported
    by ``probes.units`` and must not import it back)."""
    ctx = multiprocessing.get_context("spawn")  # a fork of a process holding torch threads can deadlock
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_start, initargs=(device, os.getcwd(), resolve)) as pool:
        futures = [pool.submit(_run, u) for u in todo]
        try:
            for unit, future in zip(todo, futures):
                for rows in future.result():
                    files[unit.output].append(rows)
                    bar.update(1)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
