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
from typing import Optional

import torch

_WORKER = None  # this process's grid_backends.Worker (in a pool process)


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


def pool_size(processes: int, model, units: list) -> int:
    """How many processes run ``units``: ``processes`` when given (>= 1); else (0, auto) 2 on a CPU with two or more
    cores where torch may use two or more threads (``OMP_NUM_THREADS=1`` asks for one core: one process), when two
    more copies of the model fit in a quarter of the RAM and every unit is of a registered kind that pickles, else 1
    (a GPU, a large model, a kind made in this process, or fewer than two units)."""
    from .units import KINDS

    if processes:
        return max(1, min(processes, len(units)))
    if (len(units) < 2 or getattr(model, "device", torch.device("cpu")).type != "cpu" or _cores() < 2
            or torch.get_num_threads() < 2):
        return 1
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ram = _ram()
    if ram is None or 2 * weights > ram / 4 or any(u.kind not in KINDS for u in units):
        return 1
    try:
        pickle.dumps(units)
    except Exception:  # a custom selector defined where a new process cannot import it
        return 1
    return 2


def _start(device: str, cwd: str) -> None:
    global _WORKER
    from .grid_backends import Worker

    _WORKER = Worker(device=device, threads=1, cwd=cwd)


def _run(unit) -> list[list[dict]]:
    """One unit's rows, part by part (in a pool process)."""
    from .units import kind

    model, tok = _WORKER._load(unit.model)
    with torch.no_grad():
        return [list(rows) for rows in kind(unit.kind).run_unit(model, tok, unit)]


def run_pool(todo: list, files: dict, n: int, device: str, bar) -> None:
    """Run ``todo`` in ``n`` processes; append each part's rows to its file in plan order as the loop would."""
    ctx = multiprocessing.get_context("spawn")  # a fork of a process holding torch threads can deadlock
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_start, initargs=(device, os.getcwd())) as pool:
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
