"""What every benchmark shares: its configuration (read by the probes' one layered parser), the prompt, one timed
generation, KV byte accounting, result files."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import torch

import randattn
from randattn.rules import prompt_fits_problem
from probes.config import (DEFAULT, POSITIVE, ConfigError, EvictionConfig, build, eviction, option, parse_values,
                           parser_for)
from probes.policy_specs import bind_policies, calibration_options

# The checkout bench/ sits in (for `git rev-parse` and the default trace / result paths); with a
# non-editable install it is site-packages, where there is no git and no data/ (see README).
REPO_ROOT = Path(__file__).resolve().parents[1]

PROMPT = "Solve step by step: a train travels 180 km in 2.5 hours, then 120 km in 1.5 hours. What is its average speed?"


def result_file(text: str) -> str:
    """An argparse type for a JSON result file a command (re)writes whole: refused when it is a folder, lies under a
    file, or is a file randattn did not write (a JSON object with ``rows``), so no user file is ever overwritten.
    (Moved here from ``probes.common``, which dropped it: the benchmarks are its only users.)"""
    import json

    path = Path(text)
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise argparse.ArgumentTypeError(f"{parent} is a file, so {text} cannot be created; give a path in a folder")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give the JSON file to write, e.g. {path / 'result.json'}")
    if path.exists():
        try:
            ours = isinstance(obj := json.loads(path.read_text()), dict) and "rows" in obj
        except (ValueError, UnicodeDecodeError, OSError):
            ours = False
        if not ours:
            raise argparse.ArgumentTypeError(f"{text} exists and is not a result file randattn wrote; nothing was "
                                             "changed. Give a new file name")
    return text


def _result_file(value) -> Optional[str]:
    """The check of a benchmark's ``--out`` (:func:`result_file`): a JSON result file the command (re)writes whole;
    None when it may."""
    try:
        result_file(value)
    except argparse.ArgumentTypeError as exc:
        return str(exc)
    return None


def hidden(default):
    """A probe setting that means nothing to a benchmark: kept off its command line and its ``--config`` file."""
    return option(default, "not a benchmark setting", cli=False)


def result_path(default: Optional[str] = None, where: str = "under data/results/bench/"):
    """A benchmark's ``--out``: the JSON result file it (re)writes whole, refused when randattn did not write it."""
    where = "" if default else f"; default: {where}"
    return option(default, f"the result file (JSON{where}); an existing file is only replaced when randattn wrote it",
                  check=_result_file, metavar="FILE")


@dataclass
class BenchBase(EvictionConfig):
    """A benchmark's config: a probe's, less the probe run settings a benchmark has no use for (``--restart``,
    figures), hidden from its command line and TOML files."""

    restart: bool = hidden(False)
    no_figure: bool = hidden(True)
    figure_dir: Optional[str] = hidden(None)


@dataclass
@eviction(budget=1024, buffer=DEFAULT)  # r: the spec's (64)
class BenchConfig(BenchBase):
    """The settings every generation benchmark takes: the probes' run flags (``--model``, ``--device``, ``--seed``),
    the eviction settings from their one definition (:data:`probes.config.SETTINGS`; defaults: the paper's geometry,
    T=1,024, r=64), the generation length, torch's threads and the result file. A benchmark's ``Config`` adds its
    own fields and names its policies (and ``--stats``) with ``@eviction``, as a probe's does; :func:`parse` reads
    it from the command line: defaults, then ``--config FILE.toml``, then the flags."""

    out: Optional[str] = result_path()
    new_tokens: int = option(4096, "tokens generated per sequence", check=POSITIVE)
    threads: Optional[int] = option(None, "torch CPU threads (default: torch's choice)", check=POSITIVE)


def parse(cls, argv=None, doc: str = ""):
    """``(parser, config)``: ``argv`` read into the benchmark's ``cls`` by the probes' one layered parser
    (:func:`probes.config.parse_values`: the fields' defaults, then a ``--config`` TOML file, then the flags, which
    win); a bad value is a usage error naming its flag. The parser stays for the refusals that need the model."""
    parser = parser_for(cls, (doc or cls.__doc__ or "").strip().splitlines()[0])
    return parser, build(cls, parser, parse_values(cls, parser, argv))


def policy_options(p: argparse.ArgumentParser, args, policies, model=None) -> dict:
    """``{policy: options}``: ``--stats`` for a policy that takes calibration data (TriAttention), else nothing; with
    ``model``, every policy is bound to it first, so one that cannot serve it stops here with the fix."""
    stats = getattr(args, "stats", None)
    opts = {name: calibration_options(name, stats) for name in policies if name not in (None, "full", WINDOW)}
    if model is not None:
        try:
            bind_policies("policies", list(opts), model, opts.get)
        except ConfigError as exc:
            p.error(f"--policies: {exc.message}")
    return opts


def load(p: "argparse.ArgumentParser | None", args):
    """The model and tokenizer of ``--model`` on ``--device``; a missing model or device is a usage error naming
    the flag (with ``p``), not a traceback."""
    try:
        return randattn.load_model(args.model, device=args.device)
    except (FileNotFoundError, OSError, ValueError, RuntimeError) as exc:
        if p is None:
            raise
        p.error(f"{'--device' if 'device' in str(exc).lower() else '--model'}: {exc}")


def setup(args, p: "argparse.ArgumentParser | None" = None):
    """Threads, then the model and the chat-templated benchmark prompt ``[1, P]`` on the model's device."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load(p, args)
    msgs = [{"role": "user", "content": PROMPT}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    prompt = prompt.to(model.device)
    warm_up(model, prompt)
    return model, tok, prompt


def warm_up(model, prompt) -> None:
    """A few untimed steps first, so one-off costs (allocator, kernel selection) land in no arm's timing."""
    from transformers import DynamicCache

    warm = randattn.EvictionSpec("random", prompt.shape[1] + 1, 2, protect_prompt=False)  # rounds run: warmed too
    randattn.generate(model, prompt, warm.make_cache(), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                   **{randattn.cache_argument_name(model): DynamicCache()})


def prepare(cls, argv, doc: str = ""):
    """What every generation benchmark does first: parse ``argv`` into ``cls`` (:func:`parse`; its policies and
    statistics are checked there, before anything loads), load the model and prompt, bind every policy to the
    model, check that rounds will run. Returns ``(parser, args, options, model, prompt)``."""
    p, args = parse(cls, argv, doc)
    model, _, prompt = setup(args, p)
    options = policy_options(p, args, args.policies, model)
    check_rounds_run(p, args, prompt.shape[1])
    return p, args, options, model, prompt


def check_rounds_run(p: argparse.ArgumentParser, args, prompt_len: int) -> None:
    """The protected prompt fits (the one prompt-fits rule, :func:`randattn.rules.prompt_fits_problem`) and the
    generation reaches T + r, so that rounds run; else a usage error naming ``--budget``."""
    problem = prompt_fits_problem(prompt_len, budget=args.budget, recent=args.buffer, protect=True)
    if problem:
        p.error(problem.worded(budget_text=f"--budget {args.budget}", use="--budget", fix=None))
    total = prompt_len + args.new_tokens
    if total < args.budget + args.buffer:
        p.error(f"{total} tokens never reach T + r = {args.budget + args.buffer}: no eviction would run; "
                "raise --new-tokens or lower --budget")


# -- KV memory --------------------------------------------------------------------------------------
def kv_bytes_per_position(model) -> int:
    """Key + value bytes one token adds to one sequence's cache over all layers (from the model's shape)."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * torch.finfo(model.dtype).bits // 8


def kv_bytes(cache) -> int:
    """K and V bytes a cache holds: the evicting cache's own count (room for K + r), or HF DynamicCache's tensors."""
    if isinstance(cache, randattn.EvictingCache):
        return cache.kv_bytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


class _PeakKV:
    """A stopping criterion that never stops: it reads the cache's KV bytes after every step."""

    def __init__(self, cache):
        self.cache, self.peak = cache, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.peak = max(self.peak, kv_bytes(self.cache))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


# -- one timed generation ---------------------------------------------------------------------------
WINDOW = "window"  # the arm name of transformers' own sliding-window cache: the floor an evicting cache approaches


def sliding_window_cache(model, pairs: int):
    """transformers' ``DynamicSlidingWindowLayer`` in every layer, holding the last ``pairs`` tokens: what an evicting
    cache of T + r pairs costs with no scoring and no gather (the cost floor of any cache of that size)."""
    from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

    return Cache(layers=[DynamicSlidingWindowLayer(pairs) for _ in range(model.config.num_hidden_layers)])


def run_one(model, ids, *, policy, budget, buffer, new_tokens, seed=0, options=None, track_peak=False) -> dict:
    """Generate ``new_tokens`` for every row of ``ids`` (greedy, EOS ignored) and measure it.

    ``policy=None``: HF DynamicCache (full attention); ``policy="window"``: HF's sliding-window layers of
    ``budget + buffer`` pairs. ``track_peak`` reads the KV bytes after every step (``kv_bytes_peak``); it stays off
    for throughput runs so that nothing but decoding is timed.
    """
    from transformers import DynamicCache, StoppingCriteriaList

    if policy is None:
        cache = DynamicCache()
    elif policy == WINDOW:
        cache = sliding_window_cache(model, budget + buffer)
    else:
        cache = randattn.EvictionSpec(policy, budget, buffer, seed=seed, options=options or {}).make_cache().bind(model)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    peak = _PeakKV(cache) if track_peak else None
    if peak is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([peak])
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if policy is None or policy == WINDOW:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **{randattn.cache_argument_name(model): cache},
                             **kwargs)
    else:
        out = randattn.generate(model, ids, cache, **kwargs)
    if ids.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    row = {
        "policy": policy or "full",
        "batch": ids.shape[0],
        "prompt_tokens": ids.shape[1],
        "new_tokens": out.shape[1] - ids.shape[1],
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "kv_bytes_end": kv_bytes(cache),
    }
    if peak is not None:
        row["kv_bytes_peak"] = peak.peak
    if policy == WINDOW:
        row.update(budget=budget, buffer=buffer, window=budget + buffer)
    elif policy is not None:
        row.update(
            budget=budget,
            buffer=buffer,
            rounds_per_layer=cache.events[0],
            rounds_all_layers_equal=len(set(cache.events)) == 1,
            round_seconds=cache.round_seconds,
            round_share=cache.round_seconds / seconds,
            ms_per_round=1e3 * cache.round_seconds / max(1, cache.total_events),
            pairs_per_head_end=cache.physical_length(0),
        )
    return row


def run_arms(model, ids, arms, args, options: dict, *, repeats: int = 1, **kwargs) -> list:
    """``run_one`` for every arm (``None``: full attention) on the same ids with the flags' K, r, length
    and seed; with ``repeats`` the arms run that many times, the order reversed every other time so no arm
    always goes first (machine noise then shows as each arm's spread); each row is printed as it finishes."""
    rows = []
    for repeat in range(repeats):
        for policy in (arms if repeat % 2 == 0 else list(reversed(arms))):
            row = run_one(model, ids, policy=policy, budget=args.budget, buffer=args.buffer,
                          new_tokens=args.new_tokens, seed=args.seed, options=options.get(policy), **kwargs)
            rows.append({**row, "repeat": repeat})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def medians(rows: list, key: str = "tokens_per_s") -> dict:
    """``{(batch, policy): (median, min, max)}`` of ``key`` over the repeats."""
    import statistics

    out: dict = {}
    for r in rows:
        out.setdefault((r["batch"], r["policy"]), []).append(r[key])
    return {k: (statistics.median(v), min(v), max(v)) for k, v in out.items()}


# -- results ----------------------------------------------------------------------------------------
def provenance() -> dict:
    """The engine, git revision and UTC date a result was measured on (the docs' tables print them)."""
    return {
        "engine": randattn.ENGINE,
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=REPO_ROOT).stdout.strip(),
        "date": datetime.now(timezone.utc).date().isoformat(),
    }


def meta(args, model, **extra) -> dict:
    """Where and how a result was measured; every benchmark's JSON starts with it."""
    return {
        "model": args.model or randattn.DEFAULT_MODEL,
        "device": str(model.device),
        "dtype": str(model.dtype),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        **provenance(),
        **extra,
    }


def write_results(path, meta_: dict, rows: list) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta_, "rows": rows}, indent=1))
    return path
