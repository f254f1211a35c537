"""Result file names: how each probe names the files it writes, defined once, for the probes that write them and for
``figures`` and ``figures.tables``, which find them (figures may not import probes; both may import this package).

    result_name("head_pooling", record)               # 'smollm2-135m-random-K256-r16-d384-s0-score-only.jsonl'
    result_name("passcode", record, "summary")        # 'summary-smollm2-135m-K256-r16-n57-s0-protected.csv'
    result_name("autopsy", model=m, task="copy", policy="random", protect_prompt=True, budget=256, buffer=16, seed=0)
    shipped_name("blocks", "summary")                 # 'blocks/summary-smollm2-135m-K256-r16-d384-s0-score-only.csv'

A name is a function of the run's configuration as the probe records it (the ``config`` of each of its rows, a
mapping) or of any object with those attributes (a probe's ``Config``), with keyword fields taking precedence
(``model=...`` where the configuration holds none, or a per-file ``policy``). The fields are the record's:
``model`` (its last path part), ``policy``, ``policy_options``, ``budget`` (T), ``buffer`` (r), ``distance``,
``seed``, ``protect_prompt``, and per probe ``task``, ``rounds``, ``sequences``, ``batch``, ``body``, ``length``,
``max_new_tokens``, ``temperature``, ``top_p``, ``pack``, ``reference_tokens``, ``quick``. Every shipped rows file is
named by its own recorded configuration (tests/test_result_names.py).

:data:`SHIPPED` holds the configurations of the results shipped under ``data/results`` (the runs the docs report)
and :func:`shipped_name` their paths relative to that folder: the figures' and tables' default inputs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Optional

from .registry import COPY_RUN, EMBEDDED, PROBES

__all__ = ["result_name", "shipped_name", "summary_beside", "policy_slug", "protection_tag", "PARTS", "SHIPPED"]


def protection_tag(protect_prompt: bool) -> str:
    """The one spelling of prompt protection in file names and tables: ``protected`` or ``score-only``."""
    return "protected" if protect_prompt else "score-only"


def policy_slug(name: str) -> str:
    """A file-name-safe policy name: ``my_selector:score`` -> ``my_selector.score``, ``dir/sel.py:f`` -> ``sel.f``."""
    where, sep, attr = name.rpartition(":")
    if sep:
        name = f"{Path(where).stem if where.endswith('.py') else where}.{attr}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def summary_beside(rows_name: str, instances: Optional[int] = None) -> str:
    """The summary table written beside a rows file: ``<rows stem>.summary.csv``, or ``<rows stem>.n<N>.summary.csv``
    for a run that covered only the first N instances of its file (so it never overwrites the full summary)."""
    stem = rows_name[: -len(".jsonl")] if rows_name.endswith(".jsonl") else Path(rows_name).stem
    return stem + ("" if instances is None else f".n{instances}") + ".summary.csv"


class _Fields:
    """The configuration's fields: keywords first, then the mapping's keys or the object's attributes."""

    def __init__(self, config: Any, fields: dict):
        self.config, self.fields = config, fields

    def __getitem__(self, name: str) -> Any:
        if name in self.fields:
            return self.fields[name]
        if isinstance(self.config, Mapping):
            if name in self.config:
                return self.config[name]
        elif self.config is not None and hasattr(self.config, name):
            return getattr(self.config, name)
        raise KeyError(f"a result name needs the field {name!r}, which the configuration does not hold; pass "
                       f"{name}=...")

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default

    @property
    def model(self) -> str:
        return Path(str(self["model"])).name.replace("/", "_")

    @property
    def tag(self) -> str:
        return protection_tag(self["protect_prompt"])


# -- one function per file a probe writes -------------------------------------------------------------------------
def _planted(c: _Fields) -> str:
    """A planted-fact probe's rows (head_pooling, scatter, two_facts, blocks, shared_draw, passcode)."""
    extra = "".join(f"-{k}{v}" for k, v in (c.get("policy_options") or {}).items())
    return (f"{c.model}-{policy_slug(c['policy'])}{extra}-K{c['budget']}-r{c['buffer']}-d{c['distance']}"
            f"-s{c['seed']}-{c.tag}.jsonl")


def _planted_summary(c: _Fields) -> str:
    return summary_beside(_planted(c))


def _nll(c: _Fields) -> str:
    """The next-token loss rows of blocks and shared_draw."""
    return f"nll-{c.model}-K{c['budget']}-r{c['buffer']}-L{c['length']}-s{c['seed']}-{c.tag}.jsonl"


def _blocks_summary(c: _Fields) -> str:
    return f"summary-{c.model}-K{c['budget']}-r{c['buffer']}-d{c['distance']}-s{c['seed']}-{c.tag}.csv"


def _shared_draw_summary(c: _Fields) -> str:
    return f"summary-{c.model}-K{c['budget']}-r{c['buffer']}-s{c['seed']}-{c.tag}.csv"


def _passcode_group(c: _Fields) -> str:
    """What identifies a passcode run: its summary's name, and the folder a grid gives each passcode run."""
    return f"{c.model}-K{c['budget']}-r{c['buffer']}-n{c['rounds']}-s{c['seed']}-{c.tag}"


def _passcode_summary(c: _Fields) -> str:
    return f"summary-{_passcode_group(c)}.csv"


def _prompt_protection(c: _Fields) -> str:
    return f"{c.model}-K{c['budget']}-r{c['buffer']}-b{c['body']}-s{c['seed']}.jsonl"


def _survival(c: _Fields) -> str:
    return (f"{c.model}-K{c['budget']}-r{c['buffer']}-n{c['rounds']}-seq{c['sequences']}-b{c['batch']}"
            f"-s{c['seed']}.jsonl")


def _accuracy(c: _Fields) -> str:
    temperature = c.get("temperature") or 0
    sampling = f"-T{temperature:g}-p{c['top_p']:g}" if temperature > 0 else ""
    packed = "-packed" if c.get("pack", False) else ""
    return f"{c.model}-{c['task']}-r{c['buffer']}-n{c['max_new_tokens']}{sampling}{packed}-s{c['seed']}.jsonl"


def _beside(rows: Callable[[_Fields], str], suffix: str) -> Callable[[_Fields], str]:
    return lambda c: rows(c)[: -len(".jsonl")] + suffix


def _reference_lp(c: _Fields) -> str:
    """The accuracy harness's teacher-forced reference log-prob rows (``--reference-lp``), beside its generation rows;
    ``-t<N>`` when only the reference's first N tokens are scored (``--reference-tokens``)."""
    tokens = c.get("reference_tokens")
    return _accuracy(c)[: -len(".jsonl")] + ".reference_lp" + (f"-t{tokens}" if tokens else "") + ".jsonl"


def _autopsy(c: _Fields) -> str:
    return (f"{c.model}-{c['task']}-{policy_slug(c['policy'])}-{c.tag}-K{c['budget']}-r{c['buffer']}"
            f"-s{c['seed']}.jsonl")


def _autopsy_summary(c: _Fields) -> str:
    return f"summary-{c.model}-{c['task']}-K{c['budget']}-r{c['buffer']}-s{c['seed']}.csv"


def _challenge(c: _Fields) -> str:
    """The challenge's output folder (every file of one challenge run is inside it)."""
    tags = ("" if c["protect_prompt"] else "-score-only") + ("-quick" if c.get("quick", False) else "")
    return f"{policy_slug(c['policy'])}-{c.model}-K{c['budget']}-r{c['buffer']}{tags}"


def _leaderboard(c: _Fields) -> str:
    """The leaderboard's run folder: the setting every selector shares (not the selectors: a new one joins it)."""
    return f"{c.model}-K{c['budget']}-r{c['buffer']}-s{c['seed']}-{c.tag}"


_PLANTED = {"rows": _planted, "summary": _planted_summary}
#: file-name family -> {part: name function}; a registered probe names its family (``Probe.files``, default its name).
FAMILIES: dict[str, dict[str, Callable[[_Fields], str]]] = {
    "planted": _PLANTED,  # probes.planted_run's rows, whichever probe plants (head pooling, scatter, ..., new ones)
    "blocks": {"rows": _planted, "summary": _blocks_summary, "nll": _nll},
    "shared_draw": {"rows": _planted, "summary": _shared_draw_summary, "nll": _nll},
    "passcode": {"rows": _planted, "summary": _passcode_summary, "group": _passcode_group},
    "prompt_protection": {"rows": _prompt_protection, "summary": _beside(_prompt_protection, ".summary.csv")},
    "survival": {"rows": _survival},
    "accuracy": {"rows": _accuracy, **{part: _beside(_accuracy, f".{part}.csv")
                                       for part in ("summary", "protection", "table")},
                 "reference_lp": _reference_lp},
    "autopsy": {"rows": _autopsy, "summary": _autopsy_summary},
    "challenge": {"folder": _challenge},
    "leaderboard": {"folder": _leaderboard, "table": lambda c: f"{_leaderboard(c)}/leaderboard.csv"},
    # a board of leaderboard tasks (probes.board): its folder under data/results/board/ is its name
    "board": {"folder": lambda c: str(c["name"]), "table": lambda c: f"{c['name']}/board.csv"},
}
#: probe -> {part: name function}: every file name a probe composes from its configuration (the registered probes'
#: from :data:`analysis.registry.PROBES`, then what is no kind: the planted rows, the challenge, the leaderboard's
#: own task files).
PARTS: dict[str, dict[str, Callable[[_Fields], str]]] = {
    "planted": _PLANTED,
    **{p.name: FAMILIES[p.files or p.name] for p in PROBES if (p.files or p.name) in FAMILIES},
    "challenge": FAMILIES["challenge"],
    "board": FAMILIES["board"],
    # the leaderboard's own task files, inside its folder (copy and repeat are the accuracy probe's files)
    **{f"leaderboard_{task}": {"rows": lambda c, task=task: f"{task}.jsonl"}
       for task in ("question", "passcode", "planted", "cost")},
}


def result_name(probe: str, config: Any = None, part: str = "rows", **fields: Any) -> str:
    """The name (no folder) of the file ``probe`` writes as ``part`` (``rows``, ``summary``, ...; see :data:`PARTS`)
    for the run ``config`` (a recorded configuration, or a probe's ``Config``), ``fields`` taking precedence."""
    try:
        parts = PARTS[probe]
    except KeyError:
        raise ValueError(f"no result names for the probe {probe!r}; known: {', '.join(PARTS)}") from None
    if part not in parts:
        raise ValueError(f"the probe {probe!r} writes no {part!r} file; its parts: {', '.join(parts)}")
    return parts[part](_Fields(config, fields))


#: name -> (folder under data/results, probe, recorded configuration): the results shipped with the package (each
#: registered probe's, :data:`analysis.registry.PROBES`, then the other runs the docs report).
SHIPPED: dict[str, tuple[str, str, dict]] = {
    **{p.name: (p.name, p.name, p.shipped) for p in PROBES if p.shipped is not None},
    "accuracy_repeat": ("accuracy", "accuracy", {**COPY_RUN, "task": "repeat", "buffer": 8, "max_new_tokens": 1664}),
    "accuracy_prompt_budget": ("accuracy_prompt_budget", "accuracy", COPY_RUN),
    "challenge": ("challenge", "challenge", {**EMBEDDED, "policy": "examples/attention_selector.py:recent_attention",
                                             "protect_prompt": True, "quick": True}),
}


def shipped_name(name: str, part: str = "rows", **fields: Any) -> str:
    """``<folder>/<file>`` (relative to ``data/results``) of the shipped result ``name`` (a key of :data:`SHIPPED`),
    its ``part``; ``fields`` change the shipped configuration (``task="recall"`` for the other autopsy task)."""
    folder, probe, config = SHIPPED[name]
    return f"{folder}/{result_name(probe, config, part, **fields)}"
