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

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from analysis.names import result_name
from analysis.planted import nll_deltas, passcode_compare, summarize
from randattn.stats import mean_ci

from . import cli, passcode
from .blocks import full_attention, nll_units
from .config import POSITIVE, ConfigError, eviction, option, setting
from .planted import Condition
from .planted_run import (KEY, PlantedConfig, Session, check_traces, condition_units, describe, run_unit,
                          session_rows, setup, write_csv)
from .results import ResultsFile, out_folder
from .units import Kind, ModelInfo, Plan, command
from randattn.seeding import batch_seed

POLICIES = ("random", "random-shared")


@dataclass
@eviction(policy=setting("random", help="fixed: random vs random-shared", cli=False))
class Config(PlantedConfig):
    """Shared vs per-head draws (``python -m probes.shared_draw``)."""

    instances: int = option(32, "planted-fact instances per policy", check=POSITIVE)
    sequences: int = option(16, "trace sequences for the next-token loss", check=POSITIVE)
    length: int = option(1024, "tokens per trace sequence", check=POSITIVE)
    rounds: int = option(57, "passcode: rounds between statement and answer", check=POSITIVE)
    passcode_instances: int = option(16, "passcode: instances per policy", check=POSITIVE)
    skip_nll: bool = option(False, "skip the next-token-loss comparison")
    skip_planted: bool = option(False, "skip the planted-fact comparison")
    skip_passcode: bool = option(False, "skip the passcode comparison")

    def check(self) -> None:
        super().check()
        if self.skip_nll and self.skip_planted and self.skip_passcode:
            raise ConfigError("skip_nll", "--skip-nll --skip-planted --skip-passcode together leave nothing to run; drop one of them")
        if self.length <= self.budget + self.buffer:
            raise ConfigError("length", f"{self.length} must exceed T + r = {self.budget + self.buffer} so that rounds "
                                        "run")


def passcode_config(config: Config) -> passcode.Config:
    """The passcode part's configuration: the probe's geometry, the passcode's own box and protection."""
    return passcode.Config(model=config.model, device=config.device, seed=config.seed, traces=config.traces,
                           out=str(out_folder("shared_draw", config.out) / "passcode"), restart=config.restart,
                           no_figure=True, budget=config.budget, buffer=config.buffer, batch=config.batch,
                           instances=config.passcode_instances, rounds=config.rounds, policies=POLICIES,
                           references=False, parity=0)


def conditions(s: Session) -> list[Condition]:
    w = s.config.box_width
    return [Condition.heads("deleted", [], w), Condition.heads("all", range(s.n_heads), w), Condition.policy("policy")]


def nll_arms(config: Config) -> dict:
    arms = {"full": full_attention(config.length)}
    for policy in POLICIES:
        arms[policy] = (lambda pol: lambda bi: config.spec(pol, seed=batch_seed(config.seed, bi)))(policy)
    return arms


def plan(config: Config, model: ModelInfo) -> Plan:
    """Each policy's planted-fact batches, the next-token-loss batches, then the passcode part's own plan, in the
    order the command line runs them."""
    loaded = (model.bind_target, model.tokenizer)
    outputs, todo, sessions = [], [], {}
    for policy in POLICIES:
        s = sessions[policy] = setup("shared_draw", config.replace(policy=policy), loaded=loaded, open_results=False)
        if not config.skip_planted:
            outputs.append(s.results)
            todo += condition_units(s, conditions(s), stage=f"planted fact: {policy}")
    meta = {"sessions": sessions, "nll": None, "passcode": None}
    if not config.skip_nll:
        out = Path(s.results.path).parent / result_name("shared_draw", config, "nll", model=s.results.config["model"])
        nll, units = nll_units(s, nll_arms(config), config.sequences, config.length, out, stage="next-token loss")
        outputs.append(nll)
        todo += units
        meta["nll"] = nll.path
    if not config.skip_passcode:
        codes = meta["passcode"] = passcode.plan(passcode_config(config), model)
        outputs += codes.outputs
        todo += codes.units
    return Plan("shared_draw", config, outputs, todo, meta=meta)


def merge(p: Plan, rows: dict, figures: bool) -> list:
    """:func:`report` on the merged files."""
    config = p.config.replace(no_figure=not figures)
    sessions = p.meta["sessions"]
    planted = {} if config.skip_planted else {
        pol: session_rows(s, conditions(s), rows.get(str(s.results.path), [])) for pol, s in sessions.items()}
    nll = rows.get(p.meta["nll"], []) if p.meta["nll"] else []
    codes = passcode.rows_by_policy(p.meta["passcode"], rows) if p.meta["passcode"] else {}
    last = list(sessions.values())[-1]
    s = dataclasses.replace(last, config=config, results=ResultsFile(last.results.path, last.results.config, KEY))
    report(s, planted, nll, codes)
    model = Path(str(last.results.config["model"])).name
    return [Path(o.path) for o in p.outputs] + [Path(last.results.path).parent / result_name(
        "shared_draw", config, "summary", model=model)]


def start(p: Plan, files: dict) -> None:
    """The command line's description of the run (the first policy's session)."""
    print(describe(next(iter(p.meta["sessions"].values()))))


def report(s: Session, planted: dict, nll: list[dict], codes: dict) -> None:
    a = s.config
    table = []
    if nll:
        deltas = nll_deltas(nll, list(POLICIES), seed=a.seed)
        diff = nll_deltas(nll, ["random-shared"], reference="random", seed=a.seed)["random-shared"]
        print(f"\nnext-token loss increase over full attention ({a.sequences} sequences of {a.length} tokens):")
        for policy in POLICIES:
            print(f"  {policy:<14} {deltas[policy]:.4f} nats/token")
            table.append({"measure": "delta_nll_vs_full", "policy": policy, "n": deltas[policy].n,
                          **deltas[policy].as_dict("value")})
        print(f"  shared - per-head: {diff:.4f}")
        table.append({"measure": "delta_nll_vs_full", "policy": "shared - per-head", "n": diff.n,
                      **diff.as_dict("value")})
    if planted:
        print("\nplanted fact left to the policy (R vs deleted/kept-everywhere under the same policy):")
        for policy, rows in planted.items():
            pol = summarize(rows, ["policy", "all", "deleted"], seed=a.seed)["policy"]
            print(f"  {policy:<14} R {pol.recall:.3f}  retrieval {pol.retrieval:.3f}")
            table.append({"measure": "planted_recall", "policy": policy, "n": pol.n, **pol.recall.as_dict("value")})
            table.append({"measure": "planted_retrieval", "policy": policy, "n": pol.n,
                          **pol.retrieval.as_dict("value")})
        ok = {pol: {r["instance"]: r["retrieved"] for r in rows if r["condition"] == "policy"}
              for pol, rows in planted.items()}
        common = sorted(set(ok["random"]) & set(ok["random-shared"]))
        d = mean_ci([ok["random-shared"][i] - ok["random"][i] for i in common], seed=a.seed)
        print(f"  retrieval shared - per-head: {d:.3f}")
        table.append({"measure": "planted_retrieval", "policy": "shared - per-head", "n": d.n, **d.as_dict("value")})
    if codes:
        print(f"\npasscode stated once, asked after {a.rounds} rounds (prompt protected):")
        for r in passcode_compare(codes, seed=a.seed)[-len(POLICIES):]:
            print(f"  {r['policy']:<14} retrieval {r['retrieval']:.3f} [{r['retrieval_lo']:.3f}, {r['retrieval_hi']:.3f}]"
                  f"  mean LP {r['mean_lp']:.2f}")
            table.append({"measure": "passcode_retrieval", "policy": r["policy"], "n": r["n"], "value": r["retrieval"],
                          "value_lo": r["retrieval_lo"], "value_hi": r["retrieval_hi"]})
    print("\npaper: a shared draw is about as good as per-head draws on real traces; per-head diversity matters "
          "for once-stated facts")
    model = Path(str(s.results.config["model"])).name
    path = write_csv(s.results.path.parent / result_name("shared_draw", a, "summary", model=model),
                     [{**r, "model": s.results.config["model"], "budget": a.budget, "buffer": a.buffer} for r in table])
    print(f"\nsummary: {path}")
    if not a.no_figure:
        cli.draw("shared_draw", path, a.figure_dir)


KIND = Kind("shared_draw", Config, plan, run_unit, merge, check=check_traces, start=start)


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return command(KIND, __doc__)(argv)


if __name__ == "__main__":
    sys.exit(main())
