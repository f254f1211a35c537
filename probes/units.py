"""Every probe as units: ``plan(config, model) -> Plan``, ``run_unit(model, tok, unit) -> rows``, ``merge(...)``.

A probe *kind* is three functions and its config class; its command line is the one :func:`command` makes of them,
and it is registered by one line in ``analysis/registry.py`` (which :data:`KINDS` reads)::

    KIND = units.Kind("my_probe", Config, plan, run_unit, merge)      # at the end of probes/my_probe.py
    def main(argv=None): return units.command(KIND, __doc__)(argv)   # python -m probes.my_probe

- ``plan(config, model: ModelInfo) -> Plan`` runs on the driver, with the tokenizer and the model's shape but not
  necessarily its weights (:class:`ModelInfo`). It checks everything a run could refuse (raising
  :class:`~probes.config.ConfigError` naming the field) and returns the result files (:class:`Output`: path, the
  config record stored in every row, key fields) and the :class:`Unit` s that fill them, in the order a fresh
  single-machine run computes them. A unit is one batch of that run: what makes its rows is fixed by the plan, not
  by scheduling, so every backend computes the same rows. ``Plan.then``, when set, plans a further stage from the
  rows of the first (the accuracy harness's ``--compression`` sweep, which needs full attention's lengths first).
- ``run_unit(model, tok, unit)`` runs on a worker with the model loaded; it reads only ``unit.work`` (JSON-able or
  picklable inputs the plan put there) and yields one list of rows per part of the unit (``unit.parts``, in order:
  a planted-fact batch yields each condition's rows as it finishes; most units have one part). Each row carries
  its key fields. :func:`unit_rows` collects them into one list. ``Unit.kind`` names the kind whose ``run_unit``
  runs it: the planted-fact probes plan and merge their own way but all plan units of the runner kind ``planted``
  (``probes.planted_run``: a batch of instances replayed under conditions).
- ``merge(plan, rows, figures) -> list[Path]`` turns the rows of each output (``{output path: rows}``, in plan
  order) into the probe's summaries, tables and figures, printing its summary; returns the files written.

A unit names its rows by key: ``fixed`` (key fields shared by all its rows, e.g. the accuracy arm), ``items`` (one
dict per item, e.g. ``{"problem": ..., "run": ...}`` or ``{"instance": i}``), ``parts`` (e.g. ``{"condition":
"h0"}``) and ``fanout`` (more rows per item and part, e.g. ``{"fact": [0, 1]}``). Each item has a stable id (a hash
of its output's config, the unit's key fields and the unit's membership), which the grid stores it under.

Backends run units and never know which probe they belong to:

- :func:`run_local` (every probe's command line, :func:`command`: the kind's ``check``, load the model, ``plan``,
  the kind's ``planned``, open the files, its ``start``, the units, ``merge`` or the kind's ``report``): the units
  of a plan in this process, in plan order, each part appended to its :class:`~probes.results.ResultsFile` as it
  finishes (one write and one fsync). Resume is the results rule: a unit whose rows are all in the file is
  skipped, one with some parts done runs only the missing parts (:meth:`Unit.pending`), so a killed run resumes
  to the same rows, and bad input is refused before a byte changes.
- ``probes.grid`` with ``probes.grid_backends`` (``--backend local|ray``): the same units from a TOML spec of any
  registered kind, each finished item written once to ``DIR/items/`` by the driver (a Ray actor per worker returns
  rows, never writes), then merged into the files :func:`run_local` writes, row for row and in the same order
  (each item keeps its rows' places among its unit's rows), and the kind's ``merge``.

Driving units from code (a leaderboard, a notebook)::

    from probes import units
    k = units.kind("head_pooling")                   # registered in KINDS, or any Kind made in this process
    config = k.config(instances=8)
    plan, files = units.run(k, config)                # load the model, plan, run the pending units here
    k.merge(plan, {path: rf.rows for path, rf in files.items()}, False)

On a cluster, the units of several plans go to
``probes.grid_backends.RayBackend(...).run(units, done, failed)`` as ``probes.grid`` does.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from tqdm.auto import tqdm

from analysis import registry

__all__ = ["Unit", "Output", "Plan", "Kind", "ModelInfo", "KINDS", "kind", "register", "stable_id", "make_unit",
           "run_local", "unit_rows", "rows_of_item", "open_files", "write_rows", "run", "command", "load"]


def stable_id(*parts: Any) -> str:
    """A short hash of JSON-able parts (dict keys sorted), the same on every machine and run."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass
class Output:
    """One result file of a plan: where it goes, the config record in each of its rows, its key fields."""

    path: str
    config: dict
    key: tuple[str, ...]
    meta: dict = field(default_factory=dict)  # whatever the kind's merge needs about this file


@dataclass
class Unit:
    """One batch of a probe's run: everything a worker needs besides the model weights, and the keys of its rows."""

    kind: str
    model: str  # what the worker loads (randattn.load_model's name)
    output: str  # Output.path its rows go to
    fixed: dict  # key fields shared by every row of the unit
    items: list[dict]  # per item, its own key fields, in row order
    work: dict  # the inputs run_unit reads
    parts: list[dict] = field(default_factory=lambda: [{}])  # run_unit yields one list of rows per part, in order
    fanout: dict = field(default_factory=dict)  # key field -> values: more rows per item and part
    ids: list[str] = field(default_factory=list)  # per item, its stable id (make_unit)
    id: str = ""
    label: str = ""  # a short description for progress and failure messages
    stage: str = ""  # the progress bar a command line shows it under (default: its plan's kind)
    # A unit that resumes a file shared with the units before it (the leaderboard's passcode and planted batches
    # extend one scratch run per policy), or that times something (the leaderboard's cost units: a unit beside it
    # would share its cores): run in plan order in one process, never side by side.
    serial: bool = False

    def __post_init__(self):
        self.id = self.id or stable_id(self.ids or self.items)

    def keys(self, item: dict, parts: Optional[list[dict]] = None) -> Iterator[dict]:
        """The full keys of the rows ``item`` gets (for ``parts``, default all)."""
        names = list(self.fanout)
        for part in self.parts if parts is None else parts:
            for combo in itertools.product(*(self.fanout[n] for n in names)):
                yield {**self.fixed, **item, **part, **dict(zip(names, combo))}

    def pending(self, done: set, key_fields: tuple[str, ...]) -> Optional["Unit"]:
        """This unit narrowed to the parts some of whose rows are not in ``done`` (row keys as
        :meth:`ResultsFile.key` makes them); None when every row is there."""
        def missing(part):
            return any(_key(k, key_fields) not in done for item in self.items for k in self.keys(item, [part]))

        parts = [p for p in self.parts if missing(p)]
        if not parts:
            return None
        if len(parts) == len(self.parts):
            return self
        return Unit(self.kind, self.model, self.output, self.fixed, self.items, self.work, parts, self.fanout,
                    self.ids, self.id, self.label, self.stage)


def _key(row: dict, key_fields: tuple[str, ...]) -> tuple:
    return tuple(_hashable(row[k]) for k in key_fields)


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def make_unit(kind: str, model: str, output: Output, fixed: dict, items: list[dict], work: dict, *,
              parts: Optional[list[dict]] = None, fanout: Optional[dict] = None, salt: Any = None,
              label: str = "", stage: str = "", serial: bool = False) -> Unit:
    """A unit whose item ids hash the output's config (less where it was measured), the unit's key fields, the
    item and the unit's membership (a batch's composition and seed decide its rows); ``salt``: anything else that
    decides them and is in no key (e.g. a batch seed)."""
    from .results import INFORMATIONAL

    config = {k: v for k, v in output.config.items() if k not in INFORMATIONAL}
    parts, fanout = parts or [{}], fanout or {}
    ids = [stable_id(config, fixed, parts, fanout, salt, item, items) for item in items]
    return Unit(kind, model, output.path, fixed, items, work, parts, fanout, ids, label=label, stage=stage,
                serial=serial)


@dataclass
class Plan:
    """What one probe configuration computes: its result files and the units that fill them, in run order."""

    kind: str
    config: Any
    outputs: list[Output]
    units: list[Unit]
    then: Optional[Callable[[dict], "Plan"]] = None  # a further stage, planned from {output path: rows} so far
    meta: dict = field(default_factory=dict)

    @property
    def items(self) -> list[str]:
        return [i for u in self.units for i in u.ids]

    def output(self, path: str) -> Output:
        return next(o for o in self.outputs if o.path == path)


@dataclass
class Kind:
    """A registered probe kind: its config class and its plan / run_unit / merge."""

    name: str
    config: type
    plan: Optional[Callable[[Any, "ModelInfo"], Plan]]  # None: a runner only, for units other kinds plan
    run_unit: Callable[[Any, Any, Unit], Iterable[list[dict]]]
    merge: Optional[Callable[[Plan, dict, bool], list]]
    results: str = ""  # the folder under data/results/ (default: the name)
    grid_folder: Optional[Callable[[Any], str]] = None  # a grid's subfolder of DIR/<results>/ for one config
    # The command line's own steps around the units (a grid does none of them): ``check(config)`` refuses what it
    # can before the model loads (a missing traces file); ``planned(plan)`` runs on the driver once the plan is
    # made, before any result file is opened (what must be on disk before a file is touched or discarded: the
    # leaderboard's registration of its tasks; a description printed before a refusal of ``--out``);
    # ``start(plan, files)`` with the result files open (``{path: ResultsFile}``), before the first unit (the
    # run's description, a replay-parity pre-check); ``report(plan, rows, figures)``, as ``merge`` takes them, is
    # what the command line prints and writes after the units where that differs from the grid's ``merge`` (the
    # passcode's and the accuracy harness's tables; default: ``merge``).
    check: Optional[Callable[[Any], None]] = None
    start: Optional[Callable[[Plan, dict], None]] = None
    planned: Optional[Callable[[Plan], None]] = None
    report: Optional[Callable[[Plan, dict, bool], Any]] = None

    def __post_init__(self):
        self.results = self.results or self.name
        _LOADED.setdefault(self.name, self)  # a kind made in this process runs here without registering


#: kind name -> the module that defines ``KIND`` (imported when the kind is first asked for): every probe of
#: :data:`analysis.registry.PROBES`, then the runners of units other kinds plan (``planted``, ``nll``).
KINDS: dict[str, str] = registry.kinds()
_LOADED: dict[str, Kind] = {}


def register(name: str, module: str) -> None:
    """Make ``module`` (which defines ``KIND``) the kind ``name`` in this process (a probe outside this package):
    the grid and the backends find it by name. A probe of this package is one line in ``analysis/registry.py``."""
    KINDS[name] = module
    _LOADED.pop(name, None)


def kind(name: str) -> Kind:
    """The kind ``name``: a registered one (:data:`KINDS`) or one made in this process; KeyError naming the known
    kinds otherwise."""
    if name not in _LOADED:
        module = KINDS.get(name)
        if module is None:
            raise KeyError(f"{name!r} is not a probe kind; choose from {', '.join(sorted(KINDS))} (a new probe is "
                           "one line in analysis/registry.py)")
        module, _, attr = module.partition(":")  # "package.module[:NAME]": a module's KIND, or its NAME
        _LOADED[name] = getattr(importlib.import_module(module), attr or "KIND")
    return _LOADED[name]


# -- what the driver knows about a model -------------------------------------------------------------
class ModelInfo:
    """A model as a plan sees it: its name, tokenizer, HF config, which model it is (``ref``, a
    :class:`randattn.ModelRef`: embedded or not), its generation config, and the loaded model when the planner has it
    (a local run). Policies bind to it (:meth:`randattn.Policy.bind` reads its ``config`` and, through
    :meth:`randattn.ModelRef.of_model`, its ``ref``), so a grid's driver refuses a policy that cannot serve a model
    without loading any weights. ``ref`` defaults to ``randattn.ModelRef.of(name)``."""

    def __init__(self, name: str, tokenizer, config, *, ref=None, generation_config=None, model=None):
        from randattn import ModelRef

        self.name, self.tokenizer, self.config = name, tokenizer, config
        (ref if ref is not None else ModelRef.of(name)).attach(self)
        self.generation_config = generation_config
        self.model = model

    @property
    def ref(self):
        """Which model this is (a :class:`randattn.ModelRef`)."""
        from randattn import ModelRef

        return ModelRef.of_model(self)

    @property
    def embedded(self) -> Optional[str]:
        """The embedded model's key, or None."""
        return self.ref.embedded

    @property
    def bind_target(self):
        """What policies bind to: the loaded model when there is one, else this weightless view."""
        return self.model if self.model is not None else self

    @property
    def shape(self) -> tuple[int, int]:
        """``(KV heads, layers)``."""
        from .planted import model_shape

        return model_shape(self.bind_target)

    @classmethod
    def loaded(cls, name: str, model, tokenizer) -> "ModelInfo":
        from randattn import ModelRef

        return cls(name, tokenizer, model.config, ref=ModelRef.of_model(model),
                   generation_config=getattr(model, "generation_config", None), model=model)


# -- the local backend -----------------------------------------------------------------------------
def unit_rows(k: Kind, model, tok, unit: Unit) -> list[dict]:
    """Every row of one unit, all parts together."""
    return [r for part in k.run_unit(model, tok, unit) for r in part]


def rows_of_item(unit: Unit, item: dict, rows: list[dict]) -> list[dict]:
    """The rows of ``rows`` that belong to ``item`` of ``unit`` (their key fields match it)."""
    return [r for r in rows if all(r.get(f) == v for f, v in item.items())]


def open_files(plan: Plan, *, restart: bool = False) -> dict:
    """``{output path: ResultsFile}`` for every output of the plan (refusing, naming ``out``, a file that is not ours
    or holds another configuration, before anything runs)."""
    from .config import ConfigError
    from .results import ResultsFile

    files = {}
    for o in plan.outputs:
        try:
            files[o.path] = ResultsFile(o.path, o.config, o.key, restart=restart)
        except (ValueError, PermissionError) as exc:
            raise ConfigError("out", str(exc)) from None
    return files


def run_local(plan: Plan, model, tok, *, restart: bool = False, desc: Optional[str] = None,
              files: Optional[dict] = None, stages: Optional[list] = None) -> dict:
    """Run every pending unit of ``plan`` (and of its further stages) here, appending each part's rows to its
    results file as it finishes; returns ``{output path: ResultsFile}``. ``stages``: a list that gets each plan
    run (the first, then each ``then``), so a caller merges with the last."""
    files = dict(files or {})
    announced: set = set()  # a resumed file is announced once, not again at each later stage that appends to it
    while True:
        if stages is not None:
            stages.append(plan)
        fresh = [o for o in plan.outputs if o.path not in files]
        files.update(open_files(Plan(plan.kind, plan.config, fresh, []), restart=restart))
        # One progress bar (and one "already there" line) per run of consecutive units of one stage; a caller's
        # ``desc`` names them all.
        for stage, group in itertools.groupby(plan.units, key=lambda u: desc or u.stage or plan.kind):
            _run_group(list(group), files, model, tok, stage, getattr(plan.config, "processes", 1), announced)
        if plan.then is None:
            return files
        plan = plan.then({path: rf.rows for path, rf in files.items()})


def _run_group(group: list[Unit], files: dict, model, tok, desc: str, processes: int = 1,
               announced: Optional[set] = None) -> None:
    todo = []
    for u in group:
        rf = files[u.output]
        p = u.pending(rf.done, rf.key_fields)
        if p is not None:
            todo.append(p)
    total = sum(len(u.parts) for u in group)
    left = sum(len(u.parts) for u in todo)
    paths = ', '.join(sorted({str(files[u.output].path) for u in group}))
    if total and left < total and paths not in (announced if announced is not None else ()):
        if announced is not None:
            announced.add(paths)
        tqdm.write(f"{paths}: {total - left} of "
                   f"{total} batch results already there (an earlier run, or the results shipped with the repo); "
                   + ("computing the rest" if todo else "nothing to compute, printing them")
                   + "; --restart recomputes everything")
    if todo:
        bar = tqdm(total=total, initial=total - left, desc=desc, unit="batch")
        from .unit_pool import pool_size, run_pool

        n = pool_size(processes, model, todo, KINDS)
        try:
            if n > 1:  # side by side, one thread each (probes.unit_pool); the same rows, appended in this order
                run_pool(todo, files, n, str(getattr(model, "device", "cpu")), bar, kind)
                return
            for u in todo:  # a unit's kind names its runner (the planted-fact probes share one)
                for rows in kind(u.kind).run_unit(model, tok, u):
                    files[u.output].append(rows)
                    bar.update(1)
        finally:
            bar.close()


def write_rows(output: Output, rows: list[dict]) -> None:
    """Write a merged result file in :class:`~probes.results.ResultsFile`'s format (config in every row), replacing
    it atomically (a temporary file, then ``os.replace``), and only over a file of ours."""
    from .results import ResultsFile, check_ours

    path = Path(output.path)
    check_ours(path, output.key)  # a merge replaces the file: never one the user put there
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    ResultsFile(tmp, output.config, output.key).append(rows)
    tmp.replace(path)


# -- a probe's command line -------------------------------------------------------------------------
def load(config, loaded=None):
    """``(model, tokenizer)``: ``loaded`` when given, else the config's model on its device (a failure to load is a
    :class:`~probes.config.ConfigError` naming ``model`` or ``device``)."""
    if loaded is not None:
        return loaded
    import randattn

    from .config_errors import ConfigError

    try:
        return randattn.load_model(config.model, device=config.device)
    except (FileNotFoundError, OSError, ValueError, RuntimeError) as exc:
        raise ConfigError("model" if "device" not in str(exc).lower() else "device", str(exc)) from None


def run(k: "Kind | str", config, model=None, tokenizer=None, *, desc: Optional[str] = None) -> tuple[Plan, dict]:
    """The local backend for one configuration: the kind's check, load the model (unless given), plan, the kind's
    planned, open the files, the kind's start, run the pending units; ``(the plan to merge: every stage's outputs
    and units, the last stage's meta; {output path: ResultsFile})``."""
    k = kind(k) if isinstance(k, str) else k
    import randattn

    if k.check is not None:
        k.check(config)
    if getattr(config, "out", None) is not None:  # a broken --out is refused before the model loads, as it was
        from .results import out_folder

        out_folder(k.name, config.out)
    model, tokenizer = load(config, None if model is None else (model, tokenizer))
    p = k.plan(config, ModelInfo.loaded(getattr(config, "model", None) or randattn.DEFAULT_MODEL, model, tokenizer))
    if k.planned is not None:
        k.planned(p)
    restart = getattr(config, "restart", False)
    files = open_files(p, restart=restart)  # a file not ours, or of another configuration, is refused first
    if k.start is not None:
        k.start(p, files)
    stages: list = []
    files = run_local(p, model, tokenizer, restart=restart, desc=desc, files=files, stages=stages)
    # What merge gets, as a grid merges a plan and its further stages: every stage's outputs and units, the last's meta.
    last = stages[-1]
    outputs = list({o.path: o for s in stages for o in s.outputs}.values())
    return Plan(last.kind, last.config, outputs, [u for s in stages for u in s.units], meta=last.meta), files


def command(k: Kind, doc: str = "") -> Callable:
    """``main(argv)``: a kind's command line, the only one: parse its Config, run it here (:func:`run`), then its
    merge on the rows (figures unless ``--no-figure``), as a grid merges them, or its ``report`` where the command
    line's tables differ from the grid's."""
    from . import cli

    def body(config):
        p, files = run(k, config)
        (k.report or k.merge)(p, {path: rf.rows for path, rf in files.items()}, not getattr(config, "no_figure", True))

    return lambda argv=None: cli.main(k.config, body, argv, doc)
