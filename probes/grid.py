"""Run a probe or accuracy grid in this process or across a Ray cluster, resumably, into one merged result.

    python -m probes.grid examples/grid_copy.toml                          # here, in this process
    python -m probes.grid examples/grid_copy.toml --backend ray            # a local Ray instance on this machine
    python -m probes.grid examples/grid_math500.toml --backend ray --address auto --gpus-per-worker 1
    python -m probes.grid examples/grid_copy.toml --merge-only             # merge what is done, compute nothing

The spec (TOML, see probes/grid_spec.py) is checked before any work: an unknown key, policy, task or model, or a
budget that cannot hold the protected prompt, stops the command with the key and the fix. It expands into
items (accuracy: one generation of one problem in one run; passcode: one instance) grouped into units, the
batches a single-machine run would make; each worker loads a model once and runs units one at a time. Every
finished item is written once to ``DIR/items/`` under its stable id (a hash of everything that decides its
rows), so a rerun computes only what is missing and a killed worker loses only the unit it was running. At the
end (or with ``--merge-only``) the items are merged into the files ``python -m probes.accuracy`` /
``python -m probes.passcode`` write (rows, summaries, tables, figures) under ``DIR/accuracy/`` or
``DIR/passcode/``; ``python -m figures --probe accuracy --results FILE`` draws them again.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from tqdm.auto import tqdm

from .common import positive_int
from .grid_backends import BackendError, FailAt, ItemStore, LocalBackend, RayBackend
from .grid_kinds import MERGE, PLAN, Plan
from .grid_spec import Spec, SpecError, check_model, read_spec


def grid_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m probes.grid", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="grid spec (TOML): examples/grid_copy.toml, examples/grid_math500.toml")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local: this process; ray: one Ray actor per worker (default: %(default)s)")
    p.add_argument("--address", default=None, help="Ray cluster address ('auto', 'ray://head:10001'); default: start "
                                                   "a local Ray instance")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="Ray workers (default: as many as the cluster fits: GPUs / --gpus-per-worker, else CPUs / "
                        "--cpus-per-worker)")
    p.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs each Ray worker asks for (0: CPU workers)")
    p.add_argument("--cpus-per-worker", type=positive_int, default=None,
                   help="CPUs (and torch threads) per worker (default: 1 on Ray, torch's default locally)")
    p.add_argument("--retries", type=int, default=2,
                   help="restarts of a crashed Ray worker, its unit retried (default: %(default)s)")
    p.add_argument("--out", default=None, help="grid directory (default: data/results/grid/<spec name>/)")
    p.add_argument("--merge-only", action="store_true", help="merge the finished items; run nothing")
    p.add_argument("--plan", action="store_true", help="print the plan (items, units, result files) and stop")
    p.add_argument("--no-figure", action="store_true", help="do not draw figures when merging")
    return p


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.backend == "local":
        for flag, value in (("--address", args.address), ("--workers", args.workers),
                            ("--gpus-per-worker", args.gpus_per_worker or None)):
            if value is not None:
                p.error(f"{flag} needs --backend ray; the local backend runs one worker in this process")
    if args.gpus_per_worker < 0:
        p.error(f"--gpus-per-worker {args.gpus_per_worker:g}: must be >= 0")
    if args.retries < 0:
        p.error(f"--retries {args.retries}: must be >= 0")


def make_plan(spec_path: str) -> tuple[Spec, Plan]:
    """Read the spec, check every model (tokenizer and shape on this machine) and expand it."""
    spec = read_spec(spec_path)
    models = {m: check_model(m, "models") for m in spec.models}
    names = [Path(m).name for m in spec.models]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash:
        raise SpecError(f"models: two models end in {clash!r}, so their result files would share a name; copy or "
                        "link one under another directory name")
    return spec, PLAN[spec.probe](spec, models)


def print_plan(plan: Plan, done: set[str]) -> None:
    by_output = defaultdict(lambda: [0, 0, 0])
    for u in plan.units:
        c = by_output[u.output]
        c[0] += 1
        c[1] += len(u.items)
        c[2] += sum(i in done for i in u.items)
    for path, (units, items, finished) in by_output.items():
        print(f"  {path}: {items} items in {units} units, {finished} done")


class Progress:
    """Writes each finished unit's items and keeps the cluster-wide count (tqdm: items done / total, failures)."""

    def __init__(self, store: ItemStore, total: int, done_before: int, desc: str):
        self.store, self.failures, self.written, self.tokens = store, [], 0, 0
        self.workers = Counter()
        self.bar = tqdm(total=total, initial=done_before, desc=desc, unit="item", dynamic_ncols=True)

    def done(self, unit, result) -> None:
        seconds = result["seconds"] / max(1, len(unit.items))
        for item_id, key, rows in zip(unit.items, unit.keys, result["rows"]):
            record = {"id": item_id, "unit": unit.id, "kind": unit.kind, "output": unit.output, "key": key,
                      "rows": rows, "worker": result["worker"], "device": result["device"], "seconds": seconds,
                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
            self.written += self.store.write(item_id, record)
        self.tokens += result["tokens"]
        self.workers[result["worker"]] += len(unit.items)
        self.bar.update(len(unit.items))

    def failed(self, unit, reason: str) -> None:
        self.failures.append((unit, reason))
        self.bar.set_postfix_str(f"failed {sum(len(u.items) for u, _ in self.failures)} items")
        tqdm.write(f"unit {unit.id} ({len(unit.items)} items, {unit.keys[0]}) failed: {reason}")


def merge(plan: Plan, store: ItemStore, out: Path, figures: bool) -> tuple[list[Path], int]:
    """Merge the finished items into the probes' result files; returns the paths and the items still missing."""
    done = store.done()
    rows, missing = defaultdict(list), 0
    for unit in plan.units:
        for item_id in unit.items:
            if item_id in done:
                rows[unit.output] += store.read(item_id)["rows"]
            else:
                missing += 1
    groups = defaultdict(list)
    for o in plan.outputs:
        if rows.get(o.path):
            groups[o.group].append(o)
    paths = []
    for outputs in groups.values():
        paths += MERGE[outputs[0].kind](outputs, rows, out, figures)
    return paths, missing


def main(argv=None) -> int:
    p = grid_parser()
    args = p.parse_args(argv)
    check_flags(p, args)
    out = Path(args.out) if args.out else Path("data/results/grid") / Path(args.spec).stem
    for parent in (out, *out.parents):
        if parent.exists() and not parent.is_dir():
            p.error(f"--out: {parent} is a file, not a folder; --out names the grid's directory (items and merged "
                    "results go under it)")
    try:
        spec, plan = make_plan(args.spec)
    except SpecError as exc:
        p.error(f"{args.spec}: {exc}")
    store = ItemStore(out)
    items = plan.items
    done = store.done() & set(items)
    pending = [u for u in plan.units if not all(i in done for i in u.items)]
    print(f"grid {args.spec} ({spec.probe}): {len(items)} items in {len(plan.units)} units, "
          f"{len(plan.outputs)} result files under {out}; {len(done)} items done, {len(pending)} units to run")
    if args.plan:
        print_plan(plan, done)
        return 0
    progress = None
    if pending and not args.merge_only:
        worker = {"device": spec.device, "threads": args.cpus_per_worker, "fail": FailAt.from_env()}
        backend = (LocalBackend(worker) if args.backend == "local" else
                   RayBackend(worker, address=args.address, workers=args.workers, gpus=args.gpus_per_worker,
                              cpus=args.cpus_per_worker or 1, retries=args.retries))
        try:
            print(f"backend {backend.name}: {backend.start()}")
        except BackendError as exc:
            p.error(str(exc))
        progress = Progress(store, len(items), len(done), f"grid ({backend.name})")
        t0 = time.perf_counter()
        try:
            backend.run(pending, progress.done, progress.failed)
        finally:
            progress.bar.close()
            backend.close()
        wall = time.perf_counter() - t0
        ran = sum(progress.workers.values())
        print(f"\nran {ran} items in {wall:.1f} s on {len(progress.workers)} worker(s): {ran / wall:.2f} items/s, "
              f"{progress.tokens / wall:.0f} tokens/s" + "".join(f"\n  {w}: {n} items" for w, n in
                                                                progress.workers.most_common()))
    paths, missing = merge(plan, store, out, figures=not args.no_figure)
    print("\n" + "\n".join(f"wrote {x}" for x in paths))
    failed = progress.failures if progress else []
    if failed:
        print(f"\n{sum(len(u.items) for u, _ in failed)} items in {len(failed)} units failed:"
              + "".join(f"\n  {u.id} {u.keys[0]}: {why}" for u, why in failed[:10]))
    if missing:
        print(f"\nINCOMPLETE: {missing} of {len(items)} items missing; the merged files hold the rest. Rerun the same "
              "command to compute only the missing items.")
        return 1
    print(f"\ncomplete: {len(items)} items merged into {len(plan.outputs)} result files under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
