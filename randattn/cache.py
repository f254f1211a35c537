"""The evicting KV cache: periodic ``(T, r)`` eviction per layer and per KV head, as the paper's engine.

HF attention modules call ``cache.update(k, v, layer_idx)`` with post-RoPE keys. Each
:class:`EvictingLayer` appends them, returns everything it holds (so this step attends to all of
it, exactly as the mask was sized), and, when it holds ``T + r`` pairs or more, runs an eviction
round on what it *stores*. As in the paper's engine (``kvcompress/engine/cache_utils.py`` of
``SalesforceAIResearch/Random-Attention``), the newest ``recent`` pairs (default ``r``) are no
candidates: they are moved over untouched. Every head keeps its own top ``T - recent`` of the older
pairs by the policy's score, in chronological order, and the rest are freed for good. So right after
a round each head holds exactly ``T`` pairs (``budget``), the newest ``recent`` among them.

Slots no longer equal positions after a round, so the layer keeps the absolute position of every
slot (``positions[B, H_kv, P]``), reports the absolute length from :meth:`get_seq_length` (HF
derives ``position_ids`` from it, so new tokens keep their true positions) and the physical one
through :meth:`get_mask_sizes` (``kv_offset = L - P`` keeps the causal rule exact: every cached
slot precedes every new query).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ._memory import release_free_memory
from .keeplog import KeepLog
from .policies import CacheView, Policy, make_policy_and_mode
from .rules import SpecError, check_scope, check_sizes, prompt_fits_problem, resolve_protection, resolve_recent

__all__ = ["EvictingCache", "EvictingLayer", "round_seed", "select_keep", "ENGINE"]

#: What every result row records as its engine: the paper's (the newest ``recent`` = r pairs never compete,
#: every selector as the paper ran it). Rows written before it lack the key, so they are never resumed into.
ENGINE = "paper"

from .seeding import _check_seed, check_row_key, round_seed, row_round_seed  # noqa: E402  (round_seed re-exported)


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


def _device_memory(device: torch.device) -> Optional[int]:
    """Total bytes of memory on ``device`` (physical RAM for the CPU), or ``None`` when it cannot be told."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            import os

            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError, RuntimeError):
        return None
    return None


# randattn.check_model, handed over by randattn.decoding (randattn.models imports this module, so this module cannot
# import it): the cache runs it on a model it finds serving it without randattn's guards.
_model_check: Optional[Callable] = None


def set_model_check(check: Callable) -> None:
    """The check the cache runs at its first forward on a model randattn does not guard (:func:`randattn.check_model`,
    set when randattn is imported)."""
    global _model_check
    _model_check = check


def _layers_and_kv_heads(config) -> "tuple[Optional[int], Optional[int]]":
    """``(layers, KV heads)`` of a decoder config, each ``None`` when the config does not say it as one int."""
    text = config.get_text_config(decoder=True)
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
    as_int = lambda v: int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None  # noqa: E731
    return as_int(layers), as_int(heads)


@dataclass(frozen=True)
class _KeepRule:
    positions: torch.Tensor  # 1-D int64, CPU
    layers: Optional[frozenset]
    heads: Optional[frozenset]
    pin: bool  # True: keep no matter what; False: force-evict at the next round


class EvictingLayer(CacheLayerMixin):
    """One layer's evicting cache. Created by :class:`EvictingCache`; not used on its own."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, parent: "EvictingCache", layer_idx: int):
        super().__init__()
        self.parent = parent
        self.layer_idx = layer_idx
        self.positions: Optional[torch.Tensor] = None
        self.attention: Optional[torch.Tensor] = None  # accumulated attention received, [B, H_q, P]
        self._buf: dict[str, torch.Tensor] = {}  # buffers behind the keys/values/positions/attention views
        self.seq_len = 0  # absolute length L seen by this layer
        self.rounds = 0  # eviction rounds applied to this layer (the cache's ``events`` lists them per layer)
        self.round_lengths: list[int] = []  # seq_len at each applied round (per-row accounting in batched runs)
        # A padded batch (the cache knows its left padding): each row holds its own count of real pairs, right-aligned
        # in the slots, with dead slots (position -1) on its left, and runs its rounds when *it* holds T + r, as it
        # would alone. None for an unpadded batch, whose rows always hold the same pairs count.
        self.held: Optional[list[int]] = None
        self.row_rounds: list[int] = []  # rounds applied to each row (padded batch)
        self.row_round_lengths: list[list[int]] = []  # each row's own length at each of its rounds (padded batch)
        # Recent post-RoPE queries for attention-based policies (filled by randattn.capture).
        self.recent_queries: Optional[torch.Tensor] = None  # [B, H_q, <=w, D]
        self.recent_query_positions: Optional[torch.Tensor] = None  # [<=w]
        self._step_queries: Optional[torch.Tensor] = None  # this forward's queries, for accumulation
        self.scaling: Optional[float] = None

    # -- storage ------------------------------------------------------------------------------
    # Every per-slot tensor (keys, values, positions, and accumulated attention when a policy asks
    # for it) is a view of the first P slots of a buffer with room for K + r, so a decode step writes
    # only its new pair instead of copying the whole cache (as torch.cat would). A round gathers into
    # fresh buffers, so the views already handed to attention stay intact.
    _SLOT_FIELDS = ("keys", "values", "positions", "attention")

    def _store(self, **fields: torch.Tensor) -> None:
        n = fields["keys"].shape[2]
        room = max(n, self.parent.budget + self.parent.buffer)
        self._buf = {}
        for name, t in fields.items():
            if t is None:
                continue
            buf = t.new_empty((*t.shape[:2], room, *t.shape[3:]))
            buf[:, :, :n] = t
            self._buf[name] = buf
        self._views(n)

    def _views(self, n: int) -> None:
        for name in self._SLOT_FIELDS:
            buf = self._buf.get(name)
            setattr(self, name, None if buf is None else buf[:, :, :n])

    def _slot_tensors(self) -> dict:
        return {name: getattr(self, name) for name in self._SLOT_FIELDS if getattr(self, name) is not None}

    def _write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``q`` new pairs into the room after slot ``start`` (the common decode step: no allocation)."""
        buf, q = self._buf, keys.shape[2]
        buf["keys"][:, :, start : start + q] = keys
        buf["values"][:, :, start : start + q] = values
        if self.held is not None:
            buf["positions"][:, :, start : start + q] = self._new_positions(*keys.shape[:2], q, buf["positions"].device)
        elif q == 1:  # one decode step: a scalar fill, no index tensor
            buf["positions"][:, :, start] = self.seq_len
        else:
            buf["positions"][:, :, start : start + q] = torch.arange(self.seq_len, self.seq_len + q,
                                                                     device=buf["positions"].device)
        if "attention" in buf:
            buf["attention"][:, :, start : start + q] = 0
        self._views(start + q)

    def _grow(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append a prefill or chunk longer than the room left: one concatenation into a larger buffer."""
        b, h, q, _ = keys.shape
        positions = self._new_positions(b, h, q, self.positions.device)
        new = dict(keys=keys, values=values, positions=positions)
        if self.attention is not None:
            new["attention"] = torch.zeros((b, self.attention.shape[1], q), dtype=torch.float32, device=keys.device)
        old = self._slot_tensors()
        self._store(**{k: torch.cat([old[k], t], dim=2) for k, t in new.items()})

    def _new_positions(self, b: int, h: int, q: int, device) -> torch.Tensor:
        """Positions ``[B, H, q]`` of the next ``q`` pairs: absolute, or in a padded batch each row's own (its first
        real token at 0; its padding at -1, a dead slot)."""
        pos = torch.arange(self.seq_len, self.seq_len + q, device=device)
        if self.held is None:
            return pos.expand(b, h, q)
        rel = (pos[None, :] - self.parent._pads_on(device)[:, None]).clamp_min(-1)
        return rel[:, None, :].expand(b, h, q)

    def keep_slots(self, kept: torch.Tensor) -> None:
        """Keep slots ``kept[B, H_kv, T]`` (sorted) of every per-slot tensor; the rest are freed."""
        fields = {}
        for name, t in self._slot_tensors().items():
            idx = kept if t.shape[1] == kept.shape[1] else kept.repeat_interleave(t.shape[1] // kept.shape[1], dim=1)
            if t.dim() == 4:
                idx = idx[..., None].expand(-1, -1, -1, t.shape[-1])
            fields[name] = idx
        if any(t.requires_grad for t in self._slot_tensors().values()) and torch.is_grad_enabled():
            self._store(**{name: torch.gather(getattr(self, name), 2, idx) for name, idx in fields.items()})
            return
        # Gather straight into fresh buffers with room for K + r: one copy of the kept pairs per round, not a gather
        # and then a copy into the buffer (out= does not record autograd, hence the branch above).
        n, room = kept.shape[-1], max(kept.shape[-1], self.parent.budget + self.parent.buffer)
        bufs = {}
        for name, idx in fields.items():
            t = getattr(self, name)
            bufs[name] = t.new_empty((*t.shape[:2], room, *t.shape[3:]))
            torch.gather(t, 2, idx, out=bufs[name][:, :, :n])
        self._buf = bufs
        self._views(n)

    # -- HF layer API -------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        fields = dict(
            keys=key_states.new_empty((b, h, 0, d)),
            values=value_states.new_empty((b, h, 0, value_states.shape[-1])),
            positions=torch.empty((b, h, 0), dtype=torch.long, device=key_states.device),
        )
        if self.parent.needs_attention:
            hq = self._step_queries.shape[1] if self._step_queries is not None else h
            fields["attention"] = torch.zeros((b, hq, 0), dtype=torch.float32, device=key_states.device)
        self._refuse_unallocatable_room(fields)
        if self.parent.pads is not None:
            if len(self.parent.pads) != b:
                raise ValueError(f"the padding the cache was told covers {len(self.parent.pads)} rows but layer "
                                 f"{self.layer_idx} got a batch of {b}; pass the batch's own attention_mask")
            self.held, self.row_rounds, self.row_round_lengths = [0] * b, [0] * b, [[] for _ in range(b)]
        self._store(**fields)
        self.is_initialized = True

    def _refuse_unallocatable_room(self, fields: dict) -> None:
        """Every layer preallocates room for ``T + r`` pairs per head (:meth:`_store`). A budget whose room for one
        layer exceeds the device's whole memory can never be allocated: refuse it naming the budget, before torch's
        allocator fails deep inside the forward."""
        p = self.parent
        room = p.budget + p.buffer
        need = room * sum(math.prod((*t.shape[:2], *t.shape[3:])) * t.element_size() for t in fields.values())
        total = _device_memory(self.device)
        if total is not None and need > total:
            raise SpecError("budget", f"budget T={p.budget} is too large: each layer preallocates room for T + r = "
                            f"{room:,} pairs per KV head, {need / 2**30:,.1f} GiB for layer {self.layer_idx} alone, "
                            f"more than all the memory of {self.device} ({total / 2**30:,.1f} GiB); a budget above "
                            f"the longest sequence a row reaches (prompt + new tokens) never evicts, so use at most that")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.dim() != 4:
            raise ValueError(
                f"EvictingCache expects keys shaped [batch, kv_heads, tokens, head_dim], got {tuple(key_states.shape)} "
                f"at layer {self.layer_idx}; this architecture does not store per-head KV pairs the cache can evict"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        if self.keys.shape[0] != b or self.keys.shape[1] != h:
            raise ValueError(
                f"layer {self.layer_idx}: cache holds batch={self.keys.shape[0]}, kv_heads={self.keys.shape[1]} "
                f"but got batch={b}, kv_heads={h}; use a fresh EvictingCache per batch"
            )
        start = self.keys.shape[2]
        if start + q <= self._buf["keys"].shape[2]:
            self._write(start, key_states, value_states)
        else:
            self._grow(key_states, value_states)
        self.seq_len += q
        if self.attention is not None:
            self._accumulate_attention()
        keys, values = self.keys, self.values
        p = self.parent
        if self.held is not None:
            before = self.seq_len - q
            for row, pad in enumerate(p.pads):  # the real (non-padding) pairs among the new ones
                self.held[row] += max(0, self.seq_len - max(before, pad))
            due = [row for row, n in enumerate(self.held) if n >= p.budget + p.buffer]
            if due:
                p.run_round(self, rows=due)
        elif keys.shape[-2] >= p.budget + p.buffer:
            p.run_round(self)
        # This step attends to everything, as get_mask_sizes promised; the round only shrinks what is stored.
        return keys, values

    def _accumulate_attention(self) -> None:
        """Add this forward's attention probabilities (per query head, summed over its queries) to
        every slot's running total: H2O's "attention received"."""
        q = self._step_queries
        if q is None:
            raise RuntimeError(
                f"policy {self.parent.policy.name!r} accumulates attention but no queries were captured at layer "
                f"{self.layer_idx}; use randattn.generate/replay/decode_step, or call randattn.install_guards(model)"
            )
        self._step_queries = None
        groups = q.shape[1] // self.keys.shape[1]
        k = self.keys.repeat_interleave(groups, dim=1).to(torch.float32)
        logits = (q.to(torch.float32) @ k.transpose(-1, -2)) * self.scaling  # [B, H_q, n, P]
        q_pos = torch.arange(self.seq_len - q.shape[2], self.seq_len, device=q.device)
        slot_pos = self.positions.repeat_interleave(groups, dim=1)  # [B, H_q, P]
        if self.held is None:
            visible = slot_pos[:, :, None, :] <= q_pos[None, None, :, None]
        else:  # a padded batch: each row's own positions; dead slots and padding queries take no part
            q_pos = q_pos[None, :] - self.parent._pads_on(q.device)[:, None]  # [B, n]
            visible = (slot_pos[:, :, None, :] >= 0) & (slot_pos[:, :, None, :] <= q_pos[:, None, :, None])
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        if self.held is not None:
            probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)  # a padding query sees nothing: no NaN
        self.attention += probs.sum(dim=2)

    def observe_queries(self, q: torch.Tensor, scaling: float, window: int) -> None:
        """Remember the last ``window`` post-RoPE queries (and this step's, for accumulation)."""
        n = q.shape[2]
        pos = torch.arange(self.seq_len, self.seq_len + n, device=q.device)
        if self.recent_queries is None or self.recent_queries.shape[0] != q.shape[0]:
            self.recent_queries, self.recent_query_positions = q[:, :, -window:], pos[-window:]
        else:
            self.recent_queries = torch.cat([self.recent_queries, q], dim=2)[:, :, -window:]
            self.recent_query_positions = torch.cat([self.recent_query_positions, pos])[-window:]
        self.scaling = float(scaling)
        if self.parent.needs_attention:
            self._step_queries = q

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        physical = self.keys.shape[-2] if self.is_initialized else 0
        return physical + query_length, self.seq_len - physical

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_max_length(self) -> int:
        return -1

    @property
    def physical_length(self) -> int:
        """Pairs per head stored now."""
        return self.keys.shape[-2] if self.is_initialized else 0

    def allocated_bytes(self) -> int:
        """Bytes allocated for keys and values (room for T + r pairs per head; positions excluded)."""
        return self._buf["keys"].nbytes + self._buf["values"].nbytes if self.is_initialized else 0

    def reset(self) -> None:
        self.keys = self.values = self.positions = self.attention = None
        self._buf = {}
        self.recent_queries = self.recent_query_positions = self._step_queries = None
        self.is_initialized = False
        self.seq_len = 0
        self.rounds = 0
        self.round_lengths = []
        self.held, self.row_rounds, self.row_round_lengths = None, [], []

    # Beam search and num_return_sequences move whole batch rows; positions and queries move with them.
    def _map_rows(self, fn) -> None:
        if self.held is not None and self.is_initialized:
            raise NotImplementedError("EvictingCache cannot reorder the rows of a padded batch (beam search); use "
                                      "greedy or sampled decoding, or generate the prompts unpadded one at a time")
        if self.is_initialized:
            self._store(**{name: fn(t) for name, t in self._slot_tensors().items()})
        if self.recent_queries is not None:
            self.recent_queries = fn(self.recent_queries)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError(
            "EvictingCache cannot be cropped: evicted pairs are gone, so rolling back tokens (assisted or "
            "speculative decoding, prompt lookup) is not supported. Generate without an assistant model."
        )


class EvictingCache(Cache):
    """A per-KV-head evicting KV cache for HF causal LMs.

    Args:
        policy: a policy name (see :func:`randattn.known_policies`; the paper's mode names such as
            ``"random_pp"`` or ``"attn"`` are accepted too), a :class:`Policy`, or a function
            ``score(view) -> Tensor[B, H_kv, S]`` (higher = keep).
        budget: ``T`` (the paper's ``token_budget``), the pairs every KV head holds right after a
            round, the recent window included.
        buffer: ``r`` (the paper's ``residual_length``), new pairs allowed on top of ``T`` before the
            next round (the paper's engine uses 64).
        recent: the newest pairs of a round that are no candidates and are kept untouched; default
            ``r``, as the paper's engine. ``recent=0`` lets all ``T + r`` pairs compete (an ablation).
            A non-prompt candidate survives one Random round with probability
            ``(T - recent - lp) / (T + r - recent - lp)`` (``(T - r - lp) / (T - lp)`` by default).
        protect_prompt: pin positions ``0..prompt_len-1`` at ``+inf`` (the paper's "+ prompt
            protection" mode). Default ``None``: the mode a paper alias names (``"attn"`` is SnapKV
            score only, ``"attn_pp"`` protected), else ``True``.
        prompt_len: ``l_p``; by default the length of the first forward (the prefill).
        seed: randomness is drawn per (seed, layer, round) in float32 on the cache's device.
        row_keys: one key per batch row (an int in ``[0, 2**64)`` or a string such as a request id): each row then
            draws from its own generator seeded by (seed, row key, layer, round), so a prompt with the same key gets
            the same keep-sets wherever it sits in any batch, padded or not. Default ``None``: one draw per (seed,
            layer, round) for the whole batch, so a row's draw depends on its place in the batch (what every
            shipped result ran). Also settable with :meth:`set_row_keys` before the first forward.
        keep_log: record the kept absolute positions of every head at every round
            (:attr:`keep_log`, a :class:`KeepLog`).
        policy_kwargs: options for a named policy (e.g. ``n_sink=4`` for ``"streamingllm"``).

    Budget semantics: ``T`` is what each head holds right after a round (``T - recent`` selected
    plus the ``recent`` newest) and ``r`` the buffer on top, so the physical cache never exceeds
    ``T + r`` pairs per head (``T + r - 1`` between forwards).
    """

    def __init__(
        self,
        policy: "str | Policy | Callable" = "random",
        *,
        budget: int,
        buffer: int = 64,
        recent: Optional[int] = None,
        protect_prompt: Optional[bool] = None,
        prompt_len: Optional[int] = None,
        seed: int = 0,
        keep_log: bool = False,
        row_keys: Optional[Iterable] = None,
        **policy_kwargs,
    ):
        check_sizes(budget, buffer)
        super().__init__(layers=[])
        # The policy first: a wrong name or option is the error a user wants to see before any budget arithmetic.
        self.policy, native = make_policy_and_mode(policy, **policy_kwargs)
        recent = resolve_recent(budget, buffer, recent)
        if prompt_len is not None and (isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer))
                                       or prompt_len < 0):
            raise ValueError(f"prompt_len must be a non-negative integer or None, got {prompt_len!r}")
        seed = _check_seed(seed)
        protect = resolve_protection(policy, self.policy, native, protect_prompt)
        self.budget = int(budget)
        self.buffer = int(buffer)
        self.recent = int(recent)
        self.protect_prompt = protect
        self._init_prompt_len: Optional[int] = None if prompt_len is None else int(prompt_len)
        self.prompt_len: Optional[int] = self._init_prompt_len
        self.seed = int(seed)
        self._keep_log_on = bool(keep_log)
        self.keep_log: Optional[KeepLog] = KeepLog(recent=self.recent) if keep_log else None
        self.round_seconds = 0.0
        self.sync_timing = False  # set True to synchronise CUDA around rounds for exact timers
        self._rules: list[_KeepRule] = []
        # (layers, KV heads) of the model, once known (told by install_guards' hook before the first forward, or
        # learnt from the forwards): keep-mask rules naming a layer or head outside it are refused.
        self._model_shape: Optional[tuple[Optional[int], Optional[int]]] = None
        self._bound_model = None  # the model bind() last checked the policy against
        self._shared: Optional[tuple] = None  # (seq_len, {round key: per-layer scores}): a policy scored across layers
        needs = set(getattr(self.policy, "needs", ()))
        self.needs_attention = "attention" in needs
        self.needs_queries = bool(needs & {"queries", "attention"})
        # A query window of None means "the queries since the last round" (the paper's buffer of r).
        window = getattr(self.policy, "window", 0)
        self.query_window = self.buffer if window is None else max(int(window or 0), 1)
        check_scope(self.policy, self.recent)
        if self.prompt_len is not None:
            self._check_prompt_fits(self.prompt_len)
        # Padded batches: each row's left padding (None: unpadded), learnt from the prompt's attention mask.
        self.pads: Optional[list[int]] = None
        self._pads_device: Optional[torch.Tensor] = None
        self._mask_told_at: Optional[int] = None  # seq_len at the last forward whose mask a guard handed over
        self.row_keys: Optional[list[int]] = None
        if row_keys is not None:
            self.set_row_keys(row_keys)

    # -- padded batches and row keys ---------------------------------------------------------------
    def set_row_keys(self, keys: Iterable) -> "EvictingCache":
        """One key per batch row (ints in ``[0, 2**64)`` or strings, e.g. request ids): seeded policies then draw
        per (seed, row key, layer, round), independent of the batch. Before the first forward only."""
        if self.get_seq_length():
            raise ValueError("set_row_keys: the cache already holds a sequence; set row keys before the first forward")
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
            raise ValueError(f"row_keys must be a sequence with one key per batch row, got {keys!r}")
        self.row_keys = [check_row_key(k, f"row_keys[{i}]") for i, k in enumerate(keys)]
        if not self.row_keys:
            raise ValueError("row_keys is empty; give one key per batch row")
        return self

    def set_padding(self, attention_mask: torch.Tensor) -> "EvictingCache":
        """Tell the cache which prompt slots are padding: ``attention_mask[B, L]`` of the prompt (1 = token, 0 = pad),
        left padding only. Each row then runs as that prompt would alone: its own positions (first real token at 0,
        in keep-logs and keep-mask pins too), its own prompt protected, its rounds when it holds ``T + r`` real
        pairs, padding never attended, kept or counted. ``randattn.generate``, ``decode_step(attention_mask=...)``
        and a guarded ``model.generate`` call it from the mask they are given."""
        if self.get_seq_length():
            raise ValueError("set_padding: the cache already holds a sequence; tell it the prompt's padding before "
                             "the first forward")
        if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2:
            shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be a 2D [batch, tokens] padding mask (1 = token, 0 = pad), got "
                             f"{shape}; 4D masks are not supported by EvictingCache (slots are not positions once "
                             f"heads evict)")
        if attention_mask.dtype.is_floating_point or attention_mask.is_complex():
            bad = ~((attention_mask == 0) | (attention_mask == 1))
            if bool(bad.any()):
                raise ValueError("attention_mask must hold only 0 (pad) and 1 (token)")
        mask = attention_mask.to(torch.bool).cpu()
        b, n = mask.shape
        real = mask.sum(-1)
        empty = [i for i in range(b) if int(real[i]) == 0]
        if empty:
            raise ValueError(f"attention_mask: rows {empty} are all padding (no token to start from); drop them from "
                             f"the batch")
        pads = n - real
        left = torch.arange(n)[None, :] >= pads[:, None]
        if not torch.equal(left, mask):
            rows = [i for i in range(b) if not torch.equal(left[i], mask[i])]
            raise ValueError(f"attention_mask: rows {rows} are not left-padded (zeros after a token: right padding or "
                             f"holes); EvictingCache supports left padding only: set tokenizer.padding_side = 'left' "
                             f"(what HF generation expects for decoder-only models)")
        if self.row_keys is not None and len(self.row_keys) != b:
            raise ValueError(f"row_keys has {len(self.row_keys)} keys but the batch has {b} rows; give one per row")
        self.pads = [int(x) for x in pads] if bool(pads.any()) else None
        self._pads_device = None
        if self.pads is not None:
            if self._init_prompt_len is not None:
                raise ValueError(f"prompt_len={self._init_prompt_len} with a padded batch: each row's prompt is its "
                                 f"own unpadded prefill; drop prompt_len")
            self._check_prompt_fits(n - min(self.pads))
        return self

    @property
    def prompt_lens(self) -> Optional[list[int]]:
        """Each row's own prompt length (its prefill less its padding), once known."""
        if self.prompt_len is None:
            return None
        return [self.prompt_len - pad for pad in (self.pads or [0] * self._batch_size())]

    def _batch_size(self) -> int:
        return self.layers[0].keys.shape[0] if self.layers and self.layers[0].is_initialized else 1

    def _row_prompt_len(self, row: int) -> int:
        return (self.prompt_len or 0) - (self.pads[row] if self.pads is not None else 0)

    def _pads_on(self, device) -> torch.Tensor:
        if self._pads_device is None or self._pads_device.device != torch.device(device):
            self._pads_device = torch.tensor(self.pads, dtype=torch.long, device=device)
        return self._pads_device

    def forward_attention_mask(self, attention_mask: Optional[torch.Tensor], batch: int, new_tokens: int):
        """The 2D mask a forward of ``new_tokens`` must hand HF for this cache (the guards call it before every
        forward). HF looks a 2D mask up by slot (``kv_offset + slot``), which after per-head eviction in a padded
        batch is not the position; this returns a mask laid out by slot instead: 1 where the row holds a real pair,
        0 on its dead slots. The prompt's forward learns the padding (:meth:`set_padding`). ``attention_mask`` may be
        ``None`` after the prompt (a manual loop): the cache knows its padding."""
        seq = self.get_seq_length()
        self._mask_told_at = seq
        if attention_mask is not None:
            if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2:
                shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
                raise ValueError(f"attention_mask must be a 2D [batch, tokens] padding mask, got {shape}; 4D masks "
                                 f"are not supported by EvictingCache (slots are not positions once heads evict)")
            if tuple(attention_mask.shape) != (batch, seq + new_tokens):
                raise ValueError(f"attention_mask is shaped {tuple(attention_mask.shape)} but this forward needs "
                                 f"[batch, cached + new tokens] = [{batch}, {seq + new_tokens}]")
            if seq == 0:
                self.set_padding(attention_mask)
                return attention_mask  # the prompt's own forward: nothing evicted yet, HF's padding mask is exact
            if not bool(attention_mask[:, -new_tokens:].all()) or (self.pads is None and not bool(attention_mask.all())):
                raise ValueError("attention_mask has padding after the prompt; EvictingCache supports left padding of "
                                 "the prompt only (generated or appended tokens are real)")
        if self.pads is None or seq == 0:
            return attention_mask
        layer = self.layers[0]
        held = torch.tensor(layer.held, dtype=torch.long)
        p = layer.physical_length
        by_slot = torch.zeros((batch, seq + new_tokens), dtype=torch.long)
        by_slot[:, seq - p : seq] = (torch.arange(p)[None, :] >= (p - held)[:, None]).long()
        by_slot[:, seq:] = 1
        device = attention_mask.device if attention_mask is not None else layer.keys.device
        return by_slot.to(device)

    def _refuse_unseen_padding(self, first: bool = False) -> None:
        """A model randattn does not guard builds its mask from the 2D padding mask by slot, which is wrong after a
        round in a padded batch: find the mask the model was given (its forward's ``attention_mask``) and refuse
        padding or a 4D mask before anything is stored. At the first forward (``first``) the model found is also
        checked as the guarded paths check it (:func:`randattn.check_model`: e.g. ALiBi biases over slots)."""
        import sys

        from transformers import PreTrainedModel

        # The whole stack is walked: any depth of wrappers around the attention modules stays in sight. A model
        # seen only where its mask is not (a call frame without it, a compiled forward) is refused, not trusted.
        fix = ("Call randattn.install_guards(model) once (randattn.load_model does), or use randattn.generate / "
               "randattn.decode_step(attention_mask=...); then left-padded batches are exact")
        hidden = None
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if code.co_name in ("forward", "_call_impl", "_wrapped_call_impl"):
                local = frame.f_locals
                model = local.get("self")
                if isinstance(model, PreTrainedModel):
                    kwargs = local.get("kwargs")  # a module call's **kwargs, where the mask may travel
                    if "attention_mask" in code.co_varnames or (isinstance(kwargs, dict) and "attention_mask" in kwargs):
                        if first:
                            self._check_model(model)
                        mask = (local.get("attention_mask") if "attention_mask" in code.co_varnames
                                else kwargs["attention_mask"])
                        if torch.is_tensor(mask) and (mask.dim() != 2 or not bool(mask.all())):
                            what = "a padded batch" if mask.dim() == 2 else f"a {mask.dim()}D attention mask"
                            raise ValueError(
                                f"EvictingCache got {what} on a model randattn does not guard, where HF would map the "
                                f"mask onto cache slots by position (wrong once heads evict different positions). "
                                f"{fix}")
                        return
                    hidden = model
            frame = frame.f_back
        if hidden is not None:
            if first:
                self._check_model(hidden)
            raise ValueError(
                f"EvictingCache cannot see the attention mask of the model it serves ({type(hidden).__name__}, which "
                f"randattn does not guard), so it cannot tell whether a padded batch would be mapped onto cache slots "
                f"by position (wrong once heads evict different positions). {fix}")

    @staticmethod
    def _check_model(model) -> None:
        if _model_check is not None:  # an ALiBi model handed to its own model.generate is refused as load_model does
            _model_check(model)

    def __repr__(self) -> str:
        return (
            f"EvictingCache(policy={self.policy!r}, budget={self.budget}, buffer={self.buffer}, recent={self.recent}, "
            f"protect_prompt={self.protect_prompt}, prompt_len={self.prompt_len}, seed={self.seed}, "
            f"layers={len(self.layers)}, events={self.events})"
        )

    # The cache serves a model but does not own it: a deep copy serves the same model (shared, however the policy
    # refers to it), and a pickle leaves it out (bound again at the next forward); neither copies its weights.
    def __deepcopy__(self, memo: dict) -> "EvictingCache":
        import copy

        if self._bound_model is not None:
            memo.setdefault(id(self._bound_model), self._bound_model)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    def __copy__(self) -> "EvictingCache":  # copy.copy would otherwise go through __getstate__ and drop the model
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self) -> dict:
        import copy

        state = self.__dict__.copy()
        if self._bound_model is not None:
            state["_bound_model"] = None
            state["policy"] = copy.deepcopy(self.policy, {id(self._bound_model): None})  # its model references too
        return state

    def reset(self) -> None:
        """Forget everything a sequence left behind, so the next prompt starts as in a new cache: stored pairs,
        the prompt length (unless given to the constructor), keep-log, keep-mask pins and evictions, timers."""
        self.layers = []
        self.prompt_len = self._init_prompt_len
        self.keep_log = KeepLog(recent=self.recent) if self._keep_log_on else None
        self.round_seconds = 0.0
        self._rules = []
        self._model_shape = None
        self._shared = None
        self.pads, self._pads_device, self._mask_told_at = None, None, None

    # -- HF cache API --------------------------------------------------------------------------
    def _layer(self, layer_idx: int) -> EvictingLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(EvictingLayer(self, len(self.layers)))
        return self.layers[layer_idx]

    def wants_queries(self, layer_idx: int, new_tokens: int) -> bool:
        """Whether a forward of ``new_tokens`` at ``layer_idx`` must hand its queries over (the capture hook
        asks before recomputing them). Accumulated attention needs every step's; a query window only the
        last ``window`` before the next round, which fires when ``K + r`` pairs are stored. Skipping the
        others saves recomputing the queries (~10% of a decode step) without changing any round's input."""
        if not self.needs_queries:
            return False
        if self.needs_attention:
            return True
        stored = self._layer(layer_idx).physical_length
        return stored + new_tokens > self.budget + self.buffer - self.query_window

    def _observe_queries(self, layer_idx: int, queries: torch.Tensor, scaling: float) -> None:
        """Called by the capture hook before the layer's ``update`` (see :mod:`randattn.capture`)."""
        self._layer(layer_idx).observe_queries(queries, scaling, self.query_window)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._rules and (layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized
                            or (layer_idx == 0 and (self._model_shape is None or self._model_shape[0] is None))):
            self._learn_shape(layer_idx, key_states)  # before this layer stores anything of this forward
        layer = self._layer(layer_idx)
        if layer_idx == 0 and self._mask_told_at != layer.seq_len:
            self._refuse_unseen_padding(first=layer.seq_len == 0)
        if layer_idx == 0 and getattr(self.policy, "scope", "layer") == "model":
            self._refuse_shared_round_mid_forward(layer, key_states.shape[-2])
        if layer.seq_len == 0 and self.prompt_len is None:
            self.prompt_len = key_states.shape[-2]
            self._check_prompt_fits(self.prompt_len - (min(self.pads) if self.pads else 0))
        return layer.update(key_states, value_states)

    # -- what happened -------------------------------------------------------------------------
    def restore_layer(self, layer_idx: int, *, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                      seq_len: int, attention: Optional[torch.Tensor] = None, queries: Optional[torch.Tensor] = None,
                      query_positions: Optional[torch.Tensor] = None, scaling: Optional[float] = None) -> EvictingLayer:
        """Replace layer ``layer_idx`` by a fresh one holding this state (slots ``[B, H_kv, S]``, ``seq_len`` tokens
        seen, optionally accumulated attention and recent queries), as a round would find it after many rounds;
        e.g. to time one round (``bench.round_cost``). Lower layers that do not exist yet are created empty."""
        self._layer(layer_idx)
        layer = EvictingLayer(self, layer_idx)
        layer.dtype, layer.device = keys.dtype, keys.device
        layer._store(keys=keys, values=values, positions=positions, attention=attention)
        layer.seq_len = int(seq_len)
        layer.is_initialized = True
        layer.recent_queries, layer.recent_query_positions, layer.scaling = queries, query_positions, scaling
        self.layers[layer_idx] = layer
        self._shared = None  # a model-scope policy's memoised scores belong to the replaced state
        return layer

    @property
    def events(self) -> list[int]:
        """Applied eviction rounds per layer (proof that compression really ran)."""
        return [layer.rounds for layer in self.layers]

    @property
    def total_events(self) -> int:
        return sum(self.events)

    def physical_length(self, layer_idx: int = 0) -> int:
        """Pairs per head stored now in ``layer_idx`` (``<= K + r - 1`` between forwards)."""
        return self.layers[layer_idx].physical_length if layer_idx < len(self.layers) else 0

    def positions(self, layer_idx: int) -> torch.Tensor:
        """Absolute positions stored in a layer, ``[B, H_kv, P]`` (chronological per head)."""
        return self.layers[layer_idx].positions

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values of all layers (room for K + r pairs per head; positions excluded)."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def stats(self) -> dict:
        return {
            "policy": self.policy.name,
            "budget": self.budget,
            "buffer": self.buffer,
            "recent": self.recent,
            "protect_prompt": self.protect_prompt,
            "prompt_len": self.prompt_len,
            "seq_len": self.get_seq_length(),
            "events_per_layer": self.events,
            "round_seconds": self.round_seconds,
            "kv_bytes": self.kv_bytes(),
        }

    # -- keep-mask API ---------------------------------------------------------------------------
    def pin(self, positions: Iterable[int], *, layers: Optional[Iterable[int]] = None, heads: Optional[Iterable[int]] = None) -> None:
        """Keep these absolute positions in the given layers and KV heads (default: all) at every round."""
        self._add_rule(positions, layers, heads, pin=True)

    def force_evict(
        self, positions: Iterable[int], *, layers: Optional[Iterable[int]] = None, heads: Optional[Iterable[int]] = None
    ) -> None:
        """Evict these absolute positions from the given layers and KV heads (default: all) at the next
        round that sees them. Force-eviction overrides pins and prompt protection."""
        self._add_rule(positions, layers, heads, pin=False)

    def clear_keep_masks(self) -> None:
        self._rules.clear()

    def bind(self, model) -> "EvictingCache":
        """Bind to the model this cache serves, before anything is stored: learn its shape (keep-mask pins naming a
        layer or head it lacks are refused) and let the policy check or load its calibration data
        (:meth:`Policy.bind`). Randattn's forward hook calls it at every forward (cheap after the first); call it
        yourself to fail early. Raises ``ValueError`` naming the fix."""
        if self._model_shape is None:
            self._bind_model_shape(*_layers_and_kv_heads(model.config))
        if self._bound_model is not model:
            self.policy.bind(model)
            self._bound_model = model
        return self

    # Out-of-range layers would be ignored and heads caught only at a round: both are refused as soon as the shape
    # is known (at pin time when it is; else before the first forward through install_guards' hook, else at the
    # first update of each layer for heads and at the second forward for layers).
    def _bind_model_shape(self, n_layers: Optional[int], n_heads: Optional[int]) -> None:
        """The model's (layers, KV heads), from its config; checks every keep-mask rule registered so far."""
        shape = (n_layers, n_heads)
        for rule in self._rules:
            self._check_rule_shape(rule, *shape)
        self._model_shape = shape

    def _learn_shape(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """Without the hook: heads from the first keys a layer stores; layers once layer 0 sees a second forward."""
        known_layers, known_heads = self._model_shape or (None, None)
        if known_layers is None and layer_idx == 0 and self.layers and self.layers[0].is_initialized:
            known_layers = len(self.layers)
        heads = key_states.shape[1] if key_states.dim() == 4 else known_heads
        for rule in self._rules:
            self._check_rule_shape(rule, known_layers, heads, layer_idx)
        if known_layers is not None and (self._model_shape is None or self._model_shape[0] is None):
            self._model_shape = (known_layers, known_heads)

    @staticmethod
    def _check_rule_shape(rule: "_KeepRule", n_layers: Optional[int], n_heads: Optional[int],
                          layer_idx: Optional[int] = None) -> None:
        kind = "pin" if rule.pin else "force_evict"
        if n_layers is not None and rule.layers is not None:
            bad = sorted(i for i in rule.layers if i >= n_layers)
            if bad:
                raise ValueError(f"keep-mask {kind}(layers={sorted(rule.layers)}): layers {bad} out of range: the model "
                                 f"has {n_layers} layers, valid indices 0..{n_layers - 1}; remove the rule with "
                                 f"clear_keep_masks() and register it with layers in that range")
        if n_heads is not None and rule.heads is not None and (layer_idx is None or rule.layers is None
                                                              or layer_idx in rule.layers):
            bad = sorted(h for h in rule.heads if h >= n_heads)
            if bad:
                where = "" if layer_idx is None else f" at layer {layer_idx}"
                raise ValueError(f"keep-mask {kind}(heads={sorted(rule.heads)}): heads {bad} out of range: the model has "
                                 f"{n_heads} KV heads{where}, valid indices 0..{n_heads - 1}; remove the rule with "
                                 f"clear_keep_masks() and register it with heads in that range")

    @staticmethod
    def _positions_tensor(positions) -> torch.Tensor:
        """Keep-mask positions as 1-D int64 on the CPU. Only integers: a fraction would be truncated and a bool read
        as position 0 or 1, silently pinning another token, so either is refused naming the value."""
        fix = "pass integer token positions, e.g. range(start, end) or a torch.long tensor"
        if torch.is_tensor(positions) or isinstance(positions, np.ndarray):
            t = torch.as_tensor(positions)
            if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
                raise ValueError(f"positions must be integer token positions, got a {t.dtype} tensor "
                                 f"{t.flatten()[:4].tolist()}; {fix}")
            return t.flatten().to(torch.long).cpu()
        items = list(positions)
        for p in items:
            boolean = isinstance(p, (bool, np.bool_)) or (torch.is_tensor(p) and p.dtype == torch.bool)
            integer = isinstance(p, (int, np.integer)) or (torch.is_tensor(p) and p.numel() == 1 and not (
                p.is_floating_point() or p.is_complex()))
            if boolean or not integer:
                raise ValueError(f"positions must be integer token positions, got {p!r}; {fix}")
        return torch.as_tensor([int(p) for p in items], dtype=torch.long)

    def _add_rule(self, positions, layers, heads, *, pin: bool) -> None:
        pos = self._positions_tensor(positions)
        if pos.numel() and int(pos.min()) < 0:
            raise ValueError(f"positions must be absolute token positions >= 0, got min {int(pos.min())}")
        layers = None if layers is None else list(layers)  # a generator is read once, not once per check
        heads = None if heads is None else list(heads)
        for name, sel in (("layers", layers), ("heads", heads)):
            if sel is not None and any(isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or i < 0
                                       for i in sel):
                raise ValueError(f"{name} must be non-negative integer indices, got {sel!r}")
        rule = _KeepRule(
            positions=pos,
            layers=None if layers is None else frozenset(int(i) for i in layers),
            heads=None if heads is None else frozenset(int(i) for i in heads),
            pin=pin,
        )
        if self._model_shape is not None:
            self._check_rule_shape(rule, *self._model_shape)
        self._rules.append(rule)

    # -- the round -------------------------------------------------------------------------------
    def _check_prompt_fits(self, prompt_len: int) -> None:
        problem = prompt_fits_problem(prompt_len, budget=self.budget, recent=self.recent, protect=self.protect_prompt)
        if problem:
            raise SpecError(problem.field, problem)

    def _rule_masks(self, layer_idx: int, positions: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        pinned = evicted = None
        n_heads = positions.shape[1]
        for rule in self._rules:
            if rule.layers is not None and layer_idx not in rule.layers:
                continue
            hit = torch.isin(positions, rule.positions.to(positions.device))
            if rule.heads is not None:
                bad = [h for h in rule.heads if h >= n_heads]
                if bad:
                    raise ValueError(f"keep-mask heads {sorted(bad)} out of range: the model has {n_heads} KV heads")
                sel = torch.zeros(n_heads, dtype=torch.bool, device=positions.device)
                sel[sorted(rule.heads)] = True
                hit = hit & sel[None, :, None]
            if rule.pin:
                pinned = hit if pinned is None else pinned | hit
            else:
                evicted = hit if evicted is None else evicted | hit
        return pinned, evicted

    def run_round(self, layer: EvictingLayer, rows: Optional[list] = None) -> None:
        """One eviction round of one layer: score the candidates, per-head top-(T - recent), keep the recent
        window, compaction, bookkeeping. The layer calls it when it holds T + r pairs (in a padded batch, with the
        ``rows`` that do)."""
        timed_cuda = self.sync_timing and layer.keys.is_cuda
        if timed_cuda:
            torch.cuda.synchronize(layer.keys.device)
        t0 = time.perf_counter()
        if rows is None:
            layer.keep_slots(self.select(layer))
            if self.keep_log is not None:
                self.keep_log.record(layer.layer_idx, layer.rounds, layer.seq_len, layer.positions)
        else:
            self._round_of_rows(layer, rows)
        layer.rounds += 1
        layer.round_lengths.append(layer.seq_len)
        if layer.layer_idx == 0 and layer.rounds % 16 == 0:
            release_free_memory()  # rounds churn same-sized buffers; keep the heap from fragmenting (see _memory)
        if timed_cuda:
            torch.cuda.synchronize(layer.keys.device)
        self.round_seconds += time.perf_counter() - t0

    def _row_groups(self, layer: EvictingLayer, rows: list) -> list[list[int]]:
        """Rows scored together at a round: one view per row with row keys (each its own generator), else rows in
        the same state (pairs held, rounds, padding), whose candidates line up slot for slot."""
        if self.row_keys is not None:
            return [[row] for row in rows]
        groups: dict = {}
        for row in rows:
            state = (layer.held[row] if layer.held is not None else 0,
                     layer.row_rounds[row] if layer.held is not None else layer.rounds,
                     self.pads[row] if self.pads is not None else 0)
            groups.setdefault(state, []).append(row)
        return list(groups.values())

    def _round_of_rows(self, layer: EvictingLayer, rows: list) -> None:
        """A padded batch's round for the ``rows`` that hold ``T + r`` real pairs: each keeps ``T``, as alone; every
        row stays right-aligned, the shorter ones with dead slots (position -1) on their left."""
        p, b = layer.physical_length, layer.keys.shape[0]
        kept: dict = {}
        for group in self._row_groups(layer, rows):
            offset = p - layer.held[group[0]]
            view = self.view(layer, layer.held[group[0]] - self.recent, rows=group, offset=offset)
            for row, idx in zip(group, self._select_view(layer, view, group, offset) + offset):
                kept[row] = idx
        held = [self.budget if row in kept else n for row, n in enumerate(layer.held)]
        width, heads = max(held), layer.keys.shape[1]
        device = layer.keys.device
        index = []
        for row in range(b):
            src = kept.get(row)
            if src is None:
                src = torch.arange(p - held[row], p, device=device).expand(heads, -1)
            dead = torch.zeros((heads, width - held[row]), dtype=torch.long, device=device)
            index.append(torch.cat([dead, src], dim=-1))
        layer.keep_slots(torch.stack(index))
        for row in range(b):
            if width > held[row]:
                layer.positions[row, :, : width - held[row]] = -1
        layer.held = held
        for row in sorted(kept):
            own_len = layer.seq_len - self.pads[row]
            if self.keep_log is not None:
                self.keep_log.record(layer.layer_idx, layer.row_rounds[row], own_len,
                                     layer.positions[row : row + 1, :, width - self.budget :], row=row)
            layer.row_rounds[row] += 1
            layer.row_round_lengths[row].append(own_len)
        layer.rounds = max(layer.row_rounds) - 1  # run_round adds the one this call applied

    def candidates(self, layer: EvictingLayer) -> int:
        """Slots of ``layer`` that compete at its next round: all but the newest ``recent``."""
        return layer.physical_length - self.recent

    def view(self, layer: EvictingLayer, n_candidates: Optional[int] = None, seq_len: Optional[int] = None, *,
             rows: Optional[list] = None, offset: int = 0) -> CacheView:
        """The read-only view a policy scores at this layer's next round: its candidates only. ``n_candidates``
        and ``seq_len`` describe a round that another layer of the same forward has reached first. ``rows`` (batch
        rows in the same state) and ``offset`` (their first real slot) give one group's view: each row as it would
        be alone, in its own positions, with its own generator when the cache has row keys."""
        n = self.candidates(layer) if n_candidates is None else n_candidates
        gen = torch.Generator(device=layer.keys.device)
        if rows is None:
            sel, pad, round_idx, prompt_len = slice(None), 0, layer.rounds, self.prompt_len or 0
        else:
            sel = slice(rows[0], rows[0] + 1) if len(rows) == 1 else torch.tensor(rows, device=layer.keys.device)
            pad = self.pads[rows[0]] if self.pads is not None else 0
            round_idx = layer.row_rounds[rows[0]] if layer.held is not None else layer.rounds
            prompt_len = self._row_prompt_len(rows[0])
        if rows is not None and self.row_keys is not None:
            gen.manual_seed(row_round_seed(self.seed, self.row_keys[rows[0]], layer.layer_idx, round_idx))
        else:
            gen.manual_seed(round_seed(self.seed, layer.layer_idx, round_idx))
        positions = layer.positions[sel][:, :, offset : offset + n]
        queries = layer.recent_queries
        return CacheView(
            keys=layer.keys[sel][:, :, offset : offset + n],
            values=layer.values[sel][:, :, offset : offset + n],
            positions=positions,
            layer_idx=layer.layer_idx,
            round_idx=round_idx,
            prompt_len=prompt_len,
            seq_len=(layer.seq_len if seq_len is None else seq_len) - pad,
            budget=self.budget,
            buffer=self.buffer,
            generator=gen,
            queries=None if queries is None else queries[sel],
            query_positions=None if layer.recent_query_positions is None else layer.recent_query_positions - pad,
            scaling=layer.scaling,
            attention=None if layer.attention is None else layer.attention[sel][:, :, offset : offset + n],
            recent=self.recent,
            seed=self.seed,
            protect_prompt=self.protect_prompt,
            pinned=self._pinned(layer.layer_idx, positions, prompt_len),
            row_key=self.row_keys[rows[0]] if rows is not None and self.row_keys is not None else None,
        )

    def _pinned(self, layer_idx: int, positions: torch.Tensor, prompt_len: Optional[int] = None) -> Optional[torch.Tensor]:
        pinned, _ = self._rule_masks(layer_idx, positions)
        prompt_len = self.prompt_len if prompt_len is None else prompt_len
        if self.protect_prompt and prompt_len:
            prompt = positions < prompt_len
            pinned = prompt if pinned is None else pinned | prompt
        return pinned

    def _scores(self, layer: EvictingLayer, view: CacheView, rows: Optional[list] = None, offset: int = 0) -> torch.Tensor:
        if getattr(self.policy, "scope", "layer") != "model":
            return self._checked_scores(view)
        # A policy scored across layers (TriAttention's per-head keep-set shared by all layers) is scored once
        # per round, when the first layer reaches it: every layer's candidates are already stored then, since
        # they exclude the newest `recent` pairs, which this forward is still writing into the later layers.
        # Memoised per row group for the forward in progress: a round where several groups are due at once (rows with
        # their own row keys, or padded rows whose rounds coincide) scores each group from every layer's candidates
        # before the first layer compacts, and each later layer must reuse that group's scores, not rescore it from
        # the already-compacted first layer.
        if self._shared is None or self._shared[0] != layer.seq_len:
            self._shared = (layer.seq_len, {})
        memo = self._shared[1]
        key = (view.round_idx, view.shape[-1], None if rows is None else tuple(rows))
        n = view.shape[-1]
        if key not in memo:
            short = [l.layer_idx for l in self.layers if l.physical_length < n + offset]
            if short:
                raise self._shared_round_refusal(short, n)
            views = [view if l is layer else self.view(l, n, layer.seq_len, rows=rows, offset=offset)
                     for l in self.layers]
            scores = self._run_policy(lambda: self.policy.score_layers(views), views, f"round {view.round_idx}")
            if not isinstance(scores, (list, tuple)) or len(scores) != len(views):
                got = f"{len(scores)} score tensors" if isinstance(scores, (list, tuple)) else type(scores).__name__
                raise TypeError(f"policy {self.policy.name!r}: score_layers returned {got} at round {view.round_idx}; "
                                f"expected a list of {len(views)}, one per layer in order")
            memo[key] = [self._check_shape(v, s) for v, s in zip(views, scores)]
        if layer.layer_idx >= len(memo[key]):  # a layer that did not exist yet when the round was scored
            raise self._shared_round_refusal([layer.layer_idx], n)
        return memo[key][layer.layer_idx]

    def _refuse_shared_round_mid_forward(self, layer: EvictingLayer, q: int) -> None:
        """A keep-set shared by all layers is scored from every layer's candidates when the first layer reaches the
        round; in a forward of more than ``recent`` tokens the later layers do not hold them yet. Refused before the
        first layer stores anything (an unprotected prompt longer than ``T + r`` is the common case)."""
        if q <= self.recent:
            return
        most = layer.physical_length + q - (min(self.pads) if self.pads and layer.seq_len == 0 else 0)
        if most < self.budget + self.buffer:
            return
        what = f"an unprotected prompt of {q} tokens" if layer.seq_len == 0 else f"a forward of {q} tokens"
        raise ValueError(
            f"policy {self.policy.name!r} scores all layers at once when the first layer reaches a round, but "
            f"{what} reaches one (at T + r = {self.budget + self.buffer} pairs) before the later layers hold its "
            f"candidates (only a forward of at most recent={self.recent} tokens can); protect the prompt, raise the "
            f"budget above the prompt, feed at most {self.recent} tokens per forward, or use its per-layer variant "
            f"(shared_layers=False)")

    def _shared_round_refusal(self, short: list, n: int) -> ValueError:
        return ValueError(
            f"policy {self.policy.name!r} scores all layers at once, but layers {short} do not hold the "
            f"{n} candidates of this round yet (a round inside a forward of more than recent={self.recent} "
            f"tokens, e.g. an unprotected prefill longer than T + r); use its per-layer variant")

    def select(self, layer: EvictingLayer) -> torch.Tensor:
        """Sorted slot indices ``[B, H_kv, T]`` each head keeps at this layer's round (see :func:`select_keep`)."""
        if self.row_keys is not None:  # each row from its own generator
            if len(self.row_keys) != layer.keys.shape[0]:
                raise ValueError(f"row_keys has {len(self.row_keys)} keys but the batch has {layer.keys.shape[0]} "
                                 f"rows; give one per row")
            return torch.cat([self._select_view(layer, self.view(layer, rows=[row]), [row])
                              for row in range(layer.keys.shape[0])])
        return self._select_view(layer, self.view(layer))

    def _select_view(self, layer: EvictingLayer, view: CacheView, rows: Optional[list] = None, offset: int = 0):
        _, evicted = self._rule_masks(layer.layer_idx, view.positions)
        try:
            return select_keep(self._scores(layer, view, rows, offset), keep=view.keep, recent=self.recent,
                               pinned=view.pinned, evicted=evicted)
        except ValueError as exc:
            raise ValueError(f"layer {layer.layer_idx}: {exc} (T={self.budget}, recent={self.recent})") from None

    def _checked_scores(self, view: CacheView) -> torch.Tensor:
        scores = self._run_policy(lambda: self.policy.score(view), [view],
                                  f"layer {view.layer_idx}, round {view.round_idx}")
        return self._check_shape(view, scores)

    # A policy is shown the cache's own tensors (views of its storage: a copy per round would cost what the round
    # costs), so a write into one would silently change what is kept or attended later. Every in-place write bumps
    # a tensor's version counter: comparing the counters around the call catches it for the price of a few ints.
    # Inference tensors keep no counter; the policy then runs outside inference mode, where torch refuses an in-place
    # write into them. Writes through ``.data`` or ``.numpy()`` escape both.
    _SHOWN = ("keys", "values", "positions", "attention", "pinned", "queries", "query_positions")

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
