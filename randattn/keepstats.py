"""Statistics of a :class:`~randattn.keeplog.KeepLog`: survival curves and keep-log metrics.

Pure numpy over the records ``(layer, round, seq_len, kept[B, H_kv, K])`` of a keep-log. The prompt
length is not stored in a log, so every function that separates prompt from generated positions
takes it (``prompt_len``: positions ``0..prompt_len-1`` are the prompt, the rest are generated).

Survival (:func:`survival_curve`): every (layer, round record, batch row, KV head) and every
generated position ``p < seq_len`` of that record is one observation, "is ``p`` in this head's
keep-set at this round". Observations are binned by the rounds ``p`` has competed in (``n``: the
rounds of its layer up to this one at which ``p`` was a candidate, i.e. older than the newest
``recent`` pairs: ``p < seq_len_i - recent``, with ``recent`` recorded in the keep-log) or by its
age in tokens (``seq_len - p``). Within one ``n`` bin each (layer, row, head, position) appears
once, so counts behave like independent Bernoulli draws for Random (slightly under-dispersed, since
a round keeps exactly T).

Analytic curves for Random (:func:`random_survival`, :func:`union_survival`): a round holds
``T + r`` pairs per head, keeps the newest ``recent`` untouched and ``T - recent`` of the other
``T + r - recent`` uniformly at random, so a candidate survives it with
``(T - recent) / (T + r - recent)``; with the prompt of ``lp`` pairs pinned, ``T - recent - lp``
free places are drawn from ``T + r - recent - lp`` candidates. With the paper's ``recent = r`` that is
``(T - r - lp) / (T - lp)`` (0.9375 at T=1024, r=64). Heads draw independently, so the union over
``H`` heads survives with ``1 - (1 - s)^H``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Iterable, Sequence

import numpy as np

from .keeplog import KeepLog

__all__ = [
    "SurvivalCurve",
    "survival_curve",
    "random_survival",
    "random_round_survival",
    "union_survival",
    "slot_coverage",
    "prompt_survival",
    "head_jaccard",
    "coverage_entropy",
    "keep_metrics",
    "select_rows",
]


# -- analytic curves -----------------------------------------------------------------------------
def random_round_survival(budget: int, buffer: int, prompt_len: int = 0, protected: bool = False,
                          recent: "int | None" = None) -> float:
    """Probability that a candidate survives one Random round: ``(T - recent - lp) / (T + r - recent - lp)``
    with ``lp`` the pinned prompt (0 unprotected) and ``recent`` the recent window (default ``r``, as the
    cache: ``(T - r - lp) / (T - lp)``)."""
    recent = buffer if recent is None else recent
    pinned = prompt_len if protected else 0
    if not 0 <= recent < budget:
        raise ValueError(f"recent={recent} must be in [0, T={budget})")
    if not 0 <= pinned < budget - recent:
        raise ValueError(f"a protected prompt of {prompt_len} tokens leaves no free slot in T - recent = "
                         f"{budget - recent} (T={budget}, recent={recent})")
    return (budget - recent - pinned) / (budget + buffer - recent - pinned)


def random_survival(n, budget: int, buffer: int, prompt_len: int = 0, protected: bool = False,
                    recent: "int | None" = None) -> np.ndarray:
    """Per-head survival of a generated pair after competing in ``n`` Random rounds: ``q**n`` with
    ``q = random_round_survival(T, r, lp, protected, recent)`` (``n`` may be an array)."""
    return random_round_survival(budget, buffer, prompt_len, protected, recent) ** np.asarray(n, dtype=float)


def union_survival(s, n_heads: int) -> np.ndarray:
    """Survival in at least one of ``n_heads`` heads that each keep a pair independently with ``s``."""
    return 1.0 - (1.0 - np.asarray(s, dtype=float)) ** n_heads


# -- survival curves -----------------------------------------------------------------------------
@dataclass
class SurvivalCurve:
    """Binned survival counts of generated positions; additive, so curves of runs can be merged.

    ``by == "rounds"``: bin ``i`` holds observations that have been through ``n = i + 1`` rounds.
    ``by == "age"``: bin ``i`` holds ages ``i*width + 1 .. (i+1)*width`` tokens.

    total[i]        observations (layer x round record x row x position) in bin i
    head_kept[i]    kept indicators summed over heads (per-head survival = head_kept / (total * n_heads))
    union_kept[i]   observations kept by at least one head of their layer
    independent[i]  sum over observations of the union predicted from independent heads,
                    ``1 - prod_h (1 - s_h)``, with ``s_h`` the measured survival of head h in the same
                    layer, row and bin
    rounds_hist[i, n]  observations of bin i that have been through n rounds (for analytic curves)
    """

    by: str
    width: int
    n_heads: int
    total: np.ndarray
    head_kept: np.ndarray
    union_kept: np.ndarray
    independent: np.ndarray
    rounds_hist: np.ndarray = field(repr=False)

    @property
    def lo(self) -> np.ndarray:
        """Smallest rounds (or age) in each bin."""
        return np.arange(len(self.total)) * self.width + 1

    @property
    def hi(self) -> np.ndarray:
        return (np.arange(len(self.total)) + 1) * self.width

    @property
    def x(self) -> np.ndarray:
        """Bin centre: n for rounds bins, the mean age of the bin's range for age bins."""
        return (self.lo + self.hi) / 2

    def _ratio(self, num: np.ndarray, den: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, num / np.maximum(den, 1), np.nan)

    @property
    def head(self) -> np.ndarray:
        """Per-head survival (averaged over heads, layers, rows and rounds) per bin; NaN where empty."""
        return self._ratio(self.head_kept, self.total * self.n_heads)

    @property
    def union(self) -> np.ndarray:
        """Survival in at least one head of the layer, per bin."""
        return self._ratio(self.union_kept, self.total)

    @property
    def independent_union(self) -> np.ndarray:
        """The union that independent heads with the measured per-head survival would give, per bin."""
        return self._ratio(self.independent, self.total)

    @property
    def deficit(self) -> np.ndarray:
        """Independent-heads prediction minus measured union: > 0 when heads keep the same pairs."""
        return self.independent_union - self.union

    def head_se(self) -> np.ndarray:
        """Binomial standard error of :attr:`head` (observations x heads draws)."""
        s, n = self.head, self.total * self.n_heads
        return np.sqrt(self._ratio(s * (1 - s), n))

    def analytic_sums(self, q: float) -> tuple[np.ndarray, np.ndarray]:
        """Sums over each bin's observations of Random's per-head ``q**n`` and union ``1-(1-q**n)^H``.

        Divide by :attr:`total` for the curves; keep them as sums to pool runs whose ``q`` differ
        (e.g. different protected prompt lengths)."""
        n = np.arange(self.rounds_hist.shape[1])
        s = float(q) ** n
        return self.rounds_hist @ s, self.rounds_hist @ union_survival(s, self.n_heads)

    def analytic(self, q: float) -> tuple[np.ndarray, np.ndarray]:
        """Random's expected per-head and union survival per bin, given the rounds each observation saw."""
        head, union = self.analytic_sums(q)
        return self._ratio(head, self.total), self._ratio(union, self.total)

    def merge(self, other: "SurvivalCurve") -> "SurvivalCurve":
        if (self.by, self.width, self.n_heads) != (other.by, other.width, other.n_heads):
            raise ValueError(
                f"cannot merge curves binned {self.by}/{self.width} with {self.n_heads} heads and "
                f"{other.by}/{other.width} with {other.n_heads} heads"
            )
        n_bins = max(len(self.total), len(other.total))
        n_rounds = max(self.rounds_hist.shape[1], other.rounds_hist.shape[1])

        def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            shape = (n_bins,) if a.ndim == 1 else (n_bins, n_rounds)
            out = np.zeros(shape, dtype=np.result_type(a, b))
            for t in (a, b):
                out[tuple(slice(0, s) for s in t.shape)] += t
            return out

        return SurvivalCurve(self.by, self.width, self.n_heads, add(self.total, other.total),
                             add(self.head_kept, other.head_kept), add(self.union_kept, other.union_kept),
                             add(self.independent, other.independent), add(self.rounds_hist, other.rounds_hist))

    def to_dict(self) -> dict:
        return {"by": self.by, "width": self.width, "n_heads": self.n_heads, "total": self.total.tolist(),
                "head_kept": self.head_kept.tolist(), "union_kept": self.union_kept.tolist(),
                "independent": [round(float(v), 6) for v in self.independent],
                "rounds_hist": self.rounds_hist.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "SurvivalCurve":
        return cls(d["by"], int(d["width"]), int(d["n_heads"]), np.asarray(d["total"], np.int64),
                   np.asarray(d["head_kept"], np.int64), np.asarray(d["union_kept"], np.int64),
                   np.asarray(d["independent"], float), np.asarray(d["rounds_hist"], np.int64).reshape(len(d["total"]), -1))


def _layers(log: KeepLog) -> list[list[tuple[int, int, np.ndarray]]]:
    if len(log) == 0:
        raise ValueError("the keep-log has no records: no eviction round ran (the sequence never reached K + r)")
    return [log.for_layer(layer) for layer in sorted(set(log.layers))]


def _kept_mask(kept: np.ndarray, seq_len: int) -> np.ndarray:
    """Bool ``[B, H, seq_len]``: which positions each head kept."""
    mask = np.zeros((*kept.shape[:2], seq_len), dtype=bool)
    np.put_along_axis(mask, kept.astype(np.int64), True, axis=2)
    return mask


def survival_curve(log: KeepLog, prompt_len: int, *, by: str = "rounds", width: int = 1,
                   skip_initial: bool = False, recent: "int | None" = None) -> SurvivalCurve:
    """Survival of generated positions binned by rounds competed in (``by="rounds"``) or by age in
    tokens (``by="age"``, bins of ``width`` tokens). See :class:`SurvivalCurve` for the fields.
    ``recent`` (default: the keep-log's) is the window of newest pairs that did not compete; a position
    that has competed in no round yet counts only in age bins.

    ``skip_initial=True`` leaves out the initial fill, positions written before their layer's first
    round: at a given age they have been through fewer rounds than later positions (rounds only
    start once the cache holds ``K + r``), so without them age and rounds correspond one to one
    (``n = ceil(age / r)`` when rounds fire every ``r`` tokens).
    """
    if by not in ("rounds", "age"):
        raise ValueError(f"by must be 'rounds' or 'age', got {by!r}")
    if by == "rounds":
        width = 1
    if width < 1:
        raise ValueError(f"width must be a positive number of tokens, got {width}")
    layers = _layers(log)
    recent = int(getattr(log, "recent", 0) if recent is None else recent)
    n_heads = layers[0][0][2].shape[1]
    max_len = max(s for recs in layers for _, s, _ in recs)
    max_rounds = max(len(recs) for recs in layers)
    n_bins = max_rounds if by == "rounds" else -(-max(max_len - prompt_len, 1) // width)
    total = np.zeros(n_bins, np.int64)
    head_kept = np.zeros(n_bins, np.int64)
    union_kept = np.zeros(n_bins, np.int64)
    independent = np.zeros(n_bins, float)
    rounds_hist = np.zeros((n_bins, max_rounds + 1), np.int64)
    for recs in layers:
        seq_lens = np.array([s for _, s, _ in recs])
        batch = recs[0][2].shape[0]
        # Per-row counts of this layer, pooled over its rounds: what the independence prediction needs.
        lay_total = np.zeros((batch, n_bins), np.int64)
        lay_head = np.zeros((batch, n_heads, n_bins), np.int64)
        first = max(prompt_len, int(seq_lens[0])) if skip_initial else prompt_len
        for j, (_, seq_len, kept) in enumerate(recs):
            pos = np.arange(first, seq_len)
            if pos.size == 0:
                continue
            mask = _kept_mask(kept, seq_len)[:, :, first:]  # [B, H, P]
            # rounds so far (this one included) at which p was a candidate: seq_len_i - recent > p
            n = (j + 1) - np.searchsorted(seq_lens[: j + 1] - recent, pos, side="right")
            if by == "rounds":
                competed = n > 0
                pos, n, mask = pos[competed], n[competed], mask[:, :, competed]
                if pos.size == 0:
                    continue
            bins = n - 1 if by == "rounds" else (seq_len - pos - 1) // width
            counts = np.bincount(bins, minlength=n_bins)
            total += counts * batch
            lay_total += counts[None]
            np.add.at(rounds_hist, (bins, n), batch)
            for b in range(batch):
                for h in range(n_heads):
                    lay_head[b, h] += np.bincount(bins, weights=mask[b, h], minlength=n_bins).astype(np.int64)
                union_kept += np.bincount(bins, weights=mask[b].any(0), minlength=n_bins).astype(np.int64)
        head_kept += lay_head.sum(axis=(0, 1))
        with np.errstate(invalid="ignore", divide="ignore"):
            s = np.where(lay_total[:, None] > 0, lay_head / np.maximum(lay_total[:, None], 1), 0.0)
        independent += (lay_total * (1.0 - np.prod(1.0 - s, axis=1))).sum(axis=0)
    return SurvivalCurve(by, width, n_heads, total, head_kept, union_kept, independent, rounds_hist)


# -- keep-log metrics ----------------------------------------------------------------------------
def _last_records(log: KeepLog) -> list[tuple[int, np.ndarray]]:
    """``(seq_len, kept[B, H, K])`` of the last round of every layer."""
    return [(recs[-1][1], recs[-1][2]) for recs in _layers(log)]


def _selected(kept: np.ndarray, seq_len: int, recent: int) -> np.ndarray:
    """Bool ``[B, H, seq_len - recent]``: the candidates each head *selected* at a round (the recent window,
    kept without competing, left out, as the paper's keep-set logger logs only ``ids_to_keep``)."""
    return _kept_mask(kept, seq_len)[:, :, : max(seq_len - recent, 0)]


def slot_coverage(log: KeepLog, prompt_len: int = 0) -> float:
    """Share of candidate positions that at least one head of a layer selected at least once.

    For each layer and batch row: candidates are all positions ``prompt_len .. L - recent - 1`` that
    competed by the layer's last round (``L`` = that round's ``seq_len``; ``prompt_len=0`` counts the
    prompt too); a candidate is covered when some head kept it at some round it competed in. A
    position is uncovered only when every head dropped it at the first round it competed in, so this
    measures what a policy discards everywhere at once. Mean over layers and rows.
    """
    values = []
    for recs in _layers(log):
        last = recs[-1][1] - log.recent
        if last <= prompt_len:
            continue
        ever = np.zeros((recs[0][2].shape[0], last), dtype=bool)
        for _, seq_len, kept in recs:
            sel = _selected(kept, seq_len, log.recent).any(axis=1)
            ever[:, : sel.shape[-1]] |= sel
        values.extend(ever[:, prompt_len:].mean(axis=1))
    return float(np.mean(values)) if values else float("nan")


def prompt_survival(log: KeepLog, prompt_len: int) -> dict[str, float]:
    """Share of prompt positions ``0..prompt_len-1`` still held at the last round of each layer.

    ``union``: kept by at least one head; ``per_head``: mean over heads of the share each head
    keeps. Both averaged over layers and rows; NaN without a prompt.
    """
    if prompt_len <= 0:
        return {"union": float("nan"), "per_head": float("nan")}
    union, per_head = [], []
    for seq_len, kept in _last_records(log):
        mask = _kept_mask(kept, max(seq_len, prompt_len))[:, :, :prompt_len]  # [B, H, lp]
        union.extend(mask.any(axis=1).mean(axis=1))
        per_head.extend(mask.mean(axis=(1, 2)))
    return {"union": float(np.mean(union)), "per_head": float(np.mean(per_head))}


def head_jaccard(log: KeepLog, prompt_len: int = 0) -> float:
    """Mean pairwise Jaccard overlap ``|A∩B| / |A∪B|`` of the KV heads' selected generated positions
    (``>= prompt_len``, and outside the recent window, so neither a pinned prompt nor the window every
    head holds inflates it), at the last round of each layer; averaged over head pairs, layers and
    rows. 1: every head keeps the same pairs."""
    values = []
    for seq_len, kept in _last_records(log):
        mask = _selected(kept, seq_len, log.recent)[:, :, prompt_len:]  # the recent window is in every head
        for b in range(mask.shape[0]):
            for h, g in combinations(range(mask.shape[1]), 2):
                union = np.sum(mask[b, h] | mask[b, g])
                if union:
                    values.append(np.sum(mask[b, h] & mask[b, g]) / union)
    return float(np.mean(values)) if values else float("nan")


def coverage_entropy(log: KeepLog, prompt_len: int = 0, n_bins: int = 10) -> float:
    """How evenly kept slots spread over the generated history, in ``[0, 1]``.

    At the last round of each layer, the selected generated positions of all heads (one count per
    head and position; the recent window left out, as in the paper's logger) are binned into
    ``n_bins`` equal-width age bins spanning ``prompt_len .. seq_len-1``; with ``p_b`` the share of
    kept slots in bin ``b`` the value is
    ``-sum p_b log p_b / log(n_bins)``: 0 when everything kept lies in one bin (a recency window
    shorter than a bin), 1 when kept slots are spread evenly. Mean over layers and rows.
    """
    if n_bins < 2:
        raise ValueError(f"n_bins must be at least 2, got {n_bins}")
    values = []
    for seq_len, kept in _last_records(log):
        if seq_len - prompt_len < n_bins:
            continue
        edges = np.linspace(prompt_len, seq_len, n_bins + 1)
        for b in range(kept.shape[0]):
            pos = kept[b].ravel()
            counts, _ = np.histogram(pos[(pos >= prompt_len) & (pos < seq_len - log.recent)], bins=edges)
            if counts.sum() == 0:
                continue
            p = counts[counts > 0] / counts.sum()
            values.append(float(-(p * np.log(p)).sum() / np.log(n_bins)))
    return float(np.mean(values)) if values else float("nan")


def keep_metrics(log: KeepLog, prompt_len: int, *, n_bins: int = 10) -> dict[str, float]:
    """All keep-log metrics of one log: slot coverage of generated positions, prompt survival
    (union and per head), head Jaccard and coverage entropy (see each function)."""
    prompt = prompt_survival(log, prompt_len)
    return {
        "slot_coverage": slot_coverage(log, prompt_len),
        "prompt_union": prompt["union"],
        "prompt_head": prompt["per_head"],
        "jaccard": head_jaccard(log, prompt_len),
        "entropy": coverage_entropy(log, prompt_len, n_bins),
    }


def select_rows(log: KeepLog, rows: "int | Sequence[int] | Iterable[int]") -> KeepLog:
    """The same log restricted to some batch rows (e.g. one sequence of a batched run)."""
    idx = [rows] if isinstance(rows, (int, np.integer)) else list(rows)
    out = KeepLog(recent=log.recent)
    out.layers, out.rounds, out.seq_lens = list(log.layers), list(log.rounds), list(log.seq_lens)
    out.kept = [k[idx] for k in log.kept]
    return out
