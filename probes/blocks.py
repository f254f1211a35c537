"""Contiguous blocks: does it matter whether Random evicts single tokens or whole blocks?

    python -m probes.blocks                       # embedded SmolLM2-135M, K=256, r=16, blocks 1 4 16 64 256
    python -m probes.blocks --blocks 1 16 256 --skip-planted

Random eviction in contiguous blocks of ``b`` tokens per head (the ``random-block`` policy: every
head ranks blocks by its own draw each round; ``b=1`` is Random Attention). Its cost, against
blocks per head ``K / b``:

* on real traces: the increase in next-token loss (mean NLL over the tokens after the first round)
  over full attention, paired by sequence;
* on the planted fact: Recall R and Retrieval of a fact left to the block policy, with the
  endpoints (fact deleted / kept everywhere) under the same background eviction.

The paper (Qwen3-4B, K=1024): blocks of 1..64 cost almost nothing; 256 (4 blocks per head) hurts.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from analysis.names import result_name
from analysis.planted import nll_deltas, summarize

from . import cli
from .config import POSITIVE, ConfigError, eviction, option, setting
from .planted import Condition
from .planted_run import (KEY, PlantedConfig, Session, check_traces, condition_units, describe, run_unit,
                          session_rows, setup, write_csv)
from .results import ResultsFile
from .units import Kind, ModelInfo, Output, Plan, Unit, command, make_unit
from randattn.seeding import batch_seed


def nll_sequences(builder, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` stub + trace sequences of ``length`` tokens, each starting at a trace boundary."""
    rng = random.Random(seed * 7_919 + 1)
    need = length - len(builder.stub)
    starts = builder.trace_starts[builder.trace_starts < len(builder.stream) - need]
    if len(starts) == 0:
        raise ValueError(f"the traces hold {len(builder.stream)} tokens; a {length}-token sequence needs more")
    return [builder.stub + builder.stream[s : s + need].tolist() for s in (int(rng.choice(starts)) for _ in range(n))]


NLL_KEY = ("sequence", "arm")


def nll_units(s, arms: dict, n: int, length: int, out: Path,
              stage: str = "next-token loss") -> tuple[Output, list[Unit]]:
    """The next-token-loss part as units: one per (arm, batch of sequences), ``arms`` being ``{label:
    spec_of(batch_index)}`` (an :class:`~randattn.EvictionSpec` per batch; full attention: ``EvictionSpec.full()``)."""
    a = s.config
    config = {**{k: v for k, v in s.results.config.items() if k not in ("policy", "policy_options", "distance",
                                                                          "box_width", "n_facts")},
              "part": "nll", "length": length}
    output = Output(str(out), config, NLL_KEY)
    seqs = nll_sequences(s.builder, n, length, a.seed)
    todo = []
    for arm, spec_of in arms.items():
        for bi in range(0, n, a.batch):
            idx = list(range(bi, min(n, bi + a.batch)))
            work = {"ids": [seqs[i] for i in idx], "idx": idx, "arm": arm, "spec": spec_of(bi), "length": length,
                    "prompt_len": len(s.builder.stub), "score_from": a.budget + a.buffer}
            todo.append(make_unit("nll", config["model"], output, {"arm": arm}, [{"sequence": i} for i in idx], work,
                                  salt=[a.seed, bi], label=f"next-token loss {arm} from {bi}", stage=stage))
    return output, todo


def run_nll_unit(model, tok, unit: Unit):
    """Mean next-token NLL per sequence of one batch under one arm, scored from position T + r on (the first token
    whose context a round has touched); yields its rows."""
    w = unit.work
    ids = torch.tensor(w["ids"], device=model.device)
    spec, score_from = w["spec"], w["score_from"]
    cache = spec.make_cache(max_tokens=w["length"]) if spec.is_full else spec.make_cache()
    res = randattn.replay(model, ids, cache, prompt_len=w["prompt_len"], score_from=score_from, max_chunk=64)
    nll = -res.logprobs[:, score_from:].double().mean(-1).numpy()
    yield [{"sequence": i, "arm": w["arm"], "nll": float(nll[j]), "tokens": w["length"] - score_from,
            "rounds": cache.events[0]} for j, i in enumerate(w["idx"])]


#: The runner of the next-token-loss units (blocks, shared draw).
NLL = Kind("nll", PlantedConfig, None, run_nll_unit, None)


def full_attention(length: int):
    """Full attention through the same code path (a cache no round ever reaches, sized by the sequence)."""
    return lambda bi: randattn.EvictionSpec.full()


@dataclass
@eviction(policy=setting("random-block", help="fixed: random-block", cli=False))
class Config(PlantedConfig):
    """Random eviction in contiguous blocks (``python -m probes.blocks``)."""

    instances: int = option(24, "planted-fact instances per block size", check=POSITIVE)
    blocks: tuple[int, ...] = option((1, 4, 16, 64, 256), "block sizes (tokens)", check=POSITIVE)
    sequences: int = option(16, "trace sequences for the next-token loss", check=POSITIVE)
    length: int = option(1024, "tokens per trace sequence", check=POSITIVE)
    skip_nll: bool = option(False, "skip the next-token-loss part")
    skip_planted: bool = option(False, "skip the planted-fact part")

    def check(self) -> None:
        super().check()
        if self.skip_nll and self.skip_planted:
            raise ConfigError("skip_nll", "--skip-nll --skip-planted together leave nothing to run; drop one of them")
        if self.length <= self.budget + self.buffer:
            raise ConfigError("length", f"{self.length} must exceed T + r = {self.budget + self.buffer} so that rounds "
                                        "run")


def conditions(s: Session) -> list[Condition]:
    w = s.config.box_width
    return [Condition.heads("deleted", [], w), Condition.heads("all", range(s.n_heads), w), Condition.policy("policy")]


def nll_arms(config: Config) -> dict:
    """Full attention and Random in blocks of each size, each batch drawing by its index."""
    arms = {"full": full_attention(config.length)}
    for b in config.blocks:
        arms[f"block{b}"] = (lambda b: lambda bi: config.spec("random-block", options={"block": b},
                                                              seed=batch_seed(config.seed, bi)))(b)
    return arms


def plan(config: Config, model: ModelInfo) -> Plan:
    """Each block size's planted-fact batches, then the next-token-loss batches, as the command line runs them."""
    loaded = (model.bind_target, model.tokenizer)
    outputs, todo, sessions = [], [], {}
    for b in config.blocks:
        s = sessions[b] = setup("blocks", config, policy_options={"block": b}, loaded=loaded, open_results=False)
        if not config.skip_planted:
            outputs.append(s.results)
            todo += condition_units(s, conditions(s), stage=f"blocks: planted fact, block {b}")
    nll = None
    if not config.skip_nll:
        nll, units = nll_units(s, nll_arms(config), config.sequences, config.length, nll_path(s),
                               stage="blocks: next-token loss")
        outputs.append(nll)
        todo += units
    return Plan("blocks", config, outputs, todo, meta={"sessions": sessions, "nll": nll and nll.path})


def merge(p: Plan, rows: dict, figures: bool) -> list:
    """:func:`report` on the merged files."""
    config = p.config.replace(no_figure=not figures)
    sessions = p.meta["sessions"]
    planted = {} if config.skip_planted else {
        b: session_rows(s, conditions(s), rows.get(str(s.results.path), [])) for b, s in sessions.items()}
    last = list(sessions.values())[-1]
    s = dataclasses.replace(last, config=config, results=ResultsFile(last.results.path, last.results.config, KEY))
    report(s, planted, rows.get(p.meta["nll"], []) if p.meta["nll"] else [])
    model = Path(str(last.results.config["model"])).name
    return [Path(o.path) for o in p.outputs] + [Path(last.results.path).parent / result_name("blocks", config,
                                                                                             "summary", model=model)]


def start(p: Plan, files: dict) -> None:
    """The command line's description of the run (the first block size's session)."""
    print(describe(next(iter(p.meta["sessions"].values()))))


def nll_path(s: Session) -> Path:
    a = s.config
    return Path(s.results.path).parent / result_name("blocks", a, "nll", model=s.results.config["model"])


def report(s: Session, planted: dict, nll: list[dict]) -> None:
    a = s.config
    summaries = {b: summarize(rows, ["policy", "all", "deleted"], seed=a.seed) for b, rows in planted.items()}
    deltas = {}
    if nll:
        deltas = {int(k[5:]): v for k, v in nll_deltas(nll, [f"block{b}" for b in a.blocks], seed=a.seed).items()}
        full = np.mean([r["nll"] for r in nll if r["arm"] == "full"])
        print(f"\nnext-token loss over {a.sequences} trace sequences of {a.length} tokens (scored from position "
              f"{a.budget + a.buffer}); full attention {full:.3f} nats/token")
    print(f"\n{'block':>6} {'blocks/head':>11}  {'dNLL vs full [95% CI]':<28} {'R of a fact left to it':<24} "
          f"{'retrieval':<22}")
    table = []
    for b in a.blocks:
        d = deltas.get(b)
        pl = summaries.get(b, {}).get("policy")
        row = {"block": b, "blocks_per_head": a.budget / b, "model": s.results.config["model"], "budget": a.budget,
               "buffer": a.buffer, "distance": a.distance, "policy": "random-block", "seed": a.seed,
               "protect_prompt": a.protect_prompt, "length": a.length, "sequences": a.sequences}
        if d is not None:
            row.update(d.as_dict("delta_nll"))
        if pl is not None:
            row.update(pl.recall.as_dict("recall"))
            row.update(pl.retrieval.as_dict("retrieval"))
            row["retrieval_all"] = summaries[b]["all"].retrieval.value
            row["n_instances"] = pl.n
        table.append(row)
        print(f"{b:>6} {a.budget / b:>11.1f}  {format(d, '.4f') if d else '-':<28} "
              f"{format(pl.recall, '.3f') if pl else '-':<24} {format(pl.retrieval, '.3f') if pl else '-':<22}")
    model = Path(str(s.results.config["model"])).name
    path = write_csv(s.results.path.parent / result_name("blocks", a, "summary", model=model), table)
    print(f"\nsummary: {path}")
    if not a.no_figure:
        cli.draw("blocks", path, a.figure_dir)


KIND = Kind("blocks", Config, plan, run_unit, merge, check=check_traces, start=start)


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return command(KIND, __doc__)(argv)


if __name__ == "__main__":
    sys.exit(main())
