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

from . import cli
from .config import POSITIVE, ConfigError, option
from .planted import Condition
from .planted_run import PAPER, PlantedConfig, describe, run_conditions, setup, write_csv
from .policy_specs import bind_policies, calibration_options, check_policy

FACT = " IMPORTANT: the passcode is {value}. Remember it."
QUERY = "\nWhat was the passcode again? The passcode is"
INSTRUCTION = "Solve the problems below step by step."


def passcode_distance(rounds: int, buffer: int, box_width: int) -> int:
    """Distance from the statement to the answer such that exactly ``rounds`` rounds run in between: the
    statement ends where a round fires, then one round every ``r`` tokens."""
    return box_width + (rounds - 1) * buffer + 1


@dataclass
class Config(PlantedConfig):
    """The passcode needle: a fact stated once, asked after many rounds (``python -m probes.passcode``)."""

    instances: int = option(16, "instances per policy (paired across policies)", check=POSITIVE)
    box_width: int = option(20, "tokens of the passcode sentence box", check=POSITIVE)
    protect_prompt: bool = option(True, "protect the stub prompt (as the paper's methods); --no-protect-prompt lets "
                                        "it be evicted too")
    distance: int = option(384, "set from --rounds, --buffer and --box-width", cli=False)
    policy: str = option("random", "set per policy from --policies", cli=False)
    policies: tuple[str, ...] = option(randattn.COMPARED_POLICIES, "policies compared (all evict the passcode too)")
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
        super().check()
        for spec in self.policies:
            check_policy("policies", spec)


def run(config: Config, model=None, tokenizer=None) -> tuple[dict, dict]:
    """``({policy: rows}, {policy: session})``: the passcode instances under each policy (resuming finished rows);
    with ``references``, Random's file also gets full attention and the passcode pinned everywhere."""
    loaded = None if model is None else (model, tokenizer)
    rows_by_policy, sessions = {}, {}
    for policy in config.policies:
        s = setup("passcode", config.replace(policy=policy), loaded=loaded, extra_config={"rounds": config.rounds},
                  builder_texts={"fact": FACT, "query": QUERY, "instruction": INSTRUCTION, "deletable": False},
                  pins_boxes=policy == "random" and config.references)  # only the "kept" reference pins the box
        if loaded is None:
            print(describe(s).replace(f"distance {config.distance}", f"{config.rounds} rounds"))
            fits = len(s.builder.stub) * config.protect_prompt + config.box_width + 1
            if fits > config.budget - config.buffer:
                raise ConfigError("budget", f"T={config.budget} cannot hold the passcode box ({config.box_width}) "
                                            f"pinned beside the protected stub prompt ({len(s.builder.stub)}) and the "
                                            f"recent window of r={config.buffer}; use --budget >= {fits + config.buffer}")
            # Every policy binds to the model before the first one runs (TriAttention without statistics for it
            # stops the run here, not after the other policies have been computed).
            bind_policies("policies", config.policies, s.model, lambda p: calibration_options(p, config.stats))
        loaded = (s.model, s.tok)
        sessions[policy] = s
        rows_by_policy[policy] = run_conditions(s, [Condition.policy("policy")], desc=f"passcode: {policy}")
        if policy == "random" and config.references:
            # Can the model retrieve the passcode at this distance at all? Full attention, and the passcode
            # pinned in every head while Random evicts the rest.
            kept = run_conditions(s, [Condition.heads("kept", range(s.n_heads), s.builder.box_width)],
                                  desc="passcode: kept everywhere")
            full = run_conditions(dataclasses.replace(s, no_eviction=True), [Condition.policy("full")],
                                  desc="passcode: full attention")
            rows_by_policy["random"] = rows_by_policy["random"] + kept + full
    return rows_by_policy, sessions


def summary_name(config: Config, model: str) -> str:
    return result_name("passcode", config, "summary", model=model)


def report(config: Config, rows_by_policy: dict, sessions: dict) -> None:
    table = passcode_compare(rows_by_policy, seed=config.seed)
    print(f"\npasscode stated once, asked after {config.rounds} rounds (T={config.budget}, r={config.buffer}, "
          f"prompt {'protected' if config.protect_prompt else 'unprotected'}); 95% bootstrap CIs")
    print(f"{'policy':<17} {'n':>3} {'rounds':>7}  {'retrieval':<22} {'mean LP':<26} {'retrieval - random':<24}")
    for r in table:
        diff = (f"{r['retrieval_vs_random']:+.3f} [{r['retrieval_vs_random_lo']:+.3f}, {r['retrieval_vs_random_hi']:+.3f}]"
                if "retrieval_vs_random" in r else "")
        print(f"{r['policy']:<17} {r['n']:>3} {r['rounds']:>7}  {r['retrieval']:.3f} [{r['retrieval_lo']:.3f}, "
              f"{r['retrieval_hi']:.3f}]  {r['mean_lp']:7.2f} [{r['mean_lp_lo']:.2f}, {r['mean_lp_hi']:.2f}]  {diff}")
    print("paper (Qwen3-4B, 57 rounds): random .000, rkv .836, vase .344, snapkv ~0, triattention ~0")
    first = rows_by_policy[config.policies[0]][0]["config"]
    record = {k: first[k] for k in ("model", "budget", "buffer", "protect_prompt", "seed", "rounds")}
    folder = sessions[config.policies[0]].results.path.parent
    path = write_csv(folder / summary_name(config, record["model"]), [{**r, **record} for r in table])
    print(f"\nsummary: {path}")
    if not config.no_figure:
        cli.draw("passcode", path, config.figure_dir)


def main(argv=None) -> int:
    return cli.main(Config, lambda c: report(c, *run(c)), argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
