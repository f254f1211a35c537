"""The passcode needle: a fact stated once, never restated, asked for after many eviction rounds.

    python -m probes.passcode                          # embedded SmolLM2-135M, K=256, r=16, 57 rounds, every policy
    python -m probes.passcode --policies random rkv --rounds 20
    python -m probes.passcode --paper                  # K=1024, r=64 (57 rounds = 3,648 tokens)

``IMPORTANT: the passcode is NNNN. Remember it.`` is written once into the model's own reasoning
text (right where the cache first fills), then real-trace filler runs for ``--rounds`` eviction
rounds, then ``What was the passcode again? The passcode is`` and the passcode, teacher-forced.
Every policy evicts everything but the stub prompt (protected by default), passcode included.
Retrieval (greedy exact) and mean log-prob of the passcode with 95% bootstrap CIs, paired by
instance against Random; the table says how many rounds each instance really went through (from
the cache's event counter). The paper (Qwen3-4B, 57 rounds): Random .000, R-KV .836, VaSE .344,
SnapKV and TriAttention about 0: content-aware scores can find a needle Random cannot.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from randattn.stats import mean_ci

from .common import check_policies, policy_slug, positive_int
from .planted import Condition
from .planted_run import PAPER, describe, lp_table, planted_parser, run_conditions, setup, write_csv

FACT = " IMPORTANT: the passcode is {value}. Remember it."
QUERY = "\nWhat was the passcode again? The passcode is"
INSTRUCTION = "Solve the problems below step by step."
POLICIES = ["random", "random-shared", "recency", "streamingllm", "h2o", "snapkv", "rkv", "rkv-official", "vase",
            "triattention"]


def passcode_distance(rounds: int, buffer: int, box_width: int) -> int:
    """Distance from the statement to the answer such that exactly ``rounds`` rounds run in between: the
    statement ends where a round fires, then one round every ``r`` tokens."""
    return box_width + (rounds - 1) * buffer + 1


def compare(rows_by_policy: dict, reference: str = "random", seed: int = 0) -> list[dict]:
    """Per policy: retrieval and mean LP with CIs, and the paired differences against ``reference``."""
    ref = lp_table(rows_by_policy[reference])["policy"] if reference in rows_by_policy else None
    table = []
    if reference in rows_by_policy:  # the instrument's ceiling: full attention, and the passcode pinned everywhere
        t = lp_table(rows_by_policy[reference])
        for name, label in (("full", "full attention"), ("kept", "pinned everywhere")):
            if name in t:
                inst = sorted(t[name])
                table.append({"policy": label, "n": len(inst), "rounds": "-",
                              **mean_ci([t[name][i][1] for i in inst], seed=seed).as_dict("retrieval"),
                              **mean_ci([t[name][i][0] for i in inst], seed=seed).as_dict("mean_lp")})
    for policy, rows in rows_by_policy.items():
        cell = lp_table(rows)["policy"]
        inst = sorted(cell)
        rounds = sorted({r["rounds_after_fact"] for r in rows if r["condition"] == "policy"})
        row = {"policy": policy, "n": len(inst), "rounds": "/".join(map(str, rounds)),
               **mean_ci([cell[i][1] for i in inst], seed=seed).as_dict("retrieval"),
               **mean_ci([cell[i][0] for i in inst], seed=seed).as_dict("mean_lp")}
        if ref is not None and policy != reference:
            common = [i for i in inst if i in ref]
            row.update(mean_ci([cell[i][1] - ref[i][1] for i in common], seed=seed).as_dict("retrieval_vs_random"))
            row.update(mean_ci([cell[i][0] - ref[i][0] for i in common], seed=seed).as_dict("lp_vs_random"))
        table.append(row)
    return table


def run_policies(args, parser, policies, base_dir: Path, loaded=None, references: bool = True) -> dict:
    """Run the passcode instances under each policy (resuming finished rows); ``{policy: rows}``. With
    ``references``, Random's file also gets full attention and the passcode pinned everywhere."""
    args.distance = passcode_distance(args.rounds, args.buffer, args.box_width)
    rows_by_policy = {}
    for policy in policies:
        sub = argparse.Namespace(**{**vars(args), "policy": policy, "out": None})
        s = setup("passcode", sub, parser, loaded=loaded, extra_config={"rounds": args.rounds},
                  out=base_dir / f"{policy_slug(policy)}.jsonl" if args.out else None,
                  builder_texts={"fact": FACT, "query": QUERY, "instruction": INSTRUCTION, "deletable": False})
        if loaded is None:
            print(describe(s).replace(f"distance {args.distance}", f"{args.rounds} rounds"))
        loaded = (s.model, s.tok)
        rows_by_policy[policy] = run_conditions(s, [Condition.policy("policy")], desc=f"passcode: {policy}")
        if policy == "random" and references:
            # Can the model retrieve the passcode at this distance at all? Full attention, and the passcode
            # pinned in every head while Random evicts the rest.
            kept = run_conditions(s, [Condition.heads("kept", range(s.n_heads), s.builder.box_width)],
                                  desc="passcode: kept everywhere")
            full = run_conditions(dataclasses.replace(s, no_eviction=True), [Condition.policy("full")],
                                  desc="passcode: full attention")
            rows_by_policy["random"] = rows_by_policy["random"] + kept + full
    return rows_by_policy


def passcode_parser(description: str):
    p = planted_parser(description, instances=16)
    p.add_argument("--rounds", type=positive_int, default=57, help="eviction rounds between statement and answer")
    p.add_argument("--no-protect-prompt", dest="protect_prompt", action="store_false",
                   help="let the stub prompt be evicted too (default: protected, like the paper's methods)")
    p.set_defaults(protect_prompt=True, box_width=20)
    return p


def main(argv=None) -> int:
    p = passcode_parser(__doc__.splitlines()[0])
    p.add_argument("--policies", nargs="+", default=POLICIES, help="policies compared (all evict the passcode too)")
    args = p.parse_args(argv)
    if args.paper:
        args.budget, args.buffer = PAPER["budget"], PAPER["buffer"]
        args.paper = False  # the distance comes from --rounds, not from the planted probe's geometry
    check_policies(p, "--policies", args.policies)
    base_dir = Path(args.out) if args.out else Path("data/results/passcode")
    rows_by_policy = run_policies(args, p, args.policies, base_dir)
    table = compare(rows_by_policy, seed=args.seed)
    print(f"\npasscode stated once, asked after {args.rounds} rounds (K={args.budget}, r={args.buffer}, "
          f"prompt {'protected' if args.protect_prompt else 'unprotected'}); 95% bootstrap CIs")
    print(f"{'policy':<17} {'n':>3} {'rounds':>7}  {'retrieval':<22} {'mean LP':<26} {'retrieval - random':<24}")
    for r in table:
        diff = (f"{r['retrieval_vs_random']:+.3f} [{r['retrieval_vs_random_lo']:+.3f}, {r['retrieval_vs_random_hi']:+.3f}]"
                if "retrieval_vs_random" in r else "")
        print(f"{r['policy']:<17} {r['n']:>3} {r['rounds']:>7}  {r['retrieval']:.3f} [{r['retrieval_lo']:.3f}, "
              f"{r['retrieval_hi']:.3f}]  {r['mean_lp']:7.2f} [{r['mean_lp_lo']:.2f}, {r['mean_lp_hi']:.2f}]  {diff}")
    print("paper (Qwen3-4B, 57 rounds): random .000, rkv .836, vase .344, snapkv ~0, triattention ~0")
    config = {k: rows_by_policy[args.policies[0]][0]["config"][k] for k in ("model", "budget", "buffer", "protect_prompt",
                                                                             "seed", "rounds")}
    base_dir.mkdir(parents=True, exist_ok=True)
    model = Path(str(config["model"])).name
    path = write_csv(base_dir / f"summary-{model}-K{args.budget}-r{args.buffer}-n{args.rounds}-s{args.seed}"
                     f"{'' if args.protect_prompt else '-unprotected'}.csv", [{**r, **config} for r in table])
    print(f"\nsummary: {path}")
    if not args.no_figure:
        from figures.passcode import plot

        for f in plot(path, args.figure_dir):
            print(f"figure: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
