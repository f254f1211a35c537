"""Accuracy under eviction: generate with the evicting cache, grade, compare policies with the paper's statistics.

    python -m probes.accuracy                                   # embedded SmolLM2-135M, copy task, every policy
    python -m probes.accuracy --policy random --no-protect-prompt          # add score-only Random to the same file
    python -m probes.accuracy --model Qwen/Qwen3-4B --task math500 --policy full random snapkv rkv --runs 4
    python -m probes.accuracy --task math500 --data math500.jsonl --compression 2 4 8 16 --policy random triattention

Every problem is generated under each policy's cache (``--policy full`` is full attention: a cache
large enough never to evict) with the model's chat template (thinking mode where the template has
one, e.g. Qwen3), graded (see :mod:`probes.tasks`), and written as one JSONL row per
(problem, run, policy, K, protection) with the full config, the generated length, whether the
model stopped by itself (EOS), the eviction rounds applied while the row was still generating
(from the cache's event counter) and the grade. Interrupted runs resume where they stopped.

Runs: greedy decoding (the default) makes runs differ only by the eviction seed (per seed, run and
batch), so full attention and the policies that never draw on the seed (``Policy.uses_seed`` False:
recency, streamingllm, h2o, snapkv, rkv, triattention) run once, and random, random-shared and vase (Gumbel
sampling) run ``--runs`` times; ``--temperature T`` samples (``--top-p``), and every policy then runs
``--runs`` times with a sampling seed per run. ``--compression c [c ...]`` sets ``K = mean full-attention
generation length / c`` on the same problems (full attention is run first when missing).

Reference log-prob (``--reference-lp``): a continuous, teacher-forced endpoint beside the generated one. The reference
continuation of (problem, run) is full attention's own output for it (greedy: its one run, run 0, for every run of
the other arms; with ``--temperature > 0`` full attention's sample ``k`` for run ``k``), the stored text re-tokenized
without special tokens (``--reference-tokens N``: its first N tokens). Every arm, full attention included (the
ceiling), teacher-forces the prompt plus the reference through its own evicting cache (:func:`randattn.replay`: the
eviction rounds where token-by-token decoding has them), with the seed (and, packed, the row key) its generation of that
(problem, run) drew with, and records the mean log-prob per reference token (``ref_lp``), their sum, the tokens scored
and the rounds that fired. The rows go to ``<results>.reference_lp.jsonl`` beside the generation rows, a stage
planned after them (full attention is added to ``--policy`` when missing: its outputs are the reference).

Length guard: a row whose generation ended before any eviction round fired (``events == 0``) did
no compression and is marked ``compressed: false``; the summary warns loudly (the paper's vLLM
benchmark bug, where "compressed" runs never reached the budget).

Summary: accuracy per policy with a 95% bootstrap CI, the paired, problem-clustered comparison
with Random at the same K and protection (mean difference, CI, bootstrap p, exact sign test,
verdict: significant only when both pass), the protection gain for policies run both ways, and the
methods x budgets table (Markdown printed; CSV, LaTeX and Markdown written beside the rows), plus
``figures/accuracy.png``; the repeat task's two endpoints (copies written, fidelity of the copies) and the reference
log-prob per arm, each compared with Random the same way.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Optional

import numpy as np
import torch

import randattn
from analysis.accuracy import (FULL, Arm, endpoint_summary, protection_gains, summarize,  # noqa: F401
                               table_results, warn_uncompressed)
from analysis.files import write_text
from analysis.names import result_name, shipped_name
from randattn.spec import SpecError
from randattn.stats import comparison_table

from . import cli
from .config import NONNEGATIVE, POSITIVE, ConfigError, EvictionConfig, eviction, option, setting
from .planted_run import write_csv
from .policy_specs import bind_policies, calibration_options, grid_protection, native_protection, seed_free
from .results import REPO_ROOT, ResultsFile, out_folder, run_record
from .sandbox import unavailable as code_sandbox_unavailable
from .tasks import TASKS, TaskDataError, get_task, has_thinking_mode, load_problems, problem_ids
from .units import Kind, ModelInfo, Output, Plan, Unit, command, make_unit, run as run_kind, stable_id
from randattn import seeding

KEY = ("problem", "run", "policy", "budget", "protect_prompt")

#: The protocols, by name. ``protected`` / ``score-only``: every policy with the prompt pinned / competing.
#: ``matched``: the paper's Table 2, every policy both ways. ``grid``: the paper's main grid
#: (``scripts/run_cell.sh``): each baseline in its native mode against protected Random, sampling with the model
#: card's settings (its generation config), the paper's runs per task.
PROTOCOLS = ("protected", "score-only", "matched", "grid")
# the default run's results (the embedded model on the copy task); figures/__main__.py draws it by default
DEFAULT_RESULT_NAME = Path(shipped_name("accuracy")).name
# the repeat task's shipped compression sweep (docs/probes.md); figures/__main__.py draws it as accuracy_repeat
REPEAT_RESULT_NAME = Path(shipped_name("accuracy_repeat")).name
#: the figure each shipped run is drawn as (``python -m figures`` draws the same names); other runs: their file's
FIGURE_NAMES = {DEFAULT_RESULT_NAME: "accuracy", REPEAT_RESULT_NAME: "accuracy_repeat"}


# -- command line ---------------------------------------------------------------------------------
@dataclass
@eviction(policy=setting((FULL, *randattn.COMPARED_POLICIES),
                         help=f"policies to run; '{FULL}' is full attention (no eviction)"),
          budget=setting(None, several=True, help="T, one or several (a budget sweep); default: the task's, e.g. "
                                                  "math500 1024"),
          buffer=setting(None, help="r (default: the task's; 64 for the paper's tasks)"),
          protect_prompt=setting(True, help="score only: the prompt competes with everything else (the same as "
                                            "--protocol score-only)"),
          stats=setting(None, help="TriAttention statistics file (default: the embedded model's)"))
class Config(EvictionConfig):
    """Accuracy under eviction: generate, grade, compare with Random (``python -m probes.accuracy``)."""

    task: str = option("copy", "the task", choices=tuple(TASKS))
    compression: Optional[tuple[float, ...]] = option(None, "set T = mean full-attention generation length / c for "
                                                            "each c (instead of --budget)", check=POSITIVE)
    runs: Optional[int] = option(None, "runs per problem (eviction seeds; sampling seeds too); default 3, or the "
                                       "paper's per task with --protocol grid (MATH500 2, GPQA 4, AIME/HMMT 16, "
                                       "LiveCodeBench 4)", check=POSITIVE)
    problems: Optional[int] = option(None, "first N problems (default: all; copy: 32)", check=POSITIVE)
    data: Optional[str] = option(None, "local JSONL of problems instead of the HF dataset (fields: see probes/tasks.py)")
    protocol: Optional[str] = option(None, "which arms run: 'protected' (default) or 'score-only' for every policy; "
                                           "'matched' both ways (the paper's Table 2); 'grid' each baseline in its "
                                           "native mode against protected Random, sampling with the model card's "
                                           "settings and the paper's runs per task (its main grid)", choices=PROTOCOLS)
    max_new_tokens: Optional[int] = option(None, "default: the task's (32768 for the paper's tasks)", check=POSITIVE)
    temperature: Optional[float] = option(None, "0 = greedy (default); > 0 samples; --protocol grid: the model card's "
                                                "(generation config)", check=NONNEGATIVE)
    top_p: Optional[float] = option(None, "nucleus sampling with --temperature (default 1)")
    batch: int = option(32, "problems of equal prompt length generated together (with --pack: any problems)",
                        check=POSITIVE)
    pack: bool = option(False, "pack problems of different prompt lengths into left-padded batches, sorted by "
                               "length; each row draws by its own key (problem, run), so its keep-sets do not depend "
                               "on the batch (rows are written to a -packed results file)")
    policy_option: tuple[str, ...] = option((), "policy options, e.g. h2o:recent_fraction=0.25 snapkv:window=16 "
                                                "(override the task's)", metavar="POLICY:KEY=VALUE")
    unsafe_code_grading: bool = option(False, "code tasks: run the generated programs without the bubblewrap "
                                              "sandbox, with resource limits alone (they can read, write and reach "
                                              "the network as you); only where bwrap cannot be installed")
    reference_lp: bool = option(False, "also the teacher-forced log-prob of the reference continuation: full "
                                       "attention's own output for each (problem, run) (greedy: its one run), "
                                       "re-tokenized, replayed through every arm's cache (full attention's too, the "
                                       "ceiling) with the seed that arm generated with; rows in "
                                       "<results>.reference_lp.jsonl (adds full attention to --policy when missing)")
    reference_tokens: Optional[int] = option(None, "with --reference-lp: score only the first N tokens of the "
                                                   "reference (default: all of it)", check=POSITIVE)
    options: dict = option({}, "resolved policy options", cli=False)

    full_allowed = True
    #: a grid's ``protect_prompt = [true, false]``: both modes in one run, ``protocol = "matched"`` (probes.grid_spec)
    both_protections = ("protocol", "matched")

    def protection_of(self, policy: str) -> Optional[bool]:
        return None  # the protocol decides each arm's protection (protocol_arms)

    def check(self) -> None:
        self.check_eviction()
        if self.compression is not None and self.budget is not None:
            raise ConfigError("compression", "--budget and --compression both set T; pass one of them")
        if not self.protect_prompt and self.protocol not in (None, "score-only"):
            raise ConfigError("protocol", f"--no-protect-prompt and --protocol {self.protocol} disagree; pass one of "
                                          "them")
        if self.protocol == "grid":  # an unknown policy is refused here, before anything runs
            for name in self.policy_names():
                if grid_protection(name) is None:
                    raise ConfigError("protocol", _no_grid_mode(name))
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_p not in (None, 1.0) and (self.temperature == 0 or (self.temperature is None and self.protocol != "grid")):
            raise ConfigError("top_p", "applies only when sampling; greedy decoding (--temperature 0, the default "
                                       "here) ignores it: pass --temperature T > 0 too, or drop --top-p")
        if self.reference_tokens is not None and not self.reference_lp:
            raise ConfigError("reference_tokens", "applies only with --reference-lp (it cuts the reference the "
                                                  "log-prob is scored on): add --reference-lp, or drop "
                                                  "--reference-tokens")

    def resolved(self, model=None) -> "Config":
        """The task's and the protocol's defaults filled in (runs, r, length, sampling, protocol, policy options)."""
        task = get_task(self.task)
        protocol = self.protocol or ("protected" if self.protect_prompt else "score-only")
        runs = self.runs or (task.paper_runs if protocol == "grid" and task.paper_runs else 3)
        temperature, top_p = self.temperature, self.top_p
        if temperature is None:
            temperature, card_top_p = model_card_sampling(model) if protocol == "grid" and model is not None else (0, 1)
            top_p = card_top_p if top_p is None else top_p
        return self.replace(protocol=protocol, runs=runs, buffer=self.buffer or task.buffer,
                            max_new_tokens=self.max_new_tokens or task.max_new_tokens, temperature=float(temperature),
                            top_p=1.0 if top_p is None else float(top_p),
                            options=policy_options(self.policy_option, task.policy_options))


def model_card_sampling(model) -> tuple[float, float]:
    """``(temperature, top_p)`` of the model's generation config (the model card's sampling, as the paper's harness
    samples with ``do_sample=True`` and the config's defaults), or greedy when the config does not sample."""
    gc = getattr(model, "generation_config", None)
    if gc is None or not getattr(gc, "do_sample", False) or not getattr(gc, "temperature", None):
        return 0.0, 1.0
    return float(gc.temperature), float(getattr(gc, "top_p", None) or 1.0)


def policy_options(specs, task_defaults: dict) -> dict:
    """``{policy: {option: value}}``: the task's defaults updated by ``--policy-option POLICY:KEY=VALUE``; every
    option is checked against the policy's constructor."""
    options = {pol: dict(opts) for pol, opts in task_defaults.items()}
    for spec in specs:
        pol, sep, rest = spec.partition(":")
        key, eq, value = rest.partition("=")
        if not sep or not eq or not key:
            raise ConfigError("policy_option", f"{spec!r}: expected POLICY:KEY=VALUE, e.g. h2o:recent_fraction=0.25")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass  # a plain string such as aggregate=max
        options.setdefault(pol, {})[key] = value
    for pol, opts in options.items():
        try:
            randattn.make_policy(pol, **opts)
        except (ValueError, TypeError) as exc:
            raise ConfigError("policy_option", f"for {pol}: {exc}") from None
    return options


# -- generation -------------------------------------------------------------------------------------
def arm_spec(arm: Arm, *, buffer: int, seed: int, stats, options: dict) -> randattn.EvictionSpec:
    """The eviction setting of one arm (``options``: ``{policy: {option: value}}``; ``stats`` goes to a policy that
    reads calibration data)."""
    if arm.policy == FULL:
        return randattn.EvictionSpec.full()
    return randattn.EvictionSpec(arm.policy, arm.budget, buffer, protect_prompt=arm.protect, seed=seed,
                                 options=options.get(arm.policy, {}), stats=stats)


def make_cache(arm: Arm, *, prompt_len: int, max_new_tokens: int, buffer: int, seed: int, stats,
               options: dict, row_keys: Optional[list] = None) -> randattn.EvictingCache:
    """The cache for one batch (full attention: a cache too big ever to evict, which draws nothing, so it takes no
    row keys)."""
    spec = arm_spec(arm, buffer=buffer, seed=seed, stats=stats, options=options)
    return spec.make_cache(max_tokens=prompt_len + max_new_tokens, row_keys=None if spec.is_full else row_keys)


def eos_ids(model, tok) -> set[int]:
    """Every token id that ends a generation for this model."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen if isinstance(gen, (list, tuple)) else [gen] if gen is not None else [])
    return ids


@dataclass(frozen=True)
class Generation:
    """How a batch is generated: r, the length limit, sampling, the policies' options (from a resolved Config)."""

    buffer: int
    max_new_tokens: int
    temperature: float
    top_p: float
    options: dict

    @classmethod
    def of(cls, config) -> "Generation":
        return cls(config.buffer, config.max_new_tokens, config.temperature, config.top_p, dict(config.options))


def generate_batch(model, tok, prompts: list[list[int]], arm: Arm, *, seed: int, args, stats,
                   row_keys: Optional[list] = None) -> list[dict]:
    """Generate one batch under ``arm``: prompts of equal length, or (``row_keys``, one per prompt) any lengths,
    left-padded, each row drawing by its own key; per row: text, length, EOS, rounds."""
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos_ids(model, tok)), 0)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    cache = make_cache(arm, prompt_len=width, max_new_tokens=args.max_new_tokens, buffer=args.buffer, seed=seed,
                       stats=stats, options=args.options, row_keys=row_keys)
    stop = eos_ids(model, tok)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 \
        else {"do_sample": False}
    if args.temperature > 0:
        torch.manual_seed(seed)
    out = randattn.generate(model, ids, cache, max_new_tokens=args.max_new_tokens, pad_token_id=pad,
                            attention_mask=mask if width > min(len(p) for p in prompts) else None, **sampling)
    return rows_of(out[:, width:].tolist(), prompt_lens=[len(p) for p in prompts], cache=cache, tok=tok, stop=stop)


def rounds_before(cache, end: int, row: int = 0) -> int:
    """The eviction rounds (of layer 0) that shaped a sequence of ``end`` tokens of batch row ``row``. A round at
    sequence length s runs after that step's attention, so it shapes tokens from position s + 1 on; rows that stopped
    early share the cache with rows that go on, so only rounds before this row's end count. A padded batch's rows run
    their own rounds, at their own lengths."""
    layer = cache.layers[0] if cache.layers else None
    fired = [] if layer is None else layer.row_round_lengths[row] if layer.held is not None else layer.round_lengths
    return sum(s < end - 1 for s in fired)


def rows_of(gen: list[list[int]], *, prompt_lens: list[int], cache, tok, stop: set[int]) -> list[dict]:
    """Per generated row: text up to its first stop token, length, EOS, and the eviction rounds that shaped it."""
    rows = []
    for b, (g, prompt_len) in enumerate(zip(gen, prompt_lens)):
        end = next((i + 1 for i, t in enumerate(g) if t in stop), None)
        length = end if end is not None else len(g)
        events = rounds_before(cache, prompt_len + length, b)
        rows.append({"prompt_len": prompt_len, "gen_len": length, "terminated": end is not None, "events": events,
                     "cache_events": cache.events[0] if cache.layers else 0,
                     "output": tok.decode(g[:length], skip_special_tokens=True)})
    return rows


def batch_seed(seed: int, run: int, first_problem: int) -> int:
    """The eviction (and sampling) seed of one batch: differs per run and per batch."""
    return seeding.batch_seed(seed, run * 10_007 + first_problem)  # the core's (this function shadows its name)


def runs_for(arm: Arm, runs: int, temperature: float) -> int:
    """Runs an arm gets: under greedy decoding full attention and the seed-free policies would repeat themselves."""
    return 1 if temperature == 0 and (arm.policy == FULL or seed_free(arm.policy)) else runs


def graded_row(task, prob, arm: Arm, run: int, seed: int, out: dict, protocol: Optional[str] = None) -> dict:
    """The result row of one generation (``out``, from :func:`generate_batch`): keys, output, grade."""
    g = task.grade(out["output"], prob)
    return {"task": task.name, "problem": prob.id, "run": run, "policy": arm.policy, "budget": arm.budget,
            "protect_prompt": arm.protect, "compression": arm.compression, "seed": seed, **out,
            "compressed": out["events"] > 0, "grade": g.score, "extracted": g.extracted, **(g.endpoints or {}),
            "answer": prob.answer, **({"tests": g.details} if g.details is not None else {}), "protocol": protocol,
            "versions": versions()}


def versions() -> dict:
    """The package versions a row was measured with (informational: a resume does not compare them)."""
    import transformers

    return {"randattn": randattn.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def pending_batches(arms, problems, prompts, runs_of, done, batch, pack: bool = False) -> list[tuple]:
    """``(arm, run, [problem indices])`` still to do, batching problems of equal prompt length (``pack``: of any
    length, sorted by it so that neighbours need little padding)."""
    work = []
    for arm in arms:
        for run in range(runs_of(arm)):
            by_len = defaultdict(list)
            for i, prob in enumerate(problems):
                if (prob.id, run, arm.policy, arm.budget, arm.protect) not in done:
                    by_len[0 if pack else len(prompts[i])].append(i)
            for idx in by_len.values():
                if pack:
                    idx = sorted(idx, key=lambda i: (len(prompts[i]), i))
                work += [(arm, run, idx[b:b + batch]) for b in range(0, len(idx), batch)]
    return work


def row_key(problem_id, run: int) -> str:
    """A packed row's draw key: the same (problem, run) draws the same wherever it sits in any batch."""
    return f"{problem_id}/run{run}"


# -- reference log-prob (--reference-lp) -----------------------------------------------------------
REFERENCE_KEY = KEY
#: what the reference of a row is, recorded in its file's config
REFERENCE = "full attention's output text for the (problem, run), re-tokenized without special tokens"


def reference_ids(tok, text: str, limit: Optional[int] = None) -> list[int]:
    """The reference continuation's tokens: the stored output text re-tokenized without special tokens (so not
    always the very tokens full attention generated, and no end-of-sequence token), its first ``limit`` when given."""
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    return ids[:limit] if limit else ids


@torch.no_grad()
def reference_lp(model, prompt: list[int], reference: list[int], arm: Arm, *, seed: int, buffer: int, stats,
                 options: dict, row_key=None) -> dict:
    """Teacher-force ``prompt + reference`` through ``arm``'s cache (a fresh one, seeded as the arm's generation was:
    ``seed`` and, for a packed generation, its ``row_key``) with :func:`randattn.replay`, which runs the eviction
    rounds where token-by-token decoding has them; only the reference is scored (``score_from`` = the prompt's
    length). ``ref_lp``: the mean log-prob per reference token (None for an empty reference), ``ref_lp_sum`` their
    sum, ``ref_tokens`` how many, ``events`` the rounds that shaped a scored token, ``cache_events`` every round."""
    if not reference:
        return {"ref_tokens": 0, "ref_lp": None, "ref_lp_sum": 0.0, "events": 0, "cache_events": 0}
    ids = torch.tensor([list(prompt) + list(reference)], device=model.device)
    cache = make_cache(arm, prompt_len=len(prompt), max_new_tokens=len(reference), buffer=buffer, seed=seed,
                       stats=stats, options=options, row_keys=None if row_key is None else [row_key])
    res = randattn.replay(model, ids, cache, prompt_len=len(prompt), score_from=len(prompt))
    lps = res.logprobs[0, len(prompt):].double()
    total = float(lps.sum())
    return {"ref_tokens": len(reference), "ref_lp": total / len(reference), "ref_lp_sum": total,
            "events": rounds_before(cache, ids.shape[1]), "cache_events": cache.events[0] if cache.layers else 0}


def reference_units(config: Config, model_name: str, output: Output, task, problems, prompts, arms,
                    gen_rows: list[dict]) -> list[Unit]:
    """The reference log-prob units of ``arms`` (full attention's among them): one per generation batch (the same
    arm, run and problems, so the same seed and row keys), each replaying its (problem, run)s one at a time against
    full attention's output in ``gen_rows`` (the reference of run k: full attention's run k when sampling, else its
    one run 0)."""
    outputs = {(r["problem"], r["run"]): r["output"] for r in gen_rows if r["policy"] == FULL}
    gen = Generation.of(config)
    runs_of = lambda a: runs_for(a, config.runs, config.temperature)  # noqa: E731
    units = []
    for arm, run, idx in pending_batches(arms, problems, prompts, runs_of, set(), config.batch, config.pack):
        seed = batch_seed(config.seed, run, 0 if config.pack else idx[0])  # the generation batch's own (arm_units)
        ref_run = run if config.temperature > 0 else 0
        missing = [problems[i].id for i in idx if (problems[i].id, ref_run) not in outputs]
        if missing:
            raise ValueError(f"--reference-lp: no full-attention row of run {ref_run} for problem(s) "
                             f"{', '.join(map(str, missing))} in {output.path}'s generation file: the reference is "
                             "full attention's output")
        refs = [outputs[(problems[i].id, ref_run)] for i in idx]
        work = {"mode": "reference", "task": task.name, "problem_ids": [problems[i].id for i in idx],
                "prompts": [prompts[i] for i in idx], "references": refs, "reference_run": ref_run, "arm": arm,
                "run": run, "seed": seed, "gen": gen, "stats": config.stats, "protocol": config.protocol,
                "reference_tokens": config.reference_tokens,
                "row_keys": [row_key(problems[i].id, run) for i in idx] if config.pack else None}
        units.append(make_unit("accuracy", model_name, output,
                               {"policy": arm.policy, "budget": arm.budget, "protect_prompt": arm.protect},
                               [{"problem": problems[i].id, "run": run} for i in idx], work,
                               salt=[seed, stable_id(refs)],  # the reference text decides the rows too
                               label=f"reference log-prob: {arm.label} K={arm.budget} run {run}",
                               stage=f"accuracy: {task.name}, reference log-prob"))
    return units


def reference_rows(model, tok, w: dict) -> list[dict]:
    """The rows of one reference unit: each (problem, run) replayed alone."""
    arm, gen = w["arm"], w["gen"]
    rows = []
    for k, (pid, prompt, text) in enumerate(zip(w["problem_ids"], w["prompts"], w["references"])):
        ref = reference_ids(tok, text, w["reference_tokens"])
        try:
            lp = reference_lp(model, prompt, ref, arm, seed=w["seed"], buffer=gen.buffer, stats=w["stats"],
                              options=gen.options, row_key=w["row_keys"][k] if w["row_keys"] else None)
        except ValueError as exc:  # a policy's own pinned window plus the protected prompt exceed K, bad stats, ...
            raise ConfigError("policy", f"{arm.policy} (T={arm.budget}, protect_prompt={arm.protect}): {exc}") \
                from None
        rows.append({"task": w["task"], "problem": pid, "run": w["run"], "policy": arm.policy, "budget": arm.budget,
                     "protect_prompt": arm.protect, "compression": arm.compression, "seed": w["seed"],
                     "reference_run": w["reference_run"], "prompt_len": len(prompt), **lp,
                     "compressed": lp["events"] > 0, "protocol": w["protocol"], "versions": versions()})
    return rows


# -- compression sweep ----------------------------------------------------------------------------
def sweep_budgets(rows: list[dict], factors: list[float]) -> tuple[float, dict[float, int]]:
    """Mean full-attention generation length over ``rows`` and ``{c: K = round(mean / c)}``."""
    lengths = [r["gen_len"] for r in rows if r["policy"] == FULL]
    if not lengths:
        raise ValueError("no full-attention rows to measure the generation length on")
    mean = float(np.mean(lengths))
    return mean, {c: max(1, int(round(mean / c))) for c in factors}


# -- summary ----------------------------------------------------------------------------------------
def print_summary(table: list[dict], gains: list[dict], protocol: Optional[str] = None) -> None:
    if protocol:
        print(f"\nprotocol {protocol}: " + {
            "protected": "every policy with the prompt protected",
            "score-only": "every policy score only (the prompt competes)",
            "matched": "every policy score only and protected (the paper's Table 2)",
            "grid": "each baseline in its native mode against protected Random (the paper's main grid)"}[protocol])
    print(f"\n{'method':<28} {'K':>5} {'n':>4} {'accuracy [95% CI]':<22} {'vs random [95% CI]':<24} {'p_boot':>6} "
          f"{'sign W/L/T':>10} {'p_sign':>6} {'verdict':<17} {'len':>6} {'len vs random [95% CI]':<26} {'EOS':>5} "
          f"{'rounds':>6}")
    for t in table:
        cmp = (f"{t['delta']:+.3f} [{t['delta_lo']:+.3f}, {t['delta_hi']:+.3f}]", f"{t['p_bootstrap']:.3f}",
               f"{t['wins']}/{t['losses']}/{t['ties']}", f"{t['p_sign']:.3f}", t["verdict"]) if "delta" in t \
            else ("(reference)" if t["policy"] == "random" else "", "", "", "", "")
        length = (f"{t['len_delta']:+.1f} [{t['len_delta_lo']:+.1f}, {t['len_delta_hi']:+.1f}]" if "len_delta" in t
                  else "")
        print(f"{t['method']:<28} {t['budget'] or '-':>5} {t['problems']:>4} {t['accuracy']:.3f} [{t['accuracy_lo']:.3f}, "
              f"{t['accuracy_hi']:.3f}]   {cmp[0]:<24} {cmp[1]:>6} {cmp[2]:>10} {cmp[3]:>6} {cmp[4]:<17} "
              f"{t['gen_len']:>6.1f} {length:<26} {t['terminated']:>5.2f} {t['events']:>6.1f}")
    for g in gains:
        print(f"prompt protection gain, {g['policy']} K={g['budget']}: {g['gain']:+.3f} [{g['gain_lo']:+.3f}, "
              f"{g['gain_hi']:+.3f}], p_boot {g['p_bootstrap']:.3f}, p_sign {g['p_sign']:.3f}: {g['verdict']}")
    print("paper (Qwen3/Phi-4, 5 tasks): Random wins 31 of 60 comparisons significantly, loses 1; Table 2 (MATH500, "
          "Qwen3-4B) score only -> protected: snapkv .703->.829, rkv .810->.812, vase .809->.812, random .459->.874")


#: per-row endpoints the summary compares with Random besides the grade: (field, what it measures, format)
ENDPOINTS = (("copies", "repeat: copies written, of 64 (generation behaviour: when the model stopped)", ".1f"),
             ("fidelity", "repeat: fidelity of the copies written (content kept; runs without a copy left out)",
              ".3f"),
             ("ref_lp", "reference log-prob: mean per token of full attention's output, teacher-forced through "
                        "each arm's cache (nats; content kept, continuous)", ".3f"))


def print_endpoints(rows: list[dict], reference_rows: list[dict] = (), *, seed: int = 0) -> None:
    """The endpoints beside the grade where the rows have them (:data:`ENDPOINTS`): per arm its mean over problems
    with a 95% CI and the paired, problem-clustered comparison with Random (runs as repeated measures)."""
    for field, what, fmt in ENDPOINTS:
        source = reference_rows if field == "ref_lp" else rows
        table = endpoint_summary(list(source), field, seed=seed) if any(field in r for r in source) else []
        if not table:
            continue
        print(f"\n{what}")
        print(f"{'method':<28} {'K':>5} {'n':>4} {'mean [95% CI]':<26} {'vs random [95% CI]':<28} {'p_boot':>6} "
              f"{'sign W/L/T':>10} {'p_sign':>6} {'verdict':<17}")
        for t in table:
            cmp = (f"{t['delta']:+{fmt}} [{t['delta_lo']:+{fmt}}, {t['delta_hi']:+{fmt}}]", f"{t['p_bootstrap']:.3f}",
                   f"{t['wins']}/{t['losses']}/{t['ties']}", f"{t['p_sign']:.3f}", t["verdict"]) if "delta" in t \
                else ("(reference)" if t["policy"] == "random" else "", "", "", "", "")
            est = f"{t['value']:{fmt}} [{t['value_lo']:{fmt}}, {t['value_hi']:{fmt}}]"
            print(f"{t['method']:<28} {t['budget'] or '-':>5} {t['problems']:>4} {est:<26} {cmp[0]:<28} {cmp[1]:>6} "
                  f"{cmp[2]:>10} {cmp[3]:>6} {cmp[4]:<17}")


def write_outputs(out: Path, rows: list[dict], table: list[dict], gains: list[dict], task: str) -> dict:
    """Summary CSV and the comparison table (CSV, LaTeX, Markdown) beside the rows; returns the paths."""
    paths = {"summary": write_csv(out.with_suffix(".summary.csv"), table)}
    if gains:
        paths["protection"] = write_csv(out.with_suffix(".protection.csv"), gains)
    results = table_results(rows, task)
    if any(m == "random" for m, _ in results):
        for fmt, ext in (("csv", ".table.csv"), ("latex", ".table.tex"), ("markdown", ".table.md")):
            path = out.with_suffix(ext)
            write_text(path, comparison_table(results, reference="random", fmt=fmt))  # atomic, only over ours
            paths[fmt] = path
    return paths


def protocol_arms(protocol: str, policies: list[str], budgets, compression: Optional[dict] = None) -> list[Arm]:
    """The arms a protocol runs at each budget (``compression``: ``{K: c}`` of a sweep)."""
    def modes(pol):
        native = native_protection(pol)
        if native is not None:  # random-pcap, random-pmix, random-ppp are defined with one mode
            return [native]
        if protocol == "protected":
            return [True]
        if protocol == "score-only":
            return [False]
        if protocol == "matched":
            return [True, False]
        grid = grid_protection(pol)  # each policy's own attribute (Policy.paper_protection); never a default
        if grid is None:
            raise ConfigError("protocol", _no_grid_mode(pol))
        return [grid]

    return [Arm(pol, k, protect, (compression or {}).get(k)) for k in budgets for pol in policies
            for protect in modes(pol)]


def _no_grid_mode(policy: str) -> str:
    return (f"--protocol grid runs each policy in the paper grid's mode, and {policy!r} declares none "
            f"(randattn.Policy.paper_protection); set paper_protection on it, or use --protocol protected, "
            f"score-only or matched")


def check_prompt_fits(arms: list[Arm], longest: int, buffer: int) -> None:
    """Each arm's spec by the core's rules (T must exceed the recent window r) and the one prompt-fits rule
    (:meth:`randattn.EvictionSpec.validate`: a protected prompt needs T >= its length + 1 + r); otherwise stop,
    naming the flag that set T."""
    for arm in arms:
        name = "compression" if arm.compression else "budget"
        what = f"{arm.compression:g} (T={arm.budget})" if arm.compression else f"T={arm.budget}"
        try:
            spec = randattn.EvictionSpec(arm.policy, arm.budget, buffer, protect_prompt=arm.protect)
        except SpecError as exc:
            if exc.field != "budget":
                raise ConfigError("policy", f"{arm.policy} (T={arm.budget}, protect_prompt={arm.protect}): {exc}") \
                    from None
            raise ConfigError(name, f"{what} must exceed the recent window r={buffer} (the newest r pairs are kept "
                                    f"untouched and T - r selected); use T > {buffer}, a smaller compression, or a "
                                    "smaller --buffer") from None
        problem = spec.validate(longest)
        if problem:
            raise ConfigError(name, problem.worded(budget_text=what, use="T",
                                                   fix="a smaller compression, or --no-protect-prompt"))


# -- main ---------------------------------------------------------------------------------------------
def default_name(model_name: str, task: str, config) -> str:
    return result_name("accuracy", config, model=model_name, task=task)


def repo_relative(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    p = Path(path).resolve()
    return str(p.relative_to(REPO_ROOT)) if p.is_relative_to(REPO_ROOT) else str(p)


def results_config(model_name: str, task: str, args, *, thinking: bool, stats) -> dict:
    """The configuration stored in every row of a result file (a resumed run must match it)."""
    return {"probe": "accuracy", "engine": randattn.ENGINE, "recent": args.buffer,
            "budget_accounting": "T = pairs per head right after a round, the newest r included",
            "model": model_name, "task": task, "buffer": args.buffer,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "seed": args.seed, "batch": args.batch, "thinking": thinking, "data": repo_relative(args.data),
            "stats": stats, "policy_options": args.options, **({"pack": True} if getattr(args, "pack", False) else {})}


def _task(name: str, unsafe: bool):
    """The task, its grader told whether code may run unsandboxed."""
    task = get_task(name)
    return replace(task, grade=partial(task.grade, unsafe=unsafe)) if task.kind == "code" else task


def _problems(config: Config) -> list:
    """The task's problems; a code task without its sandbox is refused first (before any model loads)."""
    task = get_task(config.task)
    if task.kind == "code":  # the programs run in a sandbox: refused before the model loads where it cannot
        why = None if config.unsafe_code_grading else code_sandbox_unavailable()
        if why:
            raise ConfigError("task", f"{task.name} runs the generated programs; {why}")
    try:
        return load_problems(task, config.data, config.problems or task.problems)
    except TaskDataError as exc:
        raise ConfigError("data", str(exc)) from None


def plan(config: Config, model: ModelInfo) -> Plan:
    """The accuracy run of ``config`` on ``model`` as units: one per batch of a fresh run (an arm, a run, problems of
    equal prompt length, ``--batch`` at most; ``--pack``: of any length), each seeded by :func:`batch_seed`. With
    ``--compression`` the policies' units are a second stage, planned from full attention's generation lengths. With
    ``--reference-lp`` a last stage, planned from full attention's outputs, replays the reference through every arm
    (:func:`reference_units`) into a second output."""
    problems = _problems(config)
    raw, config = config, config.resolved()
    if config.protocol == "grid" and raw.temperature is None:
        config = raw.resolved(model)  # the grid samples with the model card's settings
    task = get_task(config.task)
    bind_policies("policy", [p for p in config.policy if p != FULL], model.bind_target,
                  lambda pol: {**calibration_options(pol, config.stats), **config.options.get(pol, {})})
    # The statistics a calibrated policy uses: --stats, else the shipped file of the embedded model (recorded).
    stats = config.stats or model.embedded
    prompts = [problem_ids(model.tokenizer, prob) for prob in problems]
    longest = max(len(x) for x in prompts)
    record = results_config(model.name, task.name, config, thinking=has_thinking_mode(model.tokenizer), stats=stats)
    record.update(run_record(model.model))
    path = out_folder("accuracy", config.out) / default_name(model.name, task.name, config)
    output = Output(str(path), record, KEY, meta={"task": task.name, "seed": config.seed, "runs": config.runs,
                                                   "problems": [p.id for p in problems]})
    describe = (f"model {model.name} | task {task.name}: {len(problems)} problems, prompts "
                f"{min(map(len, prompts))}-{longest} tokens{', thinking mode' if record['thinking'] else ''} | "
                f"r={config.buffer}, max {config.max_new_tokens} new tokens, "
                f"{'greedy' if config.temperature == 0 else f'T={config.temperature}, top-p {config.top_p}'}, "
                f"{config.runs} runs | protocol {config.protocol}"
                + (f" | policy options {config.options}" if config.options else "")
                + (" | reference log-prob of full attention's outputs" + (f" (first {config.reference_tokens} tokens)"
                                                                          if config.reference_tokens else "")
                   if config.reference_lp else ""))
    policies = [x for x in config.policy if x != FULL]
    outputs = [output]
    reference = None
    if config.reference_lp:  # its own file beside the generation rows, declared now, filled by the last stage
        ref_record = {**record, "endpoint": "reference_lp", "reference": REFERENCE,
                      "reference_tokens": config.reference_tokens}
        reference = Output(str(path.with_name(result_name("accuracy", config, "reference_lp", model=model.name,
                                                          task=task.name))), ref_record, REFERENCE_KEY,
                           meta={**output.meta, "reference": True})
        outputs.append(reference)

    def units(arms):
        return arm_units(config, model.name, output, task, problems, prompts, arms)

    def replays(arms):
        """The stage after the generations: every arm's reference log-probs, full attention's (the ceiling) first."""
        if reference is None:
            return None
        return lambda rows: Plan("accuracy", config, outputs, reference_units(
            config, model.name, reference, task, problems, prompts, [Arm(FULL, None, None), *arms],
            rows[output.path]), meta=meta)

    needs_full = config.compression is not None or FULL in config.policy or config.reference_lp
    full = units([Arm(FULL, None, None)]) if needs_full else []
    meta = {"describe": describe, "problems": problems}
    if config.compression is None:
        arms = protocol_arms(config.protocol, policies, dict.fromkeys(config.budget or (task.budget,)))
        check_prompt_fits(arms, longest, config.buffer)
        return Plan("accuracy", config, outputs, full + units(arms), then=replays(arms), meta=meta)

    def swept(rows: dict) -> Plan:
        ids = {p.id for p in problems}
        mean_len, sweep = sweep_budgets([r for r in rows[output.path] if r["problem"] in ids], list(config.compression))
        print(f"full attention: mean generation length {mean_len:.1f} tokens -> "
              + ", ".join(f"{c:g}x: T={k}" for c, k in sweep.items()))
        firsts = {k: c for c, k in reversed(list(sweep.items()))}  # two factors rounding to one T run once
        arms = protocol_arms(config.protocol, policies, sorted(firsts, reverse=True), compression=firsts)
        check_prompt_fits(arms, longest, config.buffer)
        return Plan("accuracy", config, outputs, units(arms), then=replays(arms), meta=meta)

    return Plan("accuracy", config, outputs, full, then=swept, meta=meta)


def arm_units(config: Config, model_name: str, output: Output, task, problems, prompts, arms) -> list[Unit]:
    """The batches a fresh run generates for ``arms`` (``config`` resolved)."""
    gen = Generation.of(config)
    out = []
    runs_of = lambda a: runs_for(a, config.runs, config.temperature)  # noqa: E731
    for arm, run, idx in pending_batches(arms, problems, prompts, runs_of, set(), config.batch, config.pack):
        # Packed rows draw by their own key, so their seed must not name the batch's first problem either.
        seed = batch_seed(config.seed, run, 0 if config.pack else idx[0])
        work = {"task": task.name, "unsafe": config.unsafe_code_grading, "problems": [problems[i] for i in idx],
                "prompts": [prompts[i] for i in idx], "arm": arm, "run": run, "seed": seed, "gen": gen,
                "stats": config.stats, "protocol": config.protocol,
                "row_keys": [row_key(problems[i].id, run) for i in idx] if config.pack else None}
        out.append(make_unit("accuracy", model_name, output,
                             {"policy": arm.policy, "budget": arm.budget, "protect_prompt": arm.protect},
                             [{"problem": problems[i].id, "run": run} for i in idx], work, salt=seed,
                             label=f"{arm.label} K={arm.budget} run {run}", stage=f"accuracy: {task.name}"))
    return out


def run_unit(model, tok, unit: Unit):
    """Generate and grade one batch, or (a reference unit) replay full attention's outputs: yields its rows."""
    w = unit.work
    if w.get("mode") == "reference":
        yield reference_rows(model, tok, w)
        return
    arm = w["arm"]
    try:
        outs = generate_batch(model, tok, w["prompts"], arm, seed=w["seed"], args=w["gen"], stats=w["stats"],
                              row_keys=w["row_keys"])
    except ValueError as exc:  # a policy's own pinned window plus the protected prompt exceed K, bad stats, ...
        raise ConfigError("policy", f"{arm.policy} (T={arm.budget}, protect_prompt={arm.protect}): {exc}") from None
    task = _task(w["task"], w["unsafe"])
    yield [graded_row(task, prob, arm, w["run"], w["seed"], o, w["protocol"]) for prob, o in zip(w["problems"], outs)]


def _outputs(plan: Plan) -> tuple[Output, Optional[Output]]:
    """The plan's generation output and its reference log-prob output (None without ``--reference-lp``)."""
    gen = next(o for o in plan.outputs if not o.meta.get("reference"))
    return gen, next((o for o in plan.outputs if o.meta.get("reference")), None)


def merge(plan: Plan, rows: dict, figures: bool) -> list[Path]:
    """The files a single-machine run writes beside its rows (summary CSV, comparison tables, figure), from the rows
    of the plan's output; prints its summary. Returns the files."""
    o, ref = _outputs(plan)
    path, rows, ref_rows = Path(o.path), rows.get(o.path, []), rows.get(ref.path, []) if ref is not None else []
    table = summarize(rows, seed=o.meta["seed"])
    gains = protection_gains(rows, seed=o.meta["seed"])
    print(f"\n== {path}")
    print_summary(table, gains, o.config.get("protocol"))
    print_endpoints(rows, ref_rows, seed=o.meta["seed"])
    paths = [path, *write_outputs(path, rows, table, gains, o.meta["task"]).values()]
    if ref_rows:
        paths.append(Path(ref.path))
    warning = warn_uncompressed(table)
    if warning:
        print(warning)
    if figures:
        paths += cli.draw("accuracy", path, plan.config.figure_dir, "--name", path.stem, "--problems",
                          ",".join(o.meta["problems"]), "--runs", str(o.meta["runs"]))
    return paths


def check(config: Config) -> None:
    """What the command line refuses before the model loads (``Kind.check``): a bad task or data file, a code task
    without its sandbox, a bad ``--policy-option``."""
    _problems(config)
    config.resolved()


def describe_run(p: Plan) -> None:
    """The run's description, printed once the plan is made (``Kind.planned``)."""
    print(p.meta["describe"])


def this_run(p: Plan, rows: list[dict]) -> list[dict]:
    """The rows of this run's problems and runs (the file may hold more, from an earlier, larger run)."""
    ids = {prob.id for prob in p.meta["problems"]}
    return [r for r in rows if r["problem"] in ids and r["run"] < p.config.runs]


def run(config: Config, model=None, tokenizer=None) -> tuple[Config, ResultsFile, list[dict]]:
    """Generate and grade every pending (arm, run, problem) here (``units.run`` of this kind: the command line's
    steps without its tables); ``(resolved config, results file, this run's rows)``."""
    p, files = run_kind(KIND, config, model, tokenizer)
    rf = files[_outputs(p)[0].path]
    return p.config, rf, this_run(p, rf.rows)


def report(p: Plan, rows: dict, figures: bool) -> list[Path]:
    """The command line's tables (``Kind.report``): the summary of this run's rows (:func:`this_run`), the
    methods x budgets comparison with Random, the files beside the rows, the figure under its shipped name (a
    grid's :func:`merge` summarizes the whole file and names the figure after it)."""
    config = p.config
    o, ref = _outputs(p)
    path = Path(o.path)
    ref_rows = this_run(p, rows.get(ref.path, [])) if ref is not None else []
    rows = this_run(p, rows[o.path])
    table = summarize(rows, seed=config.seed)
    gains = protection_gains(rows, seed=config.seed)
    print_summary(table, gains, config.protocol)
    print_endpoints(rows, ref_rows, seed=config.seed)
    results = table_results(rows, config.task)
    if any(m == "random" for m, _ in results):
        print("\n" + comparison_table(results, reference="random", seed=config.seed)
              + "(accuracy, and in brackets the difference from random; * = significant by both the paired bootstrap "
                "CI and the exact sign test)")
    paths = write_outputs(path, rows, table, gains, config.task)
    warning = warn_uncompressed(table)
    if warning:
        print("\n" + warning)
    print(f"\nrows: {path}\n" + (f"reference log-prob rows: {ref.path}\n" if ref_rows else "")
          + "\n".join(f"{k}: {v}" for k, v in paths.items()))
    written = [path, *([Path(ref.path)] if ref_rows else []), *paths.values()]
    if figures:
        problems = ",".join(sorted({r["problem"] for r in rows}))
        # a shipped run's figure has the name `python -m figures` draws it under; any other run's is named after its
        # results so that runs of other tasks or budgets do not overwrite it
        name = FIGURE_NAMES.get(path.name, path.stem)
        written += cli.draw("accuracy", path, config.figure_dir, "--problems", problems, "--runs",
                            str(config.runs), "--name", name)
    return written


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return command(KIND, __doc__)(argv)


KIND = Kind("accuracy", Config, plan, run_unit, merge, check=check, planned=describe_run, report=report)

if __name__ == "__main__":
    sys.exit(main())
