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

from randattn.stats import bootstrap

from .planted import Condition
from .planted_run import (describe, endpoint_check, lp_table, parity_check, planted_parser, print_table, run_conditions,
                          setup, summarize, write_csv)


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


def _cols(rows, fact, names):
    t = lp_table(rows, fact)
    inst = sorted(set.intersection(*(set(t[n]) for n in names)))
    return [[t[n][i][0] for i in inst] for n in names]


def pair_tests(rows, a: int, b: int, seed: int = 0) -> dict:
    """Superadditivity (together vs the sum of singles, on both answers) and interference (x with and without y)."""
    both, xa, yb = f"x@{a}+y@{b}", f"x@{a}", f"y@{b}"
    cols = _cols(rows, None, [both, xa, yb, "deleted", "all"])
    sup = bootstrap(lambda t, x, y, d, al: (t - x - y + d).sum(-1) / (al - d).sum(-1), *cols, seed=seed)
    cols = _cols(rows, 0, [both, xa, "deleted", "all"])
    inter = bootstrap(lambda t, x, d, al: (t - x).sum(-1) / (al - d).sum(-1), *cols, seed=seed)
    return {"superadditivity": sup, "x_interference": inter}


def main(argv=None) -> int:
    p = planted_parser(__doc__.splitlines()[0], instances=32)
    args = p.parse_args(argv)
    s = setup("two_facts", args, p, n_facts=2)
    print(describe(s))
    if s.n_heads < 2:
        p.error("two facts in two heads need a model with >= 2 KV heads")
    conds = two_fact_conditions(s.n_heads, args.box_width,
                                pairs=None if s.n_heads <= 4 else [(h, (h + 1) % s.n_heads) for h in range(s.n_heads)])
    parity_check(s, conds[-1], args.parity)
    rows = run_conditions(s, conds, desc="two facts")
    names = [c.name for c in conds]
    table = []
    for label, fact in (("x", 0), ("y", 1), ("x and y", None)):
        summaries = summarize(rows, names, fact=fact, seed=args.seed)
        print(f"\n== answer {label} ==")
        print_table(summaries)
        table += [{"answer": label, **x.as_row()} for x in summaries.values()]
    print()
    for c in conds:
        if c.meta.get("x_head") is not None and c.meta.get("y_head") is not None:
            a, b = c.meta["x_head"], c.meta["y_head"]
            t = pair_tests(rows, a, b, args.seed)
            sup, inter = t["superadditivity"], t["x_interference"]
            verdict = "superadditive" if sup.lo > 0 else "subadditive" if sup.hi < 0 else "additive within CI"
            print(f"x@{a}+y@{b}: R_xy(together) - R_xy(x@{a}) - R_xy(y@{b}) = {sup:.3f} ({verdict}); "
                  f"R_x with y in head {b} minus without = {inter:.3f}")
            table.append({"answer": "x and y", "condition": f"{c.name} - x@{a} - y@{b}", "n": sup.n,
                          **sup.as_dict("recall")})
    for fact in (0, 1):
        _, text = endpoint_check(rows, fact=fact, seed=args.seed)
        print(f"fact {'xy'[fact]}: {text}")
    path = write_csv(s.results.path.with_suffix(".summary.csv"), table)
    print(f"\nrows: {s.results.path}\nsummary: {path}")
    if not args.no_figure:
        from figures.two_facts import plot

        for f in plot(s.results.path, args.figure_dir):
            print(f"figure: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
