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

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import randattn
from analysis.names import result_name
from analysis.planted import passcode_compare
from randattn.spec import min_budget

from . import cli
from .config import POSITIVE, ConfigError, eviction, option, setting
from .planted import Condition
from .planted_run import PAPER, run_unit, PlantedConfig, condition_units, describe, setup, write_csv
from .units import Kind, ModelInfo, Plan, command, run_local

FACT = " IMPORTANT: the passcode is {value}. Remember it."
QUERY = "\nWhat was the passcode again? The passcode is"
INSTRUCTION = "Solve the problems below step by step."


def passcode_distance(rounds: int, buffer: int, box_width: int) -> int:
    """Distance from the statement to the answer such that exactly ``rounds`` rounds run in between: the
    statement ends where a round fires, then one round every ``r`` tokens."""
    return box_width + (rounds - 1) * buffer + 1


def min_rounds(buffer: int) -> int:
    """The fewest rounds whose distance leaves a query room after the box (the planted builder's ``w + 16``)."""
    return 1 + -(-15 // buffer)


@dataclass
@eviction(policy=setting("random", help="set per policy from --policies", cli=False),
          policies=setting(randattn.COMPARED_POLICIES, help="policies compared (all evict the passcode too)"),
          protect_prompt=True)
class Config(PlantedConfig):
    """The passcode needle: a fact stated once, asked after many rounds (``python -m probes.passcode``)."""

    instances: int = option(16, "instances per policy (paired across policies)", check=POSITIVE)
    box_width: int = option(20, "tokens of the passcode sentence box", check=POSITIVE)
    distance: int = option(384, "set from --rounds, --buffer and --box-width", cli=False)
    rounds: int = option(57, "eviction rounds between statement and answer", check=POSITIVE)
    references: bool = option(True, "also run full attention and the passcode pinned everywhere (with random)",
                              cli=False)

    def __post_init__(self) -> None:
        # The distance comes from the rounds, not from the planted probe's --paper geometry (T and r do).
        if self.paper:
            self.budget, self.buffer = PAPER["budget"], PAPER["buffer"]
            self.paper = False
        self.distance = passcode_distance(self.rounds, self.buffer, self.box_width)
        super().__post_init__()

    def check(self) -> None:
        # The distance is derived from --rounds here, so a too-short one is the rounds' fault, not --distance's
        # (a flag the passcode command line does not have).
        least = min_rounds(self.buffer)
        if self.rounds < least:
            raise ConfigError("rounds", f"--rounds {self.rounds} leaves too few tokens between the {self.box_width}-"
                                        f"token statement and its query at r={self.buffer}; use >= {least}")
        super().check()


def plan(config: Config, model: ModelInfo) -> Plan:
    """Each policy's file and its batches of instances (then, in Random's file with ``references``, the passcode
    pinned everywhere and full attention), in the order a single-machine run computes them."""
    outputs, todo, sessions = [], [], {}
    loaded = (model.bind_target, model.tokenizer)
    for policy in config.policies:
        s = setup("passcode", config.replace(policy=policy), loaded=loaded, extra_config={"rounds": config.rounds},
                  builder_texts={"fact": FACT, "query": QUERY, "instruction": INSTRUCTION, "deletable": False},
                  pins_boxes=policy == "random" and config.references,  # only the "kept" reference pins the box
                  open_results=False)
        if not sessions:
            # The references pin the passcode box beside the protected stub prompt (a run without them pins nothing).
            need = min_budget(len(s.builder.stub) * config.protect_prompt + config.box_width, s.spec.recent_window)
            if config.references and need > config.budget:
                raise ConfigError("budget", f"T={config.budget} cannot hold the passcode box ({config.box_width}) "
                                            f"pinned beside the protected stub prompt ({len(s.builder.stub)}) and the "
                                            f"recent window of r={config.buffer}; use --budget >= {need}")
            # Every policy binds to the model before the first one runs (TriAttention without statistics for it
            # stops the run here, not after the other policies have been computed).
            for name in config.policies:
                config.bind(config.spec(name), s.model, field="policies")
        sessions[policy] = s
        outputs.append(s.results)
        groups = [(s, [Condition.policy("policy")])]
        if policy == "random" and config.references:
            # Can the model retrieve the passcode at this distance at all? Full attention, and the passcode
            # pinned in every head while Random evicts the rest.
            groups += [(s, [Condition.heads("kept", range(s.n_heads), s.builder.box_width)]),
                       (dataclasses.replace(s, no_eviction=True), [Condition.policy("full")])]
        for session, conditions in groups:
            todo += condition_units(session, conditions, stage="passcode")
    summary = Path(outputs[0].path).parent / summary_name(config, model.name)
    return Plan("passcode", config, outputs, todo, meta={"sessions": sessions, "summary": str(summary)})


def rows_by_policy(p: Plan, rows: dict) -> dict:
    """``{policy: rows}`` of this run's instances (Random's with its references after its own)."""
    out = {}
    for policy, s in p.meta["sessions"].items():
        names = ["policy", "kept", "full"] if policy == "random" and p.config.references else ["policy"]
        mine = {(i, n) for i in range(p.config.instances) for n in names}
        file_rows = [r for r in rows[str(s.results.path)] if (r["instance"], r["condition"]) in mine]
        out[policy] = [r for n in names for r in file_rows if r["condition"] == n]
    return out


def run(config: Config, model, tokenizer) -> tuple[dict, dict]:
    """``({policy: rows}, {policy: session})`` from code with the model loaded (the leaderboard's passcode task):
    :func:`plan`'s units run here (resuming finished rows), nothing printed but their progress; with
    ``references``, Random's file also gets full attention and the passcode pinned everywhere."""
    p = plan(config, ModelInfo.loaded(config.model or randattn.DEFAULT_MODEL, model, tokenizer))
    files = run_local(p, model, tokenizer, restart=config.restart, desc="passcode")
    sessions = {pol: dataclasses.replace(s, model=model, tok=tokenizer, results=files[str(s.results.path)])
                for pol, s in p.meta["sessions"].items()}
    return rows_by_policy(p, {path: rf.rows for path, rf in files.items()}), sessions


def describe_run(p: Plan) -> None:
    """The command line's description of the run (the first policy's session, its distance as rounds), printed
    once the plan is made (``Kind.planned``)."""
    config = p.config
    print(describe(p.meta["sessions"][config.policies[0]]).replace(f"distance {config.distance}",
                                                                 f"{config.rounds} rounds"))


def merge(p: Plan, rows: dict, figures: bool) -> list[Path]:
    """A grid's merge: the comparison summary beside the per-policy files, as :func:`report` writes it; prints
    the table."""
    by_policy = rows_by_policy(p, rows)
    config = p.config
    table = passcode_compare(by_policy, seed=config.seed)
    first = p.outputs[0].config
    record = {k: first[k] for k in ("model", "budget", "buffer", "protect_prompt", "seed", "rounds")}
    summary = write_csv(p.meta["summary"], [{**r, **record} for r in table])
    print(f"\n== {summary.parent}: passcode after {config.rounds} rounds, K={config.budget}, r={config.buffer}, "
          f"prompt {'protected' if config.protect_prompt else 'unprotected'}")
    print(f"{'policy':<20} {'n':>4}  {'retrieval [95% CI]':<22}  {'mean LP':>8}")
    for t in table:
        print(f"{t['policy']:<20} {t['n']:>4}  {t['retrieval']:.3f} [{t['retrieval_lo']:.3f}, {t['retrieval_hi']:.3f}]"
              f"  {t['mean_lp']:8.2f}")
    paths = [Path(o.path) for o in p.outputs] + [summary]
    if figures:
        paths += cli.draw("passcode", summary, config.figure_dir, "--name", summary.stem)
    return paths


def summary_name(config: Config, model: str) -> str:
    return result_name("passcode", config, "summary", model=model)


def report(p: Plan, rows: dict, figures: bool) -> list[Path]:
    """The command line's table (with the rounds each instance really went through and the difference from Random)
    and the summary beside the per-policy files; the figure as ``passcode.png`` (``Kind.report``: a grid's
    :func:`merge` names its figure after the summary, one per geometry)."""
    config = p.config
    by_policy = rows_by_policy(p, rows)
    table = passcode_compare(by_policy, seed=config.seed)
    print(f"\npasscode stated once, asked after {config.rounds} rounds (T={config.budget}, r={config.buffer}, "
          f"prompt {'protected' if config.protect_prompt else 'unprotected'}); 95% bootstrap CIs")
    print(f"{'policy':<17} {'n':>3} {'rounds':>7}  {'retrieval':<22} {'mean LP':<26} {'retrieval - random':<24}")
    for r in table:
        diff = (f"{r['retrieval_vs_random']:+.3f} [{r['retrieval_vs_random_lo']:+.3f}, {r['retrieval_vs_random_hi']:+.3f}]"
                if "retrieval_vs_random" in r else "")
        print(f"{r['policy']:<17} {r['n']:>3} {r['rounds']:>7}  {r['retrieval']:.3f} [{r['retrieval_lo']:.3f}, "
              f"{r['retrieval_hi']:.3f}]  {r['mean_lp']:7.2f} [{r['mean_lp_lo']:.2f}, {r['mean_lp_hi']:.2f}]  {diff}")
    print("paper (Qwen3-4B, 57 rounds): random .000, rkv .836, vase .344, snapkv ~0, triattention ~0")
    first = by_policy[config.policies[0]][0]["config"]
    record = {k: first[k] for k in ("model", "budget", "buffer", "protect_prompt", "seed", "rounds")}
    folder = Path(p.meta["sessions"][config.policies[0]].results.path).parent
    path = write_csv(folder / summary_name(config, record["model"]), [{**r, **record} for r in table])
    print(f"\nsummary: {path}")
    paths = [Path(o.path) for o in p.outputs] + [path]
    if figures:
        paths += cli.draw("passcode", path, config.figure_dir)
    return paths


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return command(KIND, __doc__)(argv)


def grid_folder(config: Config) -> str:
    """A grid's folder for one geometry (the summary's name without ``summary-`` and ``.csv``)."""
    return summary_name(config, config.model or randattn.DEFAULT_MODEL)[len("summary-"):-len(".csv")]


KIND = Kind("passcode", Config, plan, run_unit, merge, grid_folder=grid_folder, planned=describe_run,
            report=report)

if __name__ == "__main__":
    sys.exit(main())
