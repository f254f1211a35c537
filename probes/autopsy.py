"""Eviction autopsy: find the eviction that changed the answer, and prove it by fork replay.

    python -m probes.autopsy                                  # embedded SmolLM2-135M, copy task, Random, 8 problems
    python -m probes.autopsy --task recall --policy random snapkv --problems 8
    python -m probes.autopsy --prompt "Repeat: 4821 7730 1295" --policy snapkv --protection score-only

Per problem and policy: generate greedily with full attention and with the evicting cache (the paper's engine:
T pairs per head after a round, the newest r never compete), grade both with the task's grader, and find the
first generated token where they differ (the divergence, at absolute position P). Then, from the keep-log of
the evicted run, which (position, layer, KV head) pairs were gone when the token at P was predicted, and for
any span the probability it was still held by at least one head of a layer (Random's analytic ``q**n`` model and
the keep-log's measurement).

**Sufficiency** (the fork replay): the evicted run is replayed with candidate spans pinned in every head
(``EvictingCache.pin``) at the same budget: a pinned pair takes the place of one the policy would have kept, the
budget does not grow. A span restores the answer when greedy decoding from P reproduces the next ``--horizon``
full-attention tokens (teacher forcing gives their log-probs too). The search tests windows of evicted
positions (each short enough to pin beside the protected prompt), bisects the restoring window, trims its
edges, then halves the layers and the KV heads the pin needs, at most ``--max-replays`` replays; the span found
is then confirmed by greedy re-generation to the end of the answer and graded.

**Fork point.** A pin acts at the rounds after it is registered, so a replay must start before the first round
that evicted any position of its span. Every replay forks one shared prefix (the evicted run teacher-forced up to
P, snapshotted after every forward): the latest snapshot before the earliest round (any layer, any head) that
evicted a position of the span. Up to that point a pinned and an unpinned run are the same run (pinning a
position every head keeps anyway changes no top-k), so the fork is exact.

**Necessity** (the reverse direction, on the full-attention run): spans force-evicted from every head and layer,
at the first moment the engine could have evicted them (when their newest token leaves the recent window; right
after the prefill for prompt spans), bisected over time for the smallest span whose loss changes the
continuation.

Rows (one per problem, resumable) go to ``--out`` (default ``data/results/autopsy/``), one file per task and
policy; the summary CSV counts where the causal spans lie (prompt / recent: within ``--window`` tokens of the
divergence / middle of the trace); the figure maps position x (layer, head) held vs evicted with the spans found.
"""

from __future__ import annotations

import bisect
import functools
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from analysis.autopsy import held_map, location, pack_mask, span_survival, summarize, windows
from analysis.names import result_name

from . import cli
from .config import NONNEGATIVE, POSITIVE, SETTINGS, ConfigError, EvictionConfig, eviction, option, setting
from .planted_run import write_csv
from .policy_specs import native_protection
from .results import DEFAULT_TRACES, ResultsFile, out_folder, protection_tag, run_record, trace_label
from .tasks import COPY_N, copy_problem, grade_copy, problem_ids, chat_ids
from .units import Kind, ModelInfo, Output, Plan, Unit, command, make_unit

TASK_NAMES = ("copy", "recall")
PROTECTIONS = ("native", "protected", "score-only")
DEFAULTS = {"copy": (256, 16), "recall": (256, 16), "prompt": (256, 16)}  # task -> (T, r)
KEY = ("problem",)


# -- problems ---------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One problem: ``prefix`` is fed (teacher-forced) before the model generates; ``prompt_len`` of it is the
    prompt (what protection pins); ``grade(text)`` scores a generation (None: no grader)."""

    id: str
    prefix: list
    prompt_len: int
    max_new: int
    grade: Optional[Callable[[str], float]]
    reference: str = ""


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def grade_recall(reference: str) -> Callable[[str], float]:
    """The restated question's numbers, in order: the fraction reproduced at their place (its words when it has
    no numbers)."""
    ref = _NUMBER.findall(reference)
    if not ref:
        words = reference.split()
        return lambda text: sum(a == b for a, b in zip(text.split(), words)) / max(len(words), 1)
    return lambda text: sum(a == b for a, b in zip(_NUMBER.findall(text), ref)) / len(ref)


def copy_cases(tok, indices, max_new: Optional[int]) -> list[Case]:
    out = []
    for i in indices:
        p = copy_problem(i)
        out.append(Case(p.id, problem_ids(tok, p), len(problem_ids(tok, p)), max_new or 6 * COPY_N + 24,
                        lambda text, p=p: grade_copy(text, p).score, p.answer))
    return out


def recall_cases(tok, indices, *, body: int, seed: int, traces: Path, max_new: Optional[int]) -> list[Case]:
    """The question-recall task of :mod:`probes.prompt_protection`: a question, ``body`` tokens of reasoning
    (teacher-forced), ``Let me restate the question:``; the model writes the question again."""
    from .prompt_protection import Tasks, load_rows

    tasks = Tasks(tok, load_rows(traces), body=body, seed=seed)
    if max(indices) >= len(tasks):
        raise ConfigError("index", f"the recall task has {len(tasks)} problems; use indices < {len(tasks)}")
    out = []
    for k in indices:
        ids, start = tasks.build(k)
        ref = tok.decode(ids[start:])
        out.append(Case(f"recall-{k}", ids[:start], tasks.prompt_len_of(k), max_new or len(ids) - start, grade_recall(ref),
                        ref))
    return out


def prompt_case(tok, prompt: str, max_new: Optional[int]) -> Case:
    ids = chat_ids(tok, prompt)
    return Case("prompt", ids, len(ids), max_new or 128, None, "")


# -- decoding ---------------------------------------------------------------------------------------------------
def full_cache(length: int, keep_log: bool = False) -> randattn.EvictingCache:
    """Full attention through the same code path: a budget no round reaches."""
    return randattn.EvictionSpec.full().make_cache(max_tokens=length, keep_log=keep_log)


@torch.no_grad()
def continue_greedy(model, cache, last_logits: torch.Tensor, max_new: int, stop: set) -> list[int]:
    """Greedy decoding from ``last_logits`` (predicting the next token) with ``cache``; the stop token is kept."""
    out, logits = [], last_logits
    for i in range(max_new):
        t = int(logits[0].argmax())
        out.append(t)
        if t in stop or i == max_new - 1:
            break
        logits = randattn.decode_step(model, torch.tensor([[t]], device=model.device), cache, logits_to_keep=1)[:, -1]
    return out


def greedy(model, prefix: list, prompt_len: int, cache, max_new: int, stop: set) -> list[int]:
    """Feed ``prefix`` (the prompt prefilled, the rest teacher-forced with the rounds where decoding has them),
    then decode greedily."""
    ids = torch.tensor([prefix], device=model.device)
    rep = randattn.Replay(model, ids, cache, prompt_len=prompt_len, score_from=len(prefix)).run()
    return continue_greedy(model, cache, rep.result().last_logits.to(model.device), max_new, stop)


class Pool:
    """One shared prefix: ``ids`` replayed once through ``cache`` up to ``until``, snapshotted after every forward
    (forwards end at every round and at least every ``step`` tokens); :meth:`fork` continues from the latest
    snapshot at or before a position."""

    def __init__(self, model, ids: torch.Tensor, cache, *, prompt_len: int, until: int, score_from: int, step: int):
        base = randattn.Replay(model, ids, cache, prompt_len=prompt_len, score_from=score_from)
        self.snaps = [(base.pos, base.fork())]
        limit = cache.budget + cache.buffer
        while base.pos < until:
            n = max(limit - cache.physical_length(0), 1)
            base.run(until=min(base.pos + n, base.pos + step, until))
            self.snaps.append((base.pos, base.fork()))
        self.base = base
        self._pos = [p for p, _ in self.snaps]

    def fork(self, at_most: int) -> randattn.Replay:
        i = bisect.bisect_right(self._pos, at_most) - 1
        if i < 0:
            raise ValueError(f"no snapshot at or before position {at_most} (the prompt ends at {self._pos[0]})")
        return self.snaps[i][1].fork()


def evict_now(cache, positions) -> None:
    """Drop ``positions`` from every layer and KV head of ``cache`` at once (a full-attention cache, where every
    head holds the same positions)."""
    drop_pos = torch.as_tensor(np.asarray(positions, dtype=np.int64))
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        pos = layer.positions
        keep = ~torch.isin(pos, drop_pos.to(pos.device))
        if not bool((keep == keep[:1, :1]).all()):
            raise ValueError("evict_now needs every head to hold the same positions (a full-attention cache)")
        idx = torch.nonzero(keep[0, 0]).flatten()
        layer.keep_slots(idx.expand(pos.shape[0], pos.shape[1], -1).contiguous())


# -- the autopsy of one problem ---------------------------------------------------------------------------------
class _OutOfReplays(Exception):
    pass


class Autopsy:
    """Both runs of one problem under one policy, the keep-log at the divergence, and the two searches."""

    def __init__(self, model, tok, case: Case, *, policy: str, budget: int, buffer: int, protect: bool, seed: int,
                 options: Optional[dict] = None, horizon: int = 16, max_replays: int = 16, window: int = 64,
                 necessity: bool = True, stop: Optional[set] = None, full: Optional[list] = None):
        self.model, self.tok, self.case = model, tok, case
        self.policy, self.budget, self.buffer, self.protect, self.seed = policy, budget, buffer, protect, seed
        self.options = options or {}
        self.horizon, self.max_replays, self.window, self.necessity = horizon, max_replays, window, necessity
        self.stop = stop if stop is not None else _eos(model, tok)
        self.full = full
        cfg = model.config.get_text_config(decoder=True)
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_key_value_heads or cfg.num_attention_heads

    @functools.cached_property
    def spec(self) -> randattn.EvictionSpec:
        """The eviction setting of the evicting run (its policy resolved once, at the first cache)."""
        return randattn.EvictionSpec(self.policy, self.budget, self.buffer, protect_prompt=self.protect,
                                     seed=self.seed, options=self.options)

    def make_cache(self, keep_log: bool = False) -> randattn.EvictingCache:
        return self.spec.make_cache(keep_log=keep_log)

    def full_generation(self) -> list[int]:
        c = self.case
        if self.full is None:
            self.full = greedy(self.model, c.prefix, c.prompt_len, full_cache(len(c.prefix) + c.max_new), c.max_new,
                               self.stop)
        return self.full

    def _text(self, gen) -> str:
        return self.tok.decode([t for t in gen if t not in self.stop])

    def _grade(self, gen) -> Optional[float]:
        return None if self.case.grade is None else float(self.case.grade(self._text(gen)))

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        t0 = time.perf_counter()
        c = self.case
        full = self.full_generation()
        evict_cache = self.make_cache(keep_log=True)
        ev = greedy(self.model, c.prefix, c.prompt_len, evict_cache, c.max_new, self.stop)
        row = {"problem": c.id, "policy": self.policy, "protect_prompt": self.protect, "prompt_len": c.prompt_len,
               "prefix_len": len(c.prefix), "full_text": self._text(full), "evict_text": self._text(ev),
               "full_grade": self._grade(full), "evict_grade": self._grade(ev), "full_tokens": len(full),
               "evict_tokens": len(ev), "rounds": evict_cache.events[0] if evict_cache.layers else 0,
               "kv_heads": self.n_heads, "layers": self.n_layers}
        g = next((i for i, (a, b) in enumerate(zip(full, ev)) if a != b), None)
        if g is None and len(full) != len(ev):
            g = min(len(full), len(ev))
        if g is None or g >= len(full):
            row.update(status="no divergence", divergence=None, replays=0, spans=[], necessary=[],
                       seconds=round(time.perf_counter() - t0, 1))
            return row
        self.g = g
        self.P = P = len(c.prefix) + g
        self.X = torch.tensor([c.prefix + full], device=self.model.device)
        self.until = P + min(self.horizon, len(full) - g)
        self.target = self.X[0, P:self.until].cpu()
        row.update(divergence=g, divergence_pos=P, full_token=self.tok.decode([full[g]]),
                   evict_token=self.tok.decode([ev[g]]), context=self.tok.decode(full[max(0, g - 12):g]))

        # The shared prefix of every sufficiency replay: the evicted run teacher-forced up to the divergence.
        self.pool = Pool(self.model, self.X, self.make_cache(keep_log=True), prompt_len=c.prompt_len, until=P,
                         score_from=P, step=self.buffer)
        self.hm = held_map(self.pool.base.cache.keep_log, P, self.n_layers, self.n_heads)
        base = self._finish(self.pool.base.fork())
        row.update(replay_parity=bool(int(base["argmax0"]) == ev[g]), lp_evicted=base["lp"],
                   match_evicted=base["match"])
        candidates = self.hm.evicted_anywhere
        row.update(candidates=int(candidates.size), rounds_before=int(self.hm.round_lens.size),
                   held=[[pack_mask(self.hm.held[l, h]) for h in range(self.n_heads)] for l in range(self.n_layers)])
        if self.necessity:
            self.full_pool = Pool(self.model, self.X, full_cache(self.X.shape[1]), prompt_len=c.prompt_len,
                                  until=P - 1, score_from=P, step=self.buffer)
            ref = self._finish(self.full_pool.base.fork())
            row.update(lp_full=ref["lp"], match_full=ref["match"])
        self.trials: dict = {}
        self.used = 0
        spans, layers, heads, exhausted = self.sufficiency(candidates)
        row.update(spans=spans, pin_layers=layers, pin_heads=heads, replays=self.used, replays_exhausted=exhausted)
        if spans:
            sp = spans[0]
            res = self.trials[("pin", sp["start"], sp["end"], None, None)]
            row["lp_restored"], row["match_restored"] = res["lp"], res["match"]
            regen = self.regenerate(sp["start"], sp["end"])
            row.update(status="restored", regen_text=self._text(full[:g] + regen), regen_grade=self._grade(full[:g] + regen),
                       regen_matches_full=full[:g] + regen == full)
        else:
            row["status"] = "not restored"
        if self.necessity:
            self.used_nec = 0
            nec, nec_exhausted = self.necessity_search()
            row.update(necessary=nec, necessity_replays=self.used_nec, necessity_exhausted=nec_exhausted)
        else:
            row["necessary"] = []
        row["seconds"] = round(time.perf_counter() - t0, 1)
        return row

    def _finish(self, branch: randattn.Replay) -> dict:
        branch.run(until=self.until)
        res = branch.result()
        am = res.argmax[0, self.P:self.until]
        return {"restored": bool(torch.equal(am, self.target)), "lp": round(float(res.logprobs[0, self.P:self.until].sum()), 4),
                "match": round(float((am == self.target).float().mean()), 4), "argmax0": int(am[0])}

    # -- sufficiency: pins on the evicted run -------------------------------------------------------------------
    def fork_point(self, start: int, end: int) -> int:
        first = self.hm.first_round[start:end]
        first = first[first >= 0]
        return int(first.min()) - 1 if first.size else self.P

    def pinned(self, start: int, end: int, layers=None, heads=None) -> Optional[dict]:
        key = ("pin", start, end, None if layers is None else tuple(layers), None if heads is None else tuple(heads))
        if key not in self.trials:
            if self.used >= self.max_replays:
                raise _OutOfReplays
            self.used += 1
            branch = self.pool.fork(self.fork_point(start, end))
            branch.cache.pin(range(start, end), layers=layers, heads=heads)
            try:
                self.trials[key] = self._finish(branch)
            except ValueError:  # more pinned than a round keeps (e.g. a policy's own pins beside the span)
                self.trials[key] = None
        return self.trials[key]

    def _restores(self, start, end, layers=None, heads=None) -> bool:
        res = self.pinned(start, end, layers, heads)
        return bool(res and res["restored"])

    def sufficiency(self, C: np.ndarray):
        lp = self.case.prompt_len
        cap = self.budget - self.buffer - (lp if self.protect else 0) - 1
        if C.size == 0 or cap < 1:
            return [], None, None, False
        mass = self.hm.evicted_mass
        wins = sorted(windows(C, cap), key=lambda w: -int(mass[C[w[0]]:C[w[1] - 1] + 1].sum()))
        span = lambda i, j: (int(C[i]), int(C[j - 1]) + 1)  # noqa: E731
        best = None  # the smallest index range [i, j) of C known to restore
        exhausted = False

        def test(i, j):
            nonlocal best
            ok = self._restores(*span(i, j))
            if ok and (best is None or j - i < best[1] - best[0]):
                best = (i, j)
            return ok

        try:
            if not any(test(i, j) for i, j in wins):
                return [], None, None, False
            i, j = best
            while j - i > 1:
                m = (i + j) // 2
                if test(i, m):
                    j = m
                elif test(m, j):
                    i = m
                else:  # both halves needed: trim each edge instead
                    lo, hi = i, m - 1  # [lo, j) restores; [m, j) does not
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        lo, hi = (mid, hi) if self._restores(*span(mid, j)) else (lo, mid - 1)
                    i = lo
                    lo, hi = m + 1, j  # [i, hi) restores
                    while lo < hi:
                        mid = (lo + hi) // 2
                        lo, hi = (lo, mid) if self._restores(*span(i, mid)) else (mid + 1, hi)
                    best = (i, hi)
                    break
        except _OutOfReplays:
            exhausted = True
            if best is None:
                return [], None, None, True
        found = best
        start, end = span(*found)
        spans = [self.describe(start, end)]
        layers, heads = list(range(self.n_layers)), list(range(self.n_heads))
        try:
            layers = self._halve(layers, lambda ls: self._restores(start, end, layers=ls))
            heads = self._halve(heads, lambda hs: self._restores(start, end, layers=None if len(layers) == self.n_layers
                                                                 else layers, heads=hs))
        except _OutOfReplays:
            exhausted = True
        return spans, layers, heads, exhausted

    @staticmethod
    def _halve(items: list, works: Callable) -> list:
        """The smaller half while one alone still works; stop when neither does."""
        while len(items) > 1:
            a, b = items[: len(items) // 2], items[len(items) // 2:]
            if works(a):
                items = a
            elif works(b):
                items = b
            else:
                break
        return items

    def describe(self, start: int, end: int) -> dict:
        c = self.case
        seq = self.X[0].tolist()
        surv = span_survival(self.hm, start, end, budget=self.budget, buffer=self.buffer, prompt_len=c.prompt_len,
                             protected=self.protect)
        return {"start": start, "end": end, "text": self.tok.decode(seq[start:end]),
                "location": location(start, end, prompt_len=c.prompt_len, until=self.P, window=self.window),
                "distance": self.P - start, **surv}

    def regenerate(self, start: int, end: int) -> list[int]:
        """Greedy decoding from the divergence with the span pinned in every head, to the end of the answer."""
        branch = self.pool.fork(self.fork_point(start, end))
        branch.cache.pin(range(start, end))
        branch.run(until=self.P)
        return continue_greedy(self.model, branch.cache, branch.result().last_logits.to(self.model.device),
                               self.case.max_new - self.g, self.stop)

    # -- necessity: force-eviction on the full-attention run ----------------------------------------------------
    def evicted(self, start: int, end: int) -> dict:
        key = ("evict", start, end)
        if key not in self.trials:
            if self.used_nec >= self.max_replays:
                raise _OutOfReplays
            self.used_nec += 1
            at = min(max(end + self.buffer, self.case.prompt_len), self.P - 1)
            branch = self.full_pool.fork(at)
            branch.run(until=at)
            evict_now(branch.cache, range(start, end))
            self.trials[key] = self._finish(branch)
        return self.trials[key]

    def necessity_search(self):
        hi = self.P - self.buffer - 1
        if hi <= 0:
            return [], False
        changes = lambda a, b: not self.evicted(a, b)["restored"]  # noqa: E731
        lo = 0
        try:
            if not changes(lo, hi):
                return [], False
            while hi - lo > 1:
                m = (lo + hi) // 2
                if changes(lo, m):
                    hi = m
                elif changes(m, hi):
                    lo = m
                else:
                    break
            exhausted = False
        except _OutOfReplays:
            exhausted = True
        d = self.describe(lo, hi)
        res = self.trials[("evict", lo, hi)]
        d.update(lp_evicted=res["lp"], match_evicted=res["match"])
        return [d], exhausted


def _eos(model, tok) -> set:
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen if isinstance(gen, (list, tuple)) else [gen] if gen is not None else [])
    return ids


# -- the command line ---------------------------------------------------------------------------------------------
@dataclass
@eviction(policy=setting(several=True, help="policies autopsied at the same K (one results file each)"),
          budget=setting(None, help=SETTINGS["budget"].help + " (default 256)"),
          buffer=setting(None, help=SETTINGS["buffer"].help + " (default 16)"))
class Config(EvictionConfig):
    """Eviction autopsy: the eviction that changed the answer, proved by fork replay (``python -m probes.autopsy``)."""

    task: str = option("copy", "the problems: copy (probes.tasks) or recall (the question restated, as "
                               "probes.prompt_protection)", choices=TASK_NAMES)
    prompt: Optional[str] = option(None, "a raw user prompt instead of a task (chat template applied; no grader)")
    problems: int = option(8, "problems 0 .. N-1 of the task", check=POSITIVE)
    index: tuple[int, ...] = option((), "these problem indices instead of --problems", check=NONNEGATIVE)
    protection: str = option("native", "prompt protection: the mode a paper alias names (attn: score only, "
                                       "attn_pp: protected), else protected (matched protection, as the paper's "
                                       "Table 2); or the same for all", choices=PROTECTIONS)
    body: int = option(256, "recall: reasoning tokens between the question and its restatement", check=POSITIVE)
    traces: Optional[str] = option(None, "recall: JSONL with 'question' and 'text' fields (default: the shipped corpus)")
    max_new: Optional[int] = option(None, "tokens generated at most (default: the task's)", check=POSITIVE)
    horizon: int = option(16, "tokens after the divergence greedy decoding must reproduce for a replay to restore",
                          check=POSITIVE)
    max_replays: int = option(16, "replays per search (sufficiency and necessity each)", check=POSITIVE)
    window: int = option(64, "a span starting within this many tokens of the divergence lies in the 'recent' part",
                         check=POSITIVE)
    no_necessity: bool = option(False, "skip the necessity search on the full-attention run")

    @property
    def kind(self) -> str:
        return "prompt" if self.prompt is not None else self.task

    def __post_init__(self) -> None:
        default_t, default_r = DEFAULTS.get("prompt" if self.prompt is not None else self.task, DEFAULTS["copy"])
        self.budget = default_t if self.budget is None else self.budget
        self.buffer = default_r if self.buffer is None else self.buffer
        super().__post_init__()

    def protection_of(self, policy: str) -> bool:
        return self.protect(policy)

    def check(self) -> None:
        if self.prompt is not None and not self.prompt.strip():
            raise ConfigError("prompt", "is empty")
        if self.prompt is not None and self.index:
            raise ConfigError("index", "a raw --prompt is one problem; drop --index")
        if not self.policy:
            raise ConfigError("policy", "name at least one policy")
        if len(set(self.policy)) != len(self.policy):
            raise ConfigError("policy", f"names a policy twice: {' '.join(self.policy)}")
        self.check_eviction(fields={"protect_prompt": "protection"})

    def indices(self) -> list[int]:
        return list(self.index) if self.index else list(range(self.problems))

    def protect(self, spec: str) -> bool:
        if self.protection == "native":
            native = native_protection(spec)
            return True if native is None else bool(native)
        return self.protection == "protected"


def cases_of(config: Config, tok) -> list[Case]:
    if config.prompt is not None:
        return [prompt_case(tok, config.prompt, config.max_new)]
    if config.task == "copy":
        return copy_cases(tok, config.indices(), config.max_new)
    traces = Path(config.traces) if config.traces else DEFAULT_TRACES
    try:
        return recall_cases(tok, config.indices(), body=config.body, seed=config.seed, traces=traces,
                            max_new=config.max_new)
    except (FileNotFoundError, ValueError, IsADirectoryError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError("traces", str(exc)) from None


def results_path(folder: Path, model_name: str, config: Config, spec: str, protect: bool) -> Path:
    return folder / result_name("autopsy", model=model_name, task=config.kind, policy=spec, protect_prompt=protect,
                                budget=config.budget, buffer=config.buffer, seed=config.seed)


def summary_path(folder: Path, model_name: str, config: Config) -> Path:
    return folder / result_name("autopsy", None, "summary", model=model_name, task=config.kind, budget=config.budget,
                                buffer=config.buffer, seed=config.seed)


def plan(config: Config, model: ModelInfo) -> Plan:
    """One result file per policy, one unit per (policy, problem), policy by policy as the command line runs them."""
    folder = out_folder("autopsy", config.out)
    for spec in config.policy:  # every policy binds before the first runs (a policy refusing the model stops here)
        config.bind(config.spec(spec, protect_prompt=config.protect(spec)), model.bind_target)
    cases = cases_of(config, model.tokenizer)
    longest = max(c.prompt_len for c in cases)
    model_name = model.name
    outputs, todo = [], []
    for spec in config.policy:
        protect = config.protect(spec)
        config.fits(config.spec(spec, protect_prompt=protect), longest, what=spec, fix="--protection score-only")
        record = {"probe": "autopsy", "engine": randattn.ENGINE, "model": model_name, "task": config.kind,
                  "prompt": config.prompt, "policy": spec, "protect_prompt": protect, "budget": config.budget,
                  "buffer": config.buffer, "seed": config.seed, "body": config.body if config.kind == "recall" else None,
                  "traces": trace_label(Path(config.traces) if config.traces else DEFAULT_TRACES)
                  if config.kind == "recall" else None, "max_new": config.max_new, "horizon": config.horizon,
                  "max_replays": config.max_replays, "window": config.window, "necessity": not config.no_necessity,
                  **run_record(model.model)}
        out = Output(str(results_path(folder, model_name, config, spec, protect)), record, KEY)
        outputs.append(out)
        todo += [make_unit("autopsy", model_name, out, {}, [{"problem": c.id}], {"case": c, "spec": spec,
                                                                                   "config": config},
                           label=f"{spec} {c.id}") for c in cases]
    return Plan("autopsy", config, outputs, todo, meta={"cases": len(cases)})


#: Full-attention generations already made in this process, by (model, problem): every policy's autopsy of a
#: problem starts from the same one (greedy, no eviction), so it is generated once per worker.
_FULL: dict = {}


def run_unit(model, tok, unit: Unit):
    """The autopsy of one problem under one policy; yields its row."""
    w = unit.work
    config, spec, case = w["config"], w["spec"], w["case"]
    key = (id(model), case.id, tuple(case.prefix), case.prompt_len, case.max_new)
    a = Autopsy(model, tok, case, policy=spec, budget=config.budget, buffer=config.buffer, protect=config.protect(spec),
                seed=config.seed, options=_task_options(config, spec), horizon=config.horizon,
                max_replays=config.max_replays, window=config.window, necessity=not config.no_necessity,
                stop=_eos(model, tok), full=_FULL.get(key))
    try:
        row = a.run()
    except ValueError as exc:
        raise ConfigError("policy", f"{spec}: {exc}") from None
    if len(_FULL) > 256:
        _FULL.clear()
    _FULL[key] = a.full
    row["task"] = config.kind
    tqdm.write(_line(row))
    yield [row]


def merge(p: Plan, rows: dict, figures: bool) -> list:
    """:func:`report` on the merged files."""
    files = [ResultsFile(o.path, o.config, KEY) for o in p.outputs]  # the merged files, read back
    config = p.config.replace(no_figure=not figures)
    report(config, files)
    return [rf.path for rf in files] + [summary_path(files[0].path.parent, files[0].config["model"], config)]


def start(p: Plan, files: dict) -> None:
    """The command line's description of the run: the model, the problems, the policies, the autopsies to run."""
    config = p.config
    pending = sum(u.pending(files[u.output].done, KEY) is not None for u in p.units)
    print(f"model {p.outputs[0].config['model']} | {config.kind}: {p.meta['cases']} problem(s) | T={config.budget}, "
          f"r={config.buffer} | policies " + ", ".join(f"{s} ({protection_tag(config.protect(s))})" for s in config.policy)
          + f" | {pending} autopsies to run")


def _task_options(config: Config, spec: str) -> dict:
    from .tasks import TASKS

    return dict(TASKS["copy"].policy_options.get(spec, {})) if config.kind == "copy" else {}


def _line(row: dict) -> str:
    head = f"{row['problem']} {row['policy']}: {row['status']}"
    if row["status"] == "no divergence":
        return head
    spans = "; ".join(f"[{s['start']},{s['end']}) {s['location']} {s['text']!r}" for s in row.get("spans", []))
    nec = "; ".join(f"[{s['start']},{s['end']}) {s['location']} {s['text']!r}" for s in row.get("necessary", []))
    return (f"{head} at token {row['divergence']} ({row['full_token']!r} vs {row['evict_token']!r}); sufficient: "
            f"{spans or '-'}; necessary: {nec or '-'}; {row['replays']} replays, {row['seconds']}s")


def report(config: Config, files: list[ResultsFile]) -> None:
    rows = [r for rf in files for r in rf.rows if r["problem"] in {c for c in _wanted(config)}]
    table = summarize(rows)
    print(f"\n{'policy':<14} {'prompt':<11} {'n':>3} {'diverged':>8} {'restored':>8}   sufficient span in "
          "prompt/recent/middle   necessary span in prompt/recent/middle")
    for t in table:
        print(f"{t['policy']:<14} {protection_tag(t['protect_prompt']):<11} {t['problems']:>3} {t['diverged']:>8} "
              f"{t['restored']:>8}   {t['sufficient_prompt']:>6}/{t['sufficient_recent']}/{t['sufficient_middle']:<18}"
              f"{t['necessary_prompt']:>6}/{t['necessary_recent']}/{t['necessary_middle']}")
    model_name = files[0].config["model"]
    folder = files[0].path.parent
    summary = write_csv(summary_path(folder, model_name, config), table)
    print("\nrows: " + ", ".join(str(rf.path) for rf in files) + f"\nsummary: {summary}")
    if not config.no_figure:
        for rf in files:
            if any(r.get("spans") or r.get("necessary") for r in rf.rows):
                cli.draw("autopsy", rf.path, config.figure_dir, "--name", "autopsy-" + rf.path.stem)


def _wanted(config: Config) -> list[str]:
    if config.prompt is not None:
        return ["prompt"]
    return [f"{config.task}-{i}" for i in config.indices()]


KIND = Kind("autopsy", Config, plan, run_unit, merge, start=start)


def main(argv=None) -> int:
    """The command line: the one every kind has (``units.command``), of this kind."""
    return command(KIND, __doc__)(argv)


if __name__ == "__main__":
    sys.exit(main())
