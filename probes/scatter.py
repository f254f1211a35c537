"""Scattered vs intact copies: does it matter whether any one head holds the whole fact?

    python -m probes.scatter                 # embedded SmolLM2-135M, K=256, r=16, distance 384

Two mass-matched ways of keeping the fact box in two KV heads' worth of slots:

* scattered: box token ``t`` is kept in the rotating pair of heads ``(t+p mod H, t+p+1 mod H)``, so
  no head holds the whole sentence; run for every phase ``p`` (so every token misses every head
  once) and averaged per instance;
* intact: the whole box in one pair of heads ``(h, h+1 mod H)``, for each of those same pairs,
  averaged per instance.

Reports Retrieval and Recall R (with 95% bootstrap CIs) of both and their paired difference.
The paper (Qwen3-4B): scattered R = .33 vs intact .39.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from analysis.planted import endpoint_check, rotating_pairs, scatter_compare, summarize

from .config import ConfigError
from .planted import Condition
from .planted_run import (PlantedConfig, Session, check_traces, finish, print_table, run_unit, session_merge,
                          session_plan, setup, starter)
from .units import Kind, ModelInfo, Plan, command


def scatter_conditions(n_heads: int, width: int) -> list[Condition]:
    if n_heads < 3:
        raise ValueError(f"scattering over rotating pairs needs >= 3 KV heads; this model has {n_heads}")
    conds = [Condition.heads("deleted", [], width, kind="endpoint"), Condition.heads("all", range(n_heads), width,
                                                                                    kind="endpoint"),
             Condition.full("full", kind="endpoint")]
    for phase in range(n_heads):
        spread = tuple(frozenset({(t + phase) % n_heads, (t + phase + 1) % n_heads}) for t in range(width))
        conds.append(Condition(f"scattered p{phase}", (spread,), meta={"kind": "scattered", "phase": phase}))
    for a, b in rotating_pairs(n_heads):
        conds.append(Condition.heads(f"intact h{a}+{b}", (a, b), width, kind="intact"))
    return conds


@dataclass
class Config(PlantedConfig):
    """Scattered vs intact copies of a planted fact (``python -m probes.scatter``)."""


def conditions(s: Session) -> list[Condition]:
    try:
        return scatter_conditions(s.n_heads, s.config.box_width)
    except ValueError as exc:
        raise ConfigError("model", str(exc)) from None


def plan(config: Config, model: ModelInfo) -> Plan:
    s = setup("scatter", config, loaded=(model.bind_target, model.tokenizer), open_results=False)
    return session_plan(s, conditions(s), stage="scatter")


def report(s: Session, rows: list[dict]) -> None:
    seed = s.config.seed
    summaries = summarize(rows, list(dict.fromkeys(r["condition"] for r in rows)), seed=seed)
    print()
    print_table(summaries)
    c = scatter_compare(rows, s.n_heads, seed)
    print(f"\nscattered vs intact (mass-matched: two heads' worth of slots each), n={c['n']}:")
    print(f"  recall R:  scattered {c['recall_scattered']:.3f}  intact {c['recall_intact']:.3f}  "
          f"difference {c['recall_diff']:.3f}")
    print(f"  retrieval: scattered {c['retrieval_scattered']:.3f}  intact {c['retrieval_intact']:.3f}  "
          f"difference {c['retrieval_diff']:.3f}")
    print("  (paper, Qwen3-4B: R .33 scattered vs .39 intact)")
    _, text = endpoint_check(rows, seed=seed)
    print(text)
    table = [x.as_row() for x in summaries.values()]
    table.append({"condition": "scattered - intact", "n": c["n"], **c["recall_diff"].as_dict("recall"),
                  **c["retrieval_diff"].as_dict("retrieval")})
    table.append({"condition": "intact (mean of pairs)", "n": c["n"], **c["recall_intact"].as_dict("recall"),
                  **c["retrieval_intact"].as_dict("retrieval")})
    table.append({"condition": "scattered (mean of phases)", "n": c["n"], **c["recall_scattered"].as_dict("recall"),
                  **c["retrieval_scattered"].as_dict("retrieval")})
    finish(s, table, "scatter")


KIND = Kind("scatter", Config, plan, run_unit, session_merge(report), check=check_traces,
            start=starter(parity=lambda conds: conds[3]))


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return command(KIND, __doc__)(argv)


if __name__ == "__main__":
    sys.exit(main())
