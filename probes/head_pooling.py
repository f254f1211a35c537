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

from randattn.stats import bootstrap

from .planted import Condition, subset_label, subsets
from .planted_run import (describe, endpoint_check, lp_table, parity_check, planted_parser, print_table, run_conditions,
                          setup, summarize, write_csv)


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


def superadditivity(rows, a: str, b: str, ab: str, seed: int = 0):
    """R(a+b) - R(a) - R(b) with a bootstrap CI (all R share the denominator Σ(LP_all - LP_del))."""
    t = lp_table(rows)
    inst = sorted(set.intersection(*(set(t[c]) for c in (a, b, ab, "deleted", "all"))))
    cols = [[t[c][i][0] for i in inst] for c in (ab, a, b, "deleted", "all")]
    return bootstrap(lambda x_ab, x_a, x_b, d, al: (x_ab - x_a - x_b + d).sum(-1) / (al - d).sum(-1), *cols, seed=seed)


def analyse(rows, summaries, n_heads: int, seed: int = 0) -> list[str]:
    lines = []
    singles = [subset_label((h,), n_heads) for h in range(n_heads) if subset_label((h,), n_heads) in summaries]
    useful = [n for n in singles if summaries[n].recall is not None and summaries[n].recall.lo > 0]
    lines.append(f"useful alone (R's CI above 0): {', '.join(useful) if useful else 'none'} of {len(singles)} heads")
    by_size: dict[int, tuple[str, float]] = {}
    for name, s in summaries.items():
        k = _size(name, n_heads)
        if k is not None and (k not in by_size or s.retrieval.value > by_size[k][1]):
            by_size[k] = (name, s.retrieval.value)
    lines.append("best retrieval by number of heads holding the fact: "
                 + "; ".join(f"{k}: {v:.2f} ({n})" for k, (n, v) in sorted(by_size.items())))
    for a, b in itertools.combinations(range(n_heads), 2):
        na, nb, nab = (subset_label(x, n_heads) for x in ((a,), (b,), (a, b)))
        if all(n in summaries for n in (na, nb, nab)) and n_heads > 2:
            est = superadditivity(rows, na, nb, nab, seed)
            verdict = "superadditive" if est.lo > 0 else "subadditive" if est.hi < 0 else "additive within CI"
            lines.append(f"R({nab}) - R({na}) - R({nb}) = {est:.3f}: {verdict}")
    return lines


def _size(name: str, n_heads: int):
    if name == "deleted":
        return 0
    if name == "all":
        return n_heads
    if name.startswith("h"):
        return len(name[1:].split("+"))
    if name.startswith("best"):
        return int(name[4:].split(":")[0])
    return None


def main(argv=None) -> int:
    p = planted_parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    s = setup("head_pooling", args, p)
    print(describe(s))
    width = args.box_width
    conds = pooling_conditions(s.n_heads, width)
    parity_check(s, conds[1], args.parity)
    rows = run_conditions(s, conds, desc="head pooling")
    summaries = summarize(rows, [c.name for c in conds], seed=args.seed)
    if s.n_heads > 8:
        singles = sorted(range(s.n_heads), key=lambda h: -summaries[subset_label((h,), s.n_heads)].recall.value)
        chain = chain_conditions(singles, s.n_heads, width)
        rows = rows + run_conditions(s, chain, desc="best-k chain")
        conds = conds + chain
        summaries = summarize(rows, [c.name for c in conds], seed=args.seed)
    print()
    print_table(summaries)
    print()
    for line in analyse(rows, summaries, s.n_heads, args.seed):
        print(line)
    ok, text = endpoint_check(rows, seed=args.seed)
    print(text)
    summary_path = write_csv(s.results.path.with_suffix(".summary.csv"), [x.as_row() for x in summaries.values()])
    print(f"\nrows: {s.results.path}\nsummary: {summary_path}")
    if not args.no_figure:
        from figures.head_pooling import plot

        for path in plot(s.results.path, args.figure_dir):
            print(f"figure: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
