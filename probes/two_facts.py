"""Two facts in two heads: is keeping x in one head and y in another worth more than the two alone?

    python -m probes.two_facts               # embedded SmolLM2-135M, K=256, r=16, distance 384

Two facts (``Let zq = 4729.`` then ``Let mv = 1385.``) are planted and both asked for, each
answer ``distance`` tokens after its own box. Conditions, for KV heads a != b:

* ``x@a``: x kept only in head a, y deleted everywhere;  ``y@b``: the mirror image;
* ``x@a+y@b``: x only in head a and y only in head b, together;
* endpoints: both deleted, both kept everywhere.

Recall R per fact (R_x, R_y) and for both answers together (summed log-probs, R_xy), with 95%
bootstrap CIs; the superadditivity test compares R_xy(x@a+y@b) with R_xy(x@a) + R_xy(y@b), and the
interference test R_x(x@a+y@b) with R_x(x@a).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass

from analysis.planted import endpoint_check, pair_tests, summarize

from .config import POSITIVE, ConfigError, option
from .planted import Condition
from .planted_run import (PlantedConfig, Session, check_traces, finish, print_table, run_unit, session_merge,
                          session_plan, setup, starter)
from .units import Kind, ModelInfo, Plan, command


def two_fact_conditions(n_heads: int, width: int, pairs=None) -> list[Condition]:
    keep = lambda heads: tuple(frozenset(heads) for _ in range(width))  # noqa: E731
    pairs = list(pairs or itertools.permutations(range(n_heads), 2))
    conds = [Condition("deleted", (keep(()), keep(()))), Condition("all", (keep(range(n_heads)),) * 2),
             Condition.full("full", n_facts=2)]
    for a in sorted({a for a, _ in pairs}):
        conds.append(Condition(f"x@{a}", (keep([a]), keep(())), meta={"x_head": a, "y_head": None}))
    for b in sorted({b for _, b in pairs}):
        conds.append(Condition(f"y@{b}", (keep(()), keep([b])), meta={"x_head": None, "y_head": b}))
    for a, b in pairs:
        conds.append(Condition(f"x@{a}+y@{b}", (keep([a]), keep([b])), meta={"x_head": a, "y_head": b}))
    return conds


@dataclass
class Config(PlantedConfig):
    """Two facts in two heads (``python -m probes.two_facts``)."""

    instances: int = option(32, "instances (paired across conditions)", check=POSITIVE)


def conditions(s: Session) -> list[Condition]:
    if s.n_heads < 2:
        raise ConfigError("model", "two facts in two heads need a model with >= 2 KV heads")
    return two_fact_conditions(s.n_heads, s.config.box_width,
                               pairs=None if s.n_heads <= 4 else [(h, (h + 1) % s.n_heads) for h in range(s.n_heads)])


def plan(config: Config, model: ModelInfo) -> Plan:
    s = setup("two_facts", config, n_facts=2, loaded=(model.bind_target, model.tokenizer), open_results=False)
    return session_plan(s, conditions(s), stage="two facts")


def report(s: Session, rows: list[dict]) -> None:
    seed = s.config.seed
    names = list(dict.fromkeys(r["condition"] for r in rows))
    table = []
    for label, fact in (("x", 0), ("y", 1), ("x and y", None)):
        summaries = summarize(rows, names, fact=fact, seed=seed)
        print(f"\n== answer {label} ==")
        print_table(summaries)
        table += [{"answer": label, **x.as_row()} for x in summaries.values()]
    print()
    for name in names:
        if name.startswith("x@") and "+y@" in name:
            a, b = (int(h) for h in name.replace("x@", "").replace("y@", "").split("+"))
            t = pair_tests(rows, a, b, seed)
            sup, inter = t["superadditivity"], t["x_interference"]
            verdict = "superadditive" if sup.lo > 0 else "subadditive" if sup.hi < 0 else "additive within CI"
            print(f"x@{a}+y@{b}: R_xy(together) - R_xy(x@{a}) - R_xy(y@{b}) = {sup:.3f} ({verdict}); "
                  f"R_x with y in head {b} minus without = {inter:.3f}")
            table.append({"answer": "x and y", "condition": f"{name} - x@{a} - y@{b}", "n": sup.n,
                          **sup.as_dict("recall")})
    for fact in (0, 1):
        _, text = endpoint_check(rows, fact=fact, seed=seed)
        print(f"fact {'xy'[fact]}: {text}")
    finish(s, table, "two_facts")


KIND = Kind("two_facts", Config, plan, run_unit, session_merge(report), check=check_traces,
            start=starter(parity=lambda conds: conds[-1]))


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return command(KIND, __doc__)(argv)


if __name__ == "__main__":
    sys.exit(main())
