"""The probe kinds, each registered once: where its ``KIND`` is, how its files are named, the run shipped with the
package, its figure and its docs table.

Every name-keyed table reads from :data:`PROBES`: ``probes.units.KINDS`` (the kinds the grid and the backends find
by name), ``analysis.names.PARTS`` and ``SHIPPED`` (file names, shipped runs), ``figures.__main__.FIGURES`` and
``figures.tables.TABLES``. It lives here, in the layer below probes and figures, because figures may not import a
probe (tests/test_layers.py): code is named by its module, never imported here.

Adding a probe is one :class:`Probe` line here, beside its module ``probes/<name>.py``; by convention its figure is
``figures/<name>.py:plot`` and its docs table ``figures.tables.<name>`` (``figure=`` / ``table=`` say it has one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Probe", "PROBES", "RUNNERS", "probe", "kinds"]


@dataclass(frozen=True)
class Probe:
    """One probe kind: ``python -m probes.<name>`` and ``probe = "<name>"`` in a grid."""

    name: str
    files: str = ""  # its file-name family in analysis.names (default: its name)
    shipped: Optional[dict] = None  # the recorded configuration of its run under data/results/<name>/, if shipped
    figure: str = ""  # the shipped file part the figure draws ("rows", "summary", "table"); "" for no figure
    table: bool = False  # a ``<!-- table: <name> -->`` block in the docs, made by ``figures.tables.<name>``
    command: str = ""  # the command that makes the shipped run (default: ``python -m probes.<name>``)
    module: str = ""  # where its KIND is (default: ``probes.<name>``)
    planted: bool = False  # a planted-fact probe whose module's ``conditions(session)`` lists what it writes

    @property
    def kind_module(self) -> str:
        return self.module or f"probes.{self.name}"

    @property
    def run_command(self) -> str:
        return self.command or f"python -m probes.{self.name}"


EMBEDDED = {"model": "smollm2-135m", "budget": 256, "buffer": 16, "seed": 0}
PLANTED_RUN = {**EMBEDDED, "policy": "random", "policy_options": {}, "distance": 384, "protect_prompt": False}
COPY_RUN = {**EMBEDDED, "task": "copy", "max_new_tokens": 192, "temperature": 0.0, "top_p": 1.0}

#: Every probe kind, in the order the docs and hints list them.
PROBES: tuple[Probe, ...] = (
    Probe("accuracy", shipped=COPY_RUN, figure="rows", table=True),
    Probe("passcode", figure="summary", table=True,
          shipped={**PLANTED_RUN, "distance": 917, "rounds": 57, "protect_prompt": True}),
    Probe("head_pooling", files="planted", shipped=PLANTED_RUN, figure="rows", table=True),
    Probe("scatter", files="planted", shipped=PLANTED_RUN, figure="rows", table=True, planted=True),
    Probe("two_facts", files="planted", shipped=PLANTED_RUN, figure="rows", table=True, planted=True),
    Probe("prompt_protection", shipped={**EMBEDDED, "body": 512}, figure="summary", table=True),
    Probe("survival", shipped={**EMBEDDED, "rounds": 24, "sequences": 4, "batch": 4}, figure="rows", table=True),
    Probe("blocks", figure="summary", table=True, planted=True,
          shipped={**PLANTED_RUN, "policy": "random-block", "policy_options": {"block": 1}, "length": 1024}),
    Probe("shared_draw", shipped={**PLANTED_RUN, "length": 1024}, figure="summary", table=True, planted=True),
    Probe("autopsy", shipped={**EMBEDDED, "task": "copy", "policy": "snapkv", "protect_prompt": True},
          figure="rows", table=True, command="python -m probes.autopsy --task copy --policy random snapkv "
                                             "--max-replays 8"),
    Probe("leaderboard", shipped={**EMBEDDED, "protect_prompt": True}, figure="table", table=True,
          command="python -m probes.leaderboard --runs 3 --tasks copy question passcode cost --instances 8 "
                  "--cost-repeats 1"),
)

#: Kinds that only run units other kinds plan: name -> ``module[:ATTRIBUTE]`` of their Kind.
RUNNERS: dict[str, str] = {
    "planted": "probes.planted_run",  # every planted-fact probe's batches
    "nll": "probes.blocks:NLL",  # the next-token-loss batches (blocks, shared draw)
}


def probe(name: str) -> Optional[Probe]:
    """The registered probe ``name``, or None."""
    return next((p for p in PROBES if p.name == name), None)


def kinds() -> dict[str, str]:
    """kind name -> ``module[:ATTRIBUTE]`` of its Kind: every probe, then the runners."""
    return {**{p.name: p.kind_module for p in PROBES}, **RUNNERS}
