"""One shared random draw for all KV heads of a layer vs an independent draw per head.

    python -m probes.shared_draw               # embedded SmolLM2-135M, K=256, r=16
    python -m probes.shared_draw --skip-passcode

``random-shared`` ranks every token identically in all heads of a layer, so a token is either
kept by every head or by none; ``random`` draws per head, so copies in different heads die
independently. Three measurements, each paired:

* next-token loss on real traces (per sequence, over the tokens after the first round), vs full
  attention;
* a planted fact left to the policy (Recall R and Retrieval, endpoints under the same policy);
* the passcode needle (stated once, asked after ``--rounds`` rounds; results shared with
  ``python -m probes.passcode`` when the configuration matches).

The paper: a shared draw is about as good as per-head draws on real MATH500 traces; cross-head
diversity matters for once-stated facts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import randattn
from randattn.stats import mean_ci

from .blocks import full_attention, nll_deltas, run_nll
from .common import positive_int
from .passcode import compare as passcode_compare
from .passcode import run_policies
from .planted import Condition
from .planted_run import describe, planted_parser, run_conditions, setup, summarize, write_csv

POLICIES = ("random", "random-shared")


def main(argv=None) -> int:
    p = planted_parser(__doc__.splitlines()[0], instances=32)
    p.add_argument("--sequences", type=positive_int, default=16, help="trace sequences for the next-token loss")
    p.add_argument("--length", type=positive_int, default=1024, help="tokens per trace sequence")
    p.add_argument("--rounds", type=positive_int, default=57, help="passcode: rounds between statement and answer")
    p.add_argument("--passcode-instances", type=positive_int, default=16, help="passcode: instances per policy")
    p.add_argument("--skip-nll", action="store_true", help="skip the next-token-loss comparison")
    p.add_argument("--skip-planted", action="store_true", help="skip the planted-fact comparison")
    p.add_argument("--skip-passcode", action="store_true", help="skip the passcode comparison")
    args = p.parse_args(argv)
    if args.policy != "random":
        p.error("--policy is fixed by this probe (random vs random-shared); drop the flag")
    base_dir = Path(args.out) if args.out else Path("data/results/shared_draw")
    loaded, table, planted = None, [], {}
    for policy in POLICIES:
        sub = argparse.Namespace(**{**vars(args), "policy": policy, "out": None})
        s = setup("shared_draw", sub, p, loaded=loaded, out=base_dir / f"planted-{policy}.jsonl" if args.out else None)
        if loaded is None:
            print(describe(s))
        loaded = (s.model, s.tok)
        if not args.skip_planted:
            w = args.box_width
            conds = [Condition.heads("deleted", [], w), Condition.heads("all", range(s.n_heads), w),
                     Condition.policy("policy")]
            rows = run_conditions(s, conds, desc=f"planted fact: {policy}")
            planted[policy] = (rows, summarize(rows, ["policy", "all", "deleted"], seed=args.seed))
    if not args.skip_nll:
        a = args
        arms = {"full": full_attention(args.length)}
        for policy in POLICIES:
            arms[policy] = (lambda pol: lambda bi: randattn.EvictingCache(
                pol, budget=a.budget, buffer=a.buffer, protect_prompt=a.protect_prompt,
                seed=a.seed * 1_000_003 + bi))(policy)
        model = Path(str(s.results.config["model"])).name
        out = base_dir / f"nll-{model}-K{args.budget}-r{args.buffer}-L{args.length}-s{args.seed}.jsonl"
        rows = run_nll(s, arms, args.sequences, args.length, out, desc="next-token loss")
        deltas = nll_deltas(rows, list(POLICIES), seed=args.seed)
        diff = nll_deltas(rows, ["random-shared"], reference="random", seed=args.seed)["random-shared"]
        print(f"\nnext-token loss increase over full attention ({args.sequences} sequences of {args.length} tokens):")
        for policy in POLICIES:
            print(f"  {policy:<14} {deltas[policy]:.4f} nats/token")
            table.append({"measure": "delta_nll_vs_full", "policy": policy, "n": deltas[policy].n,
                          **deltas[policy].as_dict("value")})
        print(f"  shared - per-head: {diff:.4f}")
        table.append({"measure": "delta_nll_vs_full", "policy": "shared - per-head", "n": diff.n,
                      **diff.as_dict("value")})
    if planted:
        print("\nplanted fact left to the policy (R vs deleted/kept-everywhere under the same policy):")
        for policy, (_, summ) in planted.items():
            pol = summ["policy"]
            print(f"  {policy:<14} R {pol.recall:.3f}  retrieval {pol.retrieval:.3f}")
            table.append({"measure": "planted_recall", "policy": policy, "n": pol.n, **pol.recall.as_dict("value")})
            table.append({"measure": "planted_retrieval", "policy": policy, "n": pol.n,
                          **pol.retrieval.as_dict("value")})
        ok = {pol: {r["instance"]: r["retrieved"] for r in rows if r["condition"] == "policy"}
              for pol, (rows, _) in planted.items()}
        common = sorted(set(ok["random"]) & set(ok["random-shared"]))
        d = mean_ci([ok["random-shared"][i] - ok["random"][i] for i in common], seed=args.seed)
        print(f"  retrieval shared - per-head: {d:.3f}")
        table.append({"measure": "planted_retrieval", "policy": "shared - per-head", "n": d.n, **d.as_dict("value")})
    if not args.skip_passcode:
        pc = argparse.Namespace(**{**vars(args), "instances": args.passcode_instances, "protect_prompt": True,
                                   "box_width": 20, "paper": False, "out": None})
        rows_by_policy = run_policies(pc, p, list(POLICIES), Path("data/results/passcode"), loaded=loaded,
                                      references=False)
        print(f"\npasscode stated once, asked after {args.rounds} rounds (prompt protected):")
        for r in passcode_compare(rows_by_policy, seed=args.seed)[-len(POLICIES):]:
            print(f"  {r['policy']:<14} retrieval {r['retrieval']:.3f} [{r['retrieval_lo']:.3f}, {r['retrieval_hi']:.3f}]"
                  f"  mean LP {r['mean_lp']:.2f}")
            table.append({"measure": "passcode_retrieval", "policy": r["policy"], "n": r["n"], "value": r["retrieval"],
                          "value_lo": r["retrieval_lo"], "value_hi": r["retrieval_hi"]})
    print("\npaper: a shared draw is about as good as per-head draws on real traces; per-head diversity matters "
          "for once-stated facts")
    base_dir.mkdir(parents=True, exist_ok=True)
    model = Path(str(s.results.config["model"])).name
    path = write_csv(base_dir / f"summary-{model}-K{args.budget}-r{args.buffer}-s{args.seed}.csv",
                     [{**r, "model": s.results.config["model"], "budget": args.budget, "buffer": args.buffer}
                      for r in table])
    print(f"\nsummary: {path}")
    if not args.no_figure:
        from figures.shared_draw import plot

        for f in plot(path, args.figure_dir):
            print(f"figure: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
