"""The round engine: when an eviction round fires and which pairs it keeps, for both engines (the HF cache and the
vLLM plugin), as pure functions of one layer's held state and the settings.

- **The schedule.** A round fires when a layer stores ``T + r`` pairs or more (:func:`round_due`) and leaves ``T``;
  its candidates are every stored pair but the newest ``recent`` (:meth:`RoundEngine.candidates`). A stream that
  stores its prompt whole and then one pair per token therefore rounds at the lengths ``first, first + r, ...``
  with ``first = max(prompt_len, T + r)`` (:func:`round_lengths`, :func:`next_round_length`, :func:`held_pairs`,
  :func:`max_held_pairs`: what the vLLM plugin sizes its blocks and chunks by).
- **The decision.** :meth:`RoundEngine.select` takes a :class:`Held` (one layer's slots of one row group: keys,
  values, positions, queries, accumulated attention, its prompt length, round index and row key) and returns the
  kept slot indices ``[B, H_kv, T]``: the view of the candidates (:meth:`RoundEngine.view`: the seeded generator,
  prompt protection and keep-mask pins), the policy's checked scores (:meth:`RoundEngine.scores`), and the top
  ``T - recent`` per head with the recent window after them (:func:`select_keep`).

Nothing here stores, compacts or logs: :class:`randattn.EvictingCache` and ``randattn.vllm.state`` apply the keep
indices to their own storage and keep-logs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .keep_masks import rule_masks
from .policies import CacheView, Policy
from .seeding import round_seed, row_round_seed

__all__ = ["RoundEngine", "Held", "select_keep", "round_due", "first_round", "round_lengths", "next_round_length",
           "held_pairs", "max_held_pairs"]


# -- the schedule --------------------------------------------------------------------------------------------------
def round_due(stored: int, budget: int, buffer: int) -> bool:
    """Whether a layer storing ``stored`` pairs per head runs a round now: at ``T + r`` pairs or more."""
    return stored >= budget + buffer


def first_round(prompt_len: int, budget: int, buffer: int) -> int:
    """The length at which a stream's first round fires: the prompt is stored whole by one forward (a round right
    after it when it is already due), then one pair per token brings the layer to ``T + r``."""
    prompt_len = int(prompt_len)
    return prompt_len if round_due(prompt_len, budget, buffer) else budget + buffer


def round_lengths(prompt_len: int, budget: int, buffer: int, upto: int) -> list[int]:
    """The absolute lengths ``<= upto`` at which such a stream's rounds run: each leaves ``T`` pairs, so the next is
    due ``r`` tokens later."""
    return list(range(first_round(prompt_len, budget, buffer), int(upto) + 1, buffer))


def next_round_length(prompt_len: int, computed: int, budget: int, buffer: int) -> int:
    """The smallest length ``> computed`` at which a round runs (where a chunk starting after ``computed`` tokens may
    end at the latest: a chunk may end at a round, never cross one)."""
    first = first_round(prompt_len, budget, buffer)
    if computed < first:
        return first
    return first + ((computed - first) // buffer + 1) * buffer


def held_pairs(prompt_len: int, n_tokens: int, budget: int, buffer: int) -> int:
    """Pairs per head a layer holds after ``n_tokens`` tokens (prompt included): all of them before the first
    round, then ``T`` after each round plus the tokens since."""
    first = first_round(prompt_len, budget, buffer)
    if n_tokens < first:
        return int(n_tokens)
    return budget + (n_tokens - first) % buffer


def max_held_pairs(prompt_len: int, budget: int, buffer: int) -> int:
    """The most pairs a layer ever holds (inside the forward that runs a round): ``max(prompt_len, T + r)``."""
    return first_round(prompt_len, budget, buffer)


# -- the selection -------------------------------------------------------------------------------------------------
def select_keep(scores: torch.Tensor, *, keep: int, recent: int, pinned: Optional[torch.Tensor] = None,
                evicted: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The selection of a round, as a pure function: from the candidates' ``scores[B, H_kv, S]`` (higher = keep),
    the ``keep`` best per head, ``pinned`` ones always and ``evicted`` ones never, sorted (chronological
    compaction), then the ``recent`` newest slots ``S .. S + recent - 1``. Returns slot indices ``[B, H_kv, keep +
    recent]``. Raises ``ValueError`` when more is pinned than ``keep`` or more force-evicted than a round drops."""
    inf = torch.tensor(float("inf"), device=scores.device)
    if pinned is not None:
        scores = torch.where(pinned, inf, scores)
    if evicted is not None:
        scores = torch.where(evicted, -inf, scores)
    n_pinned = int(torch.isposinf(scores).sum(-1).max())
    if n_pinned > keep:
        raise ValueError(f"{n_pinned} pairs are pinned (protected prompt + keep-mask pins + the policy's own pins) in "
                         f"one head but a round keeps only T - recent = {keep} of the older pairs; raise budget or pin "
                         "fewer")
    kept = torch.topk(scores, keep, dim=-1, sorted=False).indices
    if evicted is not None and bool(torch.isneginf(torch.gather(scores, -1, kept)).any()):
        raise ValueError(f"force-evicted positions exceed what one round can drop ({scores.shape[-1] - keep} of "
                         f"{scores.shape[-1]} candidates); force-evict fewer positions per round or use a larger buffer")
    # topk returns score order; sorting the slot indices keeps every head chronological, and the recent window (the
    # newest slots) goes after every candidate.
    kept = kept.sort(dim=-1).values
    if recent:
        n = scores.shape[-1]
        tail = torch.arange(n, n + recent, device=kept.device).expand(*kept.shape[:2], recent)
        kept = torch.cat([kept, tail], dim=-1)
    return kept


@dataclass
class Held:
    """One layer's held slots at a round, for one group of rows scored together, as the engine reads them.

    ``keys``/``values`` ``[B, H_kv, S, D]``, ``positions`` ``[B, H_kv, S]`` (the group's own positions: its first
    real token at 0), ``offset``: the group's first real slot (slots before it are dead padding), ``seq_len``: the
    tokens the group has seen (this forward's included), ``round_idx``: its rounds so far, ``prompt_len``: its own
    prompt length, ``row_key``: its key when each row draws from its own generator (else ``None``: one draw per
    (seed, layer, round)). ``queries`` ``[B, H_q, w, D]`` / ``query_positions`` ``[w]`` / ``scaling``, and
    ``attention`` ``[B, H_q, S]``, when the policy reads them."""

    layer_idx: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    seq_len: int
    round_idx: int
    prompt_len: int
    offset: int = 0
    row_key: Optional[int] = None
    queries: Optional[torch.Tensor] = None
    query_positions: Optional[torch.Tensor] = None
    scaling: Optional[float] = None
    attention: Optional[torch.Tensor] = None


class RoundEngine:
    """The resolved settings of a cache's rounds (``policy``, ``budget`` T, ``buffer`` r, ``recent``,
    ``protect_prompt``, ``seed``; checked by the caller, :class:`randattn.EvictingCache`) and the round itself."""

    # A policy is shown the caller's own tensors (views of its storage: a copy per round would cost what the round
    # costs), so a write into one would silently change what is kept or attended later. Every in-place write bumps
    # a tensor's version counter: comparing the counters around the call catches it for the price of a few ints.
    # Inference tensors keep no counter; the policy then runs outside inference mode, where torch refuses an in-place
    # write into them. Writes through ``.data`` or ``.numpy()`` escape both.
    _SHOWN = ("keys", "values", "positions", "attention", "pinned", "queries", "query_positions")

    def __init__(self, policy: Policy, *, budget: int, buffer: int, recent: int, protect_prompt: bool, seed: int):
        self.policy = policy
        self.budget, self.buffer, self.recent = int(budget), int(buffer), int(recent)
        self.protect_prompt = bool(protect_prompt)
        self.seed = int(seed)
        needs = set(getattr(policy, "needs", ()))
        self.needs_attention = "attention" in needs
        self.needs_queries = bool(needs & {"queries", "attention"})
        # A query window of None means "the queries since the last round" (the paper's buffer of r).
        window = getattr(policy, "window", 0)
        self.query_window = self.buffer if window is None else max(int(window or 0), 1)
        self.shared_scope = getattr(policy, "scope", "layer") == "model"
        self._shared: Optional[tuple] = None  # (forward, {round key: per-layer scores}): a policy scored across layers
        self.times: Optional[dict] = None  # seconds per phase of keep() when set (the vLLM benchmark's profile)

    # -- the schedule, for one layer ------------------------------------------------------------------------------
    def due(self, stored: int) -> bool:
        return round_due(stored, self.budget, self.buffer)

    def candidates(self, stored: int) -> int:
        """Slots that compete at a round of a layer storing ``stored``: all but the newest ``recent``."""
        return stored - self.recent

    def wants_queries(self, stored: int, new_tokens: int) -> bool:
        """Whether a forward of ``new_tokens`` onto ``stored`` pairs must hand its queries over: accumulated
        attention needs every step's; a query window only the last ``window`` before the next round."""
        if not self.needs_queries:
            return False
        if self.needs_attention:
            return True
        return stored + new_tokens > self.budget + self.buffer - self.query_window

    def forget(self) -> None:
        """Drop the cross-layer scores memoised for the forward in progress (the held state they came from changed)."""
        self._shared = None

    # -- the view ---------------------------------------------------------------------------------------------------
    def view(self, held: Held, rules: Sequence = (), *, n: Optional[int] = None) -> CacheView:
        """The read-only view a policy scores: the ``n`` candidates after ``held.offset`` (default all but the newest
        ``recent``), with the round's seeded generator and the pins (protected prompt, keep-mask ``rules``)."""
        off = held.offset
        if n is None:
            n = self.candidates(held.keys.shape[-2] - off)
        gen = torch.Generator(device=held.keys.device)
        if held.row_key is not None:
            gen.manual_seed(row_round_seed(self.seed, held.row_key, held.layer_idx, held.round_idx))
        else:
            gen.manual_seed(round_seed(self.seed, held.layer_idx, held.round_idx))
        positions = held.positions[:, :, off : off + n]
        return CacheView(
            keys=held.keys[:, :, off : off + n],
            values=held.values[:, :, off : off + n],
            positions=positions,
            layer_idx=held.layer_idx,
            round_idx=held.round_idx,
            prompt_len=held.prompt_len,
            seq_len=held.seq_len,
            budget=self.budget,
            buffer=self.buffer,
            generator=gen,
            queries=held.queries,
            query_positions=held.query_positions,
            scaling=held.scaling,
            attention=None if held.attention is None else held.attention[:, :, off : off + n],
            recent=self.recent,
            seed=self.seed,
            protect_prompt=self.protect_prompt,
            pinned=self.pinned(held.layer_idx, positions, held.prompt_len, rules),
            row_key=held.row_key,
        )

    def pinned(self, layer_idx: int, positions: torch.Tensor, prompt_len: int, rules: Sequence = ()):
        """The candidates kept whatever their score: keep-mask pins, and the prompt when it is protected."""
        pinned, _ = rule_masks(rules, layer_idx, positions)
        if self.protect_prompt and prompt_len:
            prompt = positions < prompt_len
            pinned = prompt if pinned is None else pinned | prompt
        return pinned

    # -- the decision ---------------------------------------------------------------------------------------------
    def select(self, held: Held, rules: Sequence = (), **score_args) -> torch.Tensor:
        """The round of one layer's ``held`` slots: sorted slot indices ``[B, H_kv, T]`` to keep, counted from
        ``held.offset`` (the recent window last). ``score_args``: see :meth:`scores`."""
        return self.keep(self.view(held, rules), rules, **score_args)

    def keep(self, view: CacheView, rules: Sequence = (), **score_args) -> torch.Tensor:
        """The keep indices of a round from its view (:meth:`view`): scored, pinned, force-evicted, selected. With
        :attr:`times` set (a dict), the seconds spent scoring and selecting are added to its ``score`` and
        ``select`` (CPU clocks: on CUDA they count launches, not kernels)."""
        _, evicted = rule_masks(rules, view.layer_idx, view.positions)
        try:
            if self.times is None:
                return select_keep(self.scores(view, **score_args), keep=view.keep, recent=self.recent,
                                   pinned=view.pinned, evicted=evicted)
            t0 = time.perf_counter()
            scores = self.scores(view, **score_args)
            t1 = time.perf_counter()
            kept = select_keep(scores, keep=view.keep, recent=self.recent, pinned=view.pinned, evicted=evicted)
            self.times["score"] = self.times.get("score", 0.0) + t1 - t0
            self.times["select"] = self.times.get("select", 0.0) + time.perf_counter() - t1
            return kept
        except ValueError as exc:
            raise ValueError(f"layer {view.layer_idx}: {exc} (T={self.budget}, recent={self.recent})") from None

    def scores(self, view: CacheView, *, forward=None, group=None,
               layer_views: Optional[Callable[[], list]] = None) -> torch.Tensor:
        """The policy's checked float32 scores of ``view``. A policy scored across layers (``scope == "model"``:
        TriAttention's per-head keep-set shared by all layers) is scored once per round, when the first layer
        reaches it, from ``layer_views()`` (every layer's view of that round, in order), and memoised for the
        ``forward`` in progress per row ``group``: later layers reuse it."""
        if not self.shared_scope:
            return self._checked_scores(view)
        if layer_views is None:
            raise ValueError(f"policy {self.policy.name!r} scores all layers at once; its round needs every layer's "
                             f"view (layer_views), which only a whole model's cache can give")
        # Every layer's candidates are already stored when the first layer reaches the round, since they exclude the
        # newest `recent` pairs, which this forward is still writing into the later layers. A round where several
        # groups are due at once (rows with their own row keys, or padded rows whose rounds coincide) scores each
        # group from every layer's candidates before the first layer compacts, and each later layer must reuse that
        # group's scores, not rescore it from the already-compacted first layer.
        if self._shared is None or self._shared[0] != forward:
            self._shared = (forward, {})
        memo = self._shared[1]
        key = (view.round_idx, view.shape[-1], group)
        if key not in memo:
            views = layer_views()
            scores = self._run_policy(lambda: self.policy.score_layers(views), views, f"round {view.round_idx}")
            if not isinstance(scores, (list, tuple)) or len(scores) != len(views):
                got = f"{len(scores)} score tensors" if isinstance(scores, (list, tuple)) else type(scores).__name__
                raise TypeError(f"policy {self.policy.name!r}: score_layers returned {got} at round {view.round_idx}; "
                                f"expected a list of {len(views)}, one per layer in order")
            memo[key] = [self._check_shape(v, s) for v, s in zip(views, scores)]
        if view.layer_idx >= len(memo[key]):  # a layer that did not exist yet when the round was scored
            raise self.shared_round_refusal([view.layer_idx], view.shape[-1])
        return memo[key][view.layer_idx]

    def shared_round_refusal(self, short: list, n: int) -> ValueError:
        """The error for a cross-layer round whose layers ``short`` do not hold its ``n`` candidates yet."""
        return ValueError(
            f"policy {self.policy.name!r} scores all layers at once, but layers {short} do not hold the "
            f"{n} candidates of this round yet (a round inside a forward of more than recent={self.recent} "
            f"tokens, e.g. an unprotected prefill longer than T + r); use its per-layer variant")

    def refuse_shared_round_mid_forward(self, most: int, q: int, prompt: bool) -> None:
        """A keep-set shared by all layers is scored from every layer's candidates when the first layer reaches the
        round; in a forward of more than ``recent`` tokens the later layers do not hold them yet. ``most``: the real
        pairs the first layer stores after this forward of ``q`` tokens (``prompt``: the prefill). Called before the
        first layer stores anything (an unprotected prompt longer than ``T + r`` is the common case)."""
        if q <= self.recent or not self.due(most):
            return
        what = f"an unprotected prompt of {q} tokens" if prompt else f"a forward of {q} tokens"
        raise ValueError(
            f"policy {self.policy.name!r} scores all layers at once when the first layer reaches a round, but "
            f"{what} reaches one (at T + r = {self.budget + self.buffer} pairs) before the later layers hold its "
            f"candidates (only a forward of at most recent={self.recent} tokens can); protect the prompt, raise the "
            f"budget above the prompt, feed at most {self.recent} tokens per forward, or use its per-layer variant "
            f"(shared_layers=False)")

    def _checked_scores(self, view: CacheView) -> torch.Tensor:
        scores = self._run_policy(lambda: self.policy.score(view), [view],
                                  f"layer {view.layer_idx}, round {view.round_idx}")
        return self._check_shape(view, scores)

    def _run_policy(self, call: Callable, views: list, where: str):
        shown = [(v, name, getattr(v, name)) for v in views for name in self._SHOWN]
        shown = [(v, name, t) for v, name, t in shown if torch.is_tensor(t)]
        versions = [None if t.is_inference() else t._version for _, _, t in shown]
        fix = "a policy must not modify the tensors it is shown (clone first, e.g. view.{}.clone())"
        try:
            if None in versions:
                with torch.inference_mode(False), torch.no_grad():
                    out = call()
            else:
                out = call()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # sys.exit() or another BaseException from inside a policy is its failure too
            if isinstance(exc, SystemExit):
                raise RuntimeError(f"policy {self.policy.name!r} failed at {where}: it called sys.exit({exc.code!r}); "
                                   f"a policy must return scores or raise") from exc
            if "Inplace update to inference tensor" in str(exc):
                names = ", ".join(f"view.{name}" for name in self._SHOWN)
                raise RuntimeError(f"policy {self.policy.name!r} wrote into one of the tensors it is shown ({names}) "
                                   f"at {where}; {fix.format('keys')}") from None
            raise RuntimeError(f"policy {self.policy.name!r} failed at {where}: {type(exc).__name__}: {exc}") from exc
        for (view, name, t), before in zip(shown, versions):
            if before is not None and t._version != before:
                raise RuntimeError(f"policy {self.policy.name!r} wrote into view.{name} at layer {view.layer_idx}, "
                                   f"round {view.round_idx}; {fix.format(name)}")
        return out

    def _check_shape(self, view: CacheView, scores) -> torch.Tensor:
        where = f"at layer {view.layer_idx}, round {view.round_idx}"
        if not torch.is_tensor(scores):
            raise TypeError(f"policy {self.policy.name!r} returned {type(scores).__name__} {where}; expected a Tensor "
                            f"shaped {view.shape}")
        try:
            scores = torch.broadcast_to(scores, view.shape)
        except RuntimeError:
            raise ValueError(
                f"policy {self.policy.name!r} returned scores shaped {tuple(scores.shape)}; expected [B, H_kv, S] = "
                f"{list(view.shape)} (or broadcastable to it)"
            ) from None
        if scores.device != view.positions.device:  # a meta or other-device tensor fails deep inside torch otherwise
            raise ValueError(f"policy {self.policy.name!r} returned scores on device {scores.device} {where}; the "
                             f"cache is on {view.positions.device}: create them there (device=view.keys.device)")
        if scores.is_complex():  # a cast to float32 would drop the imaginary part with only torch's warning
            raise ValueError(f"policy {self.policy.name!r} returned complex scores ({scores.dtype}) {where}; a round "
                             f"ranks real numbers: return a real tensor (e.g. its .abs() or .real, whichever you mean)")
        wide = scores
        scores = scores.to(torch.float32)
        # Rounds rank in float32, where +inf is a pin and -inf a forced eviction: a finite float64 score beyond
        # float32's range would silently become one of them.
        if wide.dtype == torch.float64 and bool((torch.isinf(scores) & torch.isfinite(wide)).any()):
            raise ValueError(f"policy {self.policy.name!r} returned float64 scores {where} that float32 cannot hold "
                             f"(|score| up to {float(wide[torch.isfinite(wide)].abs().max()):.3g}, float32 stops at "
                             f"{torch.finfo(torch.float32).max:.3g}); cast to float32 they would become +inf (pins) or "
                             f"-inf (forced evictions); rescale them (e.g. take a log) or return float32")
        nan, neg, pins = torch.stack([torch.isnan(scores).any().long(), torch.isneginf(scores).any().long(),
                                      torch.isposinf(scores).sum(-1).amax()]).tolist()  # one sync, not three
        if nan:
            raise ValueError(f"policy {self.policy.name!r} returned NaN scores {where}")
        if neg:
            raise ValueError(f"policy {self.policy.name!r} returned -inf scores {where}: the cache marks forced "
                             f"evictions with -inf, so the round would count them as such; return a finite low score "
                             f"(e.g. -1e30), or call cache.force_evict for positions that must go")
        if pins > view.keep:
            raise ValueError(f"{pins} pairs are pinned in one head {where} by the policy's own pins alone (policy "
                             f"{self.policy.name!r} scored them +inf), but a round keeps only T - recent = {view.keep} "
                             f"of the older pairs; pin fewer (+inf marks a pin) or raise the budget")
        return scores
