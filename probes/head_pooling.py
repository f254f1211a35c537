"""Head pooling: how well can the model recall a fact that survives only in some KV heads?

    python -m probes.head_pooling                       # embedded SmolLM2-135M (3 KV heads), K=256, r=16, distance 384
    python -m probes.head_pooling --paper --model Qwen/Qwen3-4B --traces math500_traces.jsonl

A fact (``Let zq = 4729.``) is planted in the model's own reasoning text and asked for ``distance``
tokens later, while the background is evicted by ``--policy`` (Random, prompt unprotected, as in
the paper's probe). The fact box is kept in one subset of KV heads (the same head indices in every
layer) and deleted from the others: every subset when the model has <= 8 KV heads, otherwise
single heads, pairs and the best-k chain. Reports Retrieval and Recall R with 95% bootstrap CIs
per subset, which heads are useful alone, and whether pooling heads is superadditive; writes
rows to ``data/results/head_pooling/`` and ``figures/head_pooling.png``.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

from analysis.planted import endpoint_check, pooling_findings, subset_label, summarize

from .planted import Condition, subsets
from .planted_run import (PlantedConfig, Session, check_traces, finish, print_table, run_unit, session_merge,
                          session_plan, session_rows, setup, starter)
from .units import Kind, ModelInfo, Plan, command


def pooling_conditions(n_heads: int, width: int, *, max_all_subsets: int = 8) -> list[Condition]:
    """Endpoints, head subsets, and the fact left to the background policy."""
    if n_heads <= max_all_subsets:
        chosen = subsets(n_heads)
    else:
        chosen = [()] + [c for k in (1, 2) for c in itertools.combinations(range(n_heads), k)] + [tuple(range(n_heads))]
    conds = [Condition.heads(subset_label(h, n_heads), h, width, heads=list(h)) for h in chosen]
    return conds + [Condition.policy("policy", heads=None), Condition.full("full", heads=None)]


def chain_conditions(order: list[int], n_heads: int, width: int) -> list[Condition]:
    """The best-k chain: the k best single heads together, k = 3 .. H-1 (1, 2 and H are run already)."""
    out = []
    for k in range(3, n_heads):
        h = tuple(sorted(order[:k]))
        out.append(Condition.heads(f"best{k}:" + subset_label(h, n_heads), h, width, heads=list(h)))
    return out


@dataclass
class Config(PlantedConfig):
    """Head pooling: recall of a fact kept only in some KV heads (``python -m probes.head_pooling``)."""


def plan(config: Config, model: ModelInfo) -> Plan:
    """Every head subset's batches (on models with more than 8 KV heads, the best-k chain as a second stage
    planned from the single heads' rows)."""
    s = setup("head_pooling", config, loaded=(model.bind_target, model.tokenizer), open_results=False)
    conds = pooling_conditions(s.n_heads, config.box_width)
    if s.n_heads <= 8:
        return session_plan(s, conds, stage="head pooling")

    def chain(rows: dict) -> Plan:
        summaries = summarize(session_rows(s, conds, rows[str(s.results.path)]), [c.name for c in conds],
                              seed=config.seed)
        singles = sorted(range(s.n_heads), key=lambda h: -summaries[subset_label((h,), s.n_heads)].recall.value)
        more = chain_conditions(singles, s.n_heads, config.box_width)
        p = session_plan(s, more, stage="best-k chain")
        p.meta["conditions"] = conds + more
        return p

    return session_plan(s, conds, then=chain, stage="head pooling")


def report(s: Session, rows: list[dict]) -> None:
    names = list(dict.fromkeys(r["condition"] for r in rows))
    summaries = summarize(rows, names, seed=s.config.seed)
    print()
    print_table(summaries)
    print()
    for line in pooling_findings(rows, summaries, s.n_heads, s.config.seed):
        print(line)
    ok, text = endpoint_check(rows, seed=s.config.seed)
    print(text)
    finish(s, [x.as_row() for x in summaries.values()], "head_pooling")


KIND = Kind("head_pooling", Config, plan, run_unit, session_merge(report), check=check_traces,
            start=starter(parity=lambda conds: conds[1]))


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return command(KIND, __doc__)(argv)


if __name__ == "__main__":
    sys.exit(main())
