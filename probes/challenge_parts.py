"""What ``python -m probes.challenge`` measures beyond the leaderboard: the selector's trial run before any work
(:func:`preflight`) and the keep-log part (:func:`keeplog_part`: keep-set metrics and overlap with Random's,
descriptive). Every scored part (accuracy, question, planted, passcode, cost) is a task of the leaderboard
(``probes.leaderboard``), whose rows and board the challenge uses as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm.auto import tqdm

import randattn
from randattn import keepstats
from randattn.stats import mean_ci

from . import survival
from .leaderboard import REFERENCE
from .results import DEFAULT_TRACES
from randattn.seeding import batch_seed


def described(test: str, metric: str, unit: str, policy: str, value: float, random_value: float, **extra) -> dict:
    """A descriptive row (no significance test)."""
    return {"test": test, "metric": metric, "unit": unit, "policy": policy, "value": value, "random": random_value,
            **extra}


# -- keep-sets -----------------------------------------------------------------------------------------
def _jaccard(a: torch.Tensor, b: torch.Tensor, prompt_len: int) -> float:
    """Mean over heads of |A∩B|/|A∪B| for two ``[H, K]`` keep-sets, generated positions only."""
    vals = []
    for x, y in zip(a.tolist(), b.tolist()):
        x, y = {p for p in x if p >= prompt_len}, {p for p in y if p >= prompt_len}
        if x | y:
            vals.append(len(x & y) / len(x | y))
    return float(np.mean(vals)) if vals else float("nan")


def keeplog_part(config, model, tok, policies: list[str], sizes: dict) -> tuple[list[dict], dict]:
    """Replay real chats with a keep-log: keep-set metrics per policy, and how far each policy's final keep-sets
    overlap Random's (against Random with another seed, the overlap chance alone gives). ``(descriptive rows,
    {policy: {sequence: metrics}})``; ``config``: the challenge's (its T, r, protection, seed, ``--stats``)."""
    a, n = config, sizes
    traces = Path(a.traces) if a.traces else DEFAULT_TRACES
    length = a.budget + n["keeplog_rounds"] * a.buffer
    chats = survival.build_chats(tok, survival.read_rows(traces), n["sequences"], length, a.seed,
                                 a.budget if a.protect_prompt else a.budget + a.buffer)
    metrics: dict = {}
    overlap: dict = {}
    other_seed = "random (another seed)"
    for group in tqdm(survival.batches(chats, 4), desc="keep-logs", unit="batch"):
        prompt_len = group[0].prompt_len
        ids = torch.tensor([c.ids for c in group], device=model.device)
        final = {}
        for pol in [*policies, other_seed]:
            seed = batch_seed(a.seed, group[0].index + (7919 if pol == other_seed else 0))
            cache = a.spec(REFERENCE if pol == other_seed else pol, seed=seed).make_cache(keep_log=True)
            randattn.replay(model, ids, cache, prompt_len=prompt_len, score_from=ids.shape[1])
            final[pol] = [cache.positions(layer) for layer in range(len(cache.layers))]
            for b, chat in enumerate(group):
                m = keepstats.keep_metrics(keepstats.select_rows(cache.keep_log, b), prompt_len)
                metrics.setdefault(pol, {})[chat.index] = m
        for pol in final:
            for b, chat in enumerate(group):
                overlap.setdefault(pol, {})[chat.index] = float(np.mean(
                    [_jaccard(x[b], y[b], prompt_len) for x, y in zip(final[pol], final[REFERENCE])]))
    for pol in metrics:
        for seq in metrics[pol]:
            metrics[pol][seq]["overlap_with_random"] = overlap[pol][seq]
    names = {"slot_coverage": "slot coverage", "prompt_union": "prompt survival (union of heads)",
             "prompt_head": "prompt survival (per head)", "jaccard": "keep-set overlap between heads",
             "entropy": "coverage entropy", "overlap_with_random": "keep-set overlap with Random"}
    table = []
    for pol in [p for p in policies if p != REFERENCE] + [other_seed]:
        for key, label in names.items():
            if key == "overlap_with_random":
                d = [metrics[pol][s][key] for s in metrics[pol]]
                table.append(described("keep-sets", label, "sequences", pol, float(np.mean(d)), 1.0))
                continue
            if pol == other_seed:
                continue
            d = [metrics[pol][s][key] - metrics[REFERENCE][s][key] for s in metrics[pol]]
            if any(np.isnan(d)):
                continue
            table.append(described("keep-sets", label, "sequences", pol,
                                   float(np.mean([metrics[pol][s][key] for s in metrics[pol]])),
                                   float(np.mean([metrics[REFERENCE][s][key] for s in metrics[pol]])),
                                   **mean_ci(d, seed=a.seed).as_dict("delta")))
    return table, metrics


#: The trial run's own settings (declared once): an 8-token prompt and 24 new tokens reach T + r = 20, so rounds run
#: within a few forwards whatever the challenge's own T and r.
PREFLIGHT = {"budget": 16, "buffer": 4}


def preflight(model, tok, policy: str, *, protect: bool, options: dict) -> Optional[str]:
    """Run the selector for a few rounds on the real model (:data:`PREFLIGHT`); the error text when it fails, else
    None."""
    ids = torch.tensor([tok("Let us check the selector on a short text before the long runs begin.",
                            add_special_tokens=False)["input_ids"][:8]], device=model.device)
    cache = randattn.EvictionSpec.from_mapping({"policy": policy, "protect_prompt": protect, "options": options,
                                                **PREFLIGHT}, where="the challenge's trial run").make_cache()
    try:
        randattn.generate(model, ids, cache, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                          pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
    except (ValueError, TypeError, RuntimeError) as exc:
        return str(exc)
    if cache.total_events == 0:
        return "no eviction round ran in the trial generation"
    return None


__all__ = ["described", "keeplog_part", "preflight"]
