"""Run any probe's units in this process or across a Ray cluster, resumably, into the files its command line writes.

    python -m probes.grid examples/grid_copy.toml                          # here, in this process
    python -m probes.grid examples/grid_copy.toml --backend ray            # a local Ray instance on this machine
    python -m probes.grid examples/grid_math500.toml --backend ray --address auto --gpus-per-worker 1
    python -m probes.grid examples/grid_copy.toml --merge-only             # merge what is done, compute nothing

The spec (TOML, see probes/grid_spec.py) names a probe kind and its configuration fields; it is checked before any
work by the probe's own Config and plan: an unknown key, policy, task or model, or a budget that cannot hold the
protected prompt, stops the command with the key and the fix. Each configuration is planned into units
(probes/units.py: the batches its single-machine run makes, each of items with stable ids, a hash of everything
that decides their rows); each worker loads a model once and runs units one at a time. Every finished item is
written once to ``DIR/items/`` under its id, so a rerun computes only what is missing and a killed worker loses
only the unit it was running. At the end (or with ``--merge-only``) the items are merged into the files
``python -m probes.<probe>`` writes (rows in its order, then its summaries, tables and figures) under
``DIR/<probe>/``; ``python -m probes.<probe> --out DIR/<probe>`` with the same settings finds every row done.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from tqdm.auto import tqdm

from . import units
from .common import positive_int
from .grid_backends import BackendError, FailAt, ItemStore, LocalBackend, RayBackend
from .grid_spec import Spec, SpecError, plans as plan_spec, read_spec
from .units import Plan


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


class Chain:
    """One configuration's plan and its further stages (``Plan.then``), planned as the rows they need come in."""

    def __init__(self, plan: Plan):
        self.plans = [plan]

    @property
    def units(self) -> list:
        return [u for p in self.plans for u in p.units]

    @property
    def outputs(self) -> list:
        return list({o.path: o for p in self.plans for o in p.outputs}.values())

    def extend(self, store: "ItemStore", done: set) -> bool:
        """Plan the next stage when the last one has one and every item so far is done; True when it did."""
        last = self.plans[-1]
        if last.then is None or not all(i in done for u in self.units for i in u.ids):
            return False
        self.plans.append(last.then(merged_rows(self, store, done)))
        return True


def make_plan(spec_path: str, out: "Path | None" = None, figures: bool = False) -> tuple[Spec, list[Chain]]:
    """Read the spec, check every model (tokenizer and shape on this machine) and plan every configuration."""
    spec = read_spec(spec_path, out=out, figures=figures)
    return spec, [Chain(p) for p in plan_spec(spec)]


def all_units(chains: list[Chain]) -> list:
    return [u for c in chains for u in c.units]


def print_plan(chains: list[Chain], done: set[str]) -> None:
    by_output = defaultdict(lambda: [0, 0, 0])
    for u in all_units(chains):
        c = by_output[u.output]
        c[0] += 1
        c[1] += len(u.ids)
        c[2] += sum(i in done for i in u.ids)
    for path, (n_units, items, finished) in by_output.items():
        print(f"  {path}: {items} items in {n_units} units, {finished} done")
    if any(c.plans[-1].then for c in chains):
        print("  (and a further stage planned from these rows: the compression sweep's budgets)")


class Progress:
    """Writes each finished unit's items and keeps the cluster-wide count (tqdm: items done / total, failures)."""

    def __init__(self, store: ItemStore, total: int, done_before: int, desc: str):
        self.store, self.failures, self.written, self.tokens = store, [], 0, 0
        self.workers = Counter()
        self.bar = tqdm(total=total, initial=done_before, desc=desc, unit="item", dynamic_ncols=True)

    def done(self, unit, result) -> None:
        seconds = result["seconds"] / max(1, len(unit.items))
        for item_id, item in zip(unit.ids, unit.items):
            # each row with its place among the unit's rows, so the merge writes them in the order a local run does
            order = [n for n, r in enumerate(result["rows"]) if units.rows_of_item(unit, item, [r])]
            record = {"id": item_id, "unit": unit.id, "kind": unit.kind, "output": unit.output,
                      "key": {**unit.fixed, **item}, "rows": [result["rows"][n] for n in order], "order": order,
                      "worker": result["worker"], "device": result["device"], "seconds": seconds,
                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
            self.written += self.store.write(item_id, record)
        self.tokens += result["tokens"]
        self.workers[result["worker"]] += len(unit.ids)
        self.bar.update(len(unit.ids))

    def failed(self, unit, reason: str) -> None:
        self.failures.append((unit, reason))
        self.bar.set_postfix_str(f"failed {sum(len(u.ids) for u, _ in self.failures)} items")
        tqdm.write(f"unit {unit.id} ({len(unit.ids)} items, {unit.label or unit.items[0]}) failed: {reason}")


def merged_rows(chain: Chain, store: ItemStore, done: set) -> dict:
    """``{output path: rows}`` of the finished items, in the order a single-machine run writes them."""
    rows = defaultdict(list)
    for unit in chain.units:
        have = []
        for n, i in enumerate(unit.ids):
            if i in done:
                record = store.read(i)
                # the row's place among its unit's rows; an item without places keeps its rows in item order
                places = record.get("order") or [len(unit.ids) * 10**6 + n * 10**4 + k
                                                 for k in range(len(record["rows"]))]
                have += list(zip(places, record["rows"]))
        rows[unit.output] += [r for _, r in sorted(have, key=lambda x: x[0])]
    return rows


def merge(chains: list[Chain], store: ItemStore, figures: bool) -> tuple[list[Path], int]:
    """Write each configuration's result files from the finished items (the files its command line writes: rows,
    then the kind's summaries, tables and figures); returns the paths and the items still missing."""
    done = store.done()
    paths, missing = [], 0
    for chain in chains:
        missing += sum(i not in done for u in chain.units for i in u.ids)
        rows = merged_rows(chain, store, done)
        outputs = [o for o in chain.outputs if rows.get(o.path)]
        if not outputs:
            continue
        for o in outputs:
            units.write_rows(o, rows[o.path])
        last = chain.plans[-1]
        merged = Plan(last.kind, last.config, outputs, chain.units, meta=last.meta)
        paths += units.kind(last.kind).merge(merged, rows, figures)
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
        spec, chains = make_plan(args.spec, out, figures=not args.no_figure)
    except SpecError as exc:
        p.error(f"{args.spec}: {exc}")
    store = ItemStore(out)
    done = store.done()
    while any([c.extend(store, done) for c in chains]):  # stages whose rows are in already (a rerun, --merge-only)
        pass

    def pending_units():
        return [u for u in all_units(chains) if not all(i in done for i in u.ids)]

    def n_items():
        return sum(len(u.ids) for u in all_units(chains))

    pending = pending_units()
    n_outputs = len({o.path for c in chains for o in c.outputs})
    print(f"grid {args.spec} ({spec.probe}): {n_items()} items in {len(all_units(chains))} units, {n_outputs} result "
          f"files under {out}; {sum(i in done for u in all_units(chains) for i in u.ids)} items done, {len(pending)} "
          "units to run")
    if args.plan:
        print_plan(chains, done)
        return 0
    progress = backend = None
    if pending and not args.merge_only:
        worker = {"device": spec.device, "threads": args.cpus_per_worker, "fail": FailAt.from_env()}
        backend = (LocalBackend(worker) if args.backend == "local" else
                   RayBackend(worker, address=args.address, workers=args.workers, gpus=args.gpus_per_worker,
                              cpus=args.cpus_per_worker or 1, retries=args.retries))
        try:
            print(f"backend {backend.name}: {backend.start()}")
        except BackendError as exc:
            p.error(str(exc))
        progress = Progress(store, n_items(), n_items() - sum(len(u.ids) for u in pending), f"grid ({backend.name})")
        t0 = time.perf_counter()
        try:
            while pending:
                backend.run(pending, progress.done, progress.failed)
                done = store.done()
                if not any([c.extend(store, done) for c in chains]):
                    break
                pending = pending_units()  # a further stage (the compression sweep) planned from the rows
                progress.bar.total = n_items()
                progress.bar.refresh()
        finally:
            progress.bar.close()
            backend.close()
        wall = time.perf_counter() - t0
        ran = sum(progress.workers.values())
        print(f"\nran {ran} items in {wall:.1f} s on {len(progress.workers)} worker(s): {ran / wall:.2f} items/s, "
              f"{progress.tokens / wall:.0f} tokens/s" + "".join(f"\n  {w}: {n} items" for w, n in
                                                                progress.workers.most_common()))
    paths, missing = merge(chains, store, figures=not args.no_figure)
    print("\n" + "\n".join(f"wrote {x}" for x in paths))
    failed = progress.failures if progress else []
    if failed:
        print(f"\n{sum(len(u.ids) for u, _ in failed)} items in {len(failed)} units failed:"
              + "".join(f"\n  {u.id} {u.label or u.items[0]}: {why}" for u, why in failed[:10]))
    total = n_items()
    if missing or any(c.plans[-1].then for c in chains):
        print(f"\nINCOMPLETE: {missing} of {total} items missing" + (" (and a stage not yet planned)" if not missing
                                                                      else "")
              + "; the merged files hold the rest. Rerun the same command to compute only the missing items.")
        return 1
    print(f"\ncomplete: {total} items merged into {n_outputs} result files under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
