"""The evicting KV cache: periodic ``(T, r)`` eviction per layer and per KV head, as the paper's engine.

HF attention modules call ``cache.update(k, v, layer_idx)`` with post-RoPE keys. Each
:class:`EvictingLayer` appends them, returns everything it holds (so this step attends to all of
it, exactly as the mask was sized), and, when it holds ``T + r`` pairs or more, runs an eviction
round on what it *stores*. As in the paper's engine (``kvcompress/engine/cache_utils.py`` of
``SalesforceAIResearch/Random-Attention``), the newest ``recent`` pairs (default ``r``) are no
candidates: they are moved over untouched. Every head keeps its own top ``T - recent`` of the older
pairs by the policy's score, in chronological order, and the rest are freed for good. So right after
a round each head holds exactly ``T`` pairs (``budget``), the newest ``recent`` among them.

The cache is the settings' checks, the HF cache API and the bookkeeping of its layers; the rest lives beside it:

- :mod:`randattn.rounds`: the round engine (when a round fires, its view, seeds, scores and keep indices; shared
  with the vLLM plugin), the cache's :attr:`EvictingCache.engine`;
- :mod:`randattn.cache_layer`: one layer's storage (:class:`EvictingLayer`);
- :mod:`randattn.padding`: left-padded batches (each row's padding, the mask by slot, the padded compaction);
- :mod:`randattn.keep_masks`: the ``pin`` / ``force_evict`` rules;
- :mod:`randattn.cache_guards`: refusals about the model served (unguarded padding, ALiBi);
- :mod:`randattn.keeplog`: the keep-log each applied round is recorded in.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from transformers.cache_utils import Cache

from . import cache_guards
from ._memory import release_free_memory
from .cache_guards import set_model_check  # noqa: F401  (randattn.decoding hands the model check over through it)
from .cache_layer import EvictingLayer
from .keep_masks import KeepRule as _KeepRule  # noqa: F401  (the name the cache's rules had)
from .keep_masks import check_rule_shape, make_rule
from .keeplog import KeepLog
from .padding import check_forward_mask, left_pads, mask_by_slot, padded_keep_index
from .policies import CacheView, Policy, make_policy_and_mode
from .rounds import Held, RoundEngine, select_keep
from .rules import SpecError, check_scope, check_sizes, prompt_fits_problem, resolve_protection, resolve_recent
from .seeding import _check_seed, check_row_key, round_seed  # noqa: F401  (round_seed re-exported)

__all__ = ["EvictingCache", "EvictingLayer", "round_seed", "select_keep", "ENGINE"]

#: What every result row records as its engine: the paper's (the newest ``recent`` = r pairs never compete,
#: every selector as the paper ran it). Rows written before it lack the key, so they are never resumed into.
ENGINE = "paper"


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

    # The settings, as the round engine holds them (read-only: a cache's settings are fixed when it is made).
    policy = property(lambda self: self.engine.policy)
    budget = property(lambda self: self.engine.budget)
    buffer = property(lambda self: self.engine.buffer)
    recent = property(lambda self: self.engine.recent)
    protect_prompt = property(lambda self: self.engine.protect_prompt)
    seed = property(lambda self: self.engine.seed)
    needs_attention = property(lambda self: self.engine.needs_attention)
    needs_queries = property(lambda self: self.engine.needs_queries)
    query_window = property(lambda self: self.engine.query_window)

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
        resolved, native = make_policy_and_mode(policy, **policy_kwargs)
        recent = resolve_recent(budget, buffer, recent)
        if prompt_len is not None and (isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer))
                                       or prompt_len < 0):
            raise ValueError(f"prompt_len must be a non-negative integer or None, got {prompt_len!r}")
        seed = _check_seed(seed)
        protect = resolve_protection(policy, resolved, native, protect_prompt)
        # The resolved settings live in the round engine (the cache's budget, policy, ... read them there).
        self.engine = RoundEngine(resolved, budget=budget, buffer=buffer, recent=recent,
                                  protect_prompt=protect, seed=seed)
        self._init_prompt_len: Optional[int] = None if prompt_len is None else int(prompt_len)
        self.prompt_len: Optional[int] = self._init_prompt_len
        self._keep_log_on = bool(keep_log)
        self.keep_log: Optional[KeepLog] = KeepLog(recent=self.recent) if keep_log else None
        self.round_seconds = 0.0
        self.sync_timing = False  # set True to synchronise CUDA around rounds for exact timers
        self._rules: list = []  # keep-mask rules (randattn.keep_masks.KeepRule), in registration order
        # (layers, KV heads) of the model, once known (told by install_guards' hook before the first forward, or
        # learnt from the forwards): keep-mask rules naming a layer or head outside it are refused.
        self._model_shape: Optional[tuple[Optional[int], Optional[int]]] = None
        self._bound_model = None  # the model bind() last checked the policy against
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
        pads = left_pads(attention_mask)
        b, n = len(pads), attention_mask.shape[1]
        if self.row_keys is not None and len(self.row_keys) != b:
            raise ValueError(f"row_keys has {len(self.row_keys)} keys but the batch has {b} rows; give one per row")
        self.pads = pads if any(pads) else None
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
            check_forward_mask(attention_mask, batch, seq, new_tokens)
            if seq == 0:
                self.set_padding(attention_mask)
                return attention_mask  # the prompt's own forward: nothing evicted yet, HF's padding mask is exact
            if not bool(attention_mask[:, -new_tokens:].all()) or (self.pads is None and not bool(attention_mask.all())):
                raise ValueError("attention_mask has padding after the prompt; EvictingCache supports left padding of "
                                 "the prompt only (generated or appended tokens are real)")
        if self.pads is None or seq == 0:
            return attention_mask
        layer = self.layers[0]
        by_slot = mask_by_slot(layer.held, layer.physical_length, batch, seq, new_tokens)
        device = attention_mask.device if attention_mask is not None else layer.keys.device
        return by_slot.to(device)

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
            state["engine"] = engine = copy.copy(self.engine)
            engine.policy = copy.deepcopy(self.policy, {id(self._bound_model): None})  # its model references too
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
        self.engine.forget()
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
        return self.engine.wants_queries(self._layer(layer_idx).physical_length, new_tokens)

    def _observe_queries(self, layer_idx: int, queries: torch.Tensor, scaling: float) -> None:
        """Called by the capture hook before the layer's ``update`` (see :mod:`randattn.capture`)."""
        self._layer(layer_idx).observe_queries(queries, scaling, self.query_window)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._rules and (layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized
                            or (layer_idx == 0 and (self._model_shape is None or self._model_shape[0] is None))):
            self._learn_shape(layer_idx, key_states)  # before this layer stores anything of this forward
        layer = self._layer(layer_idx)
        if layer_idx == 0 and self._mask_told_at != layer.seq_len:
            cache_guards.refuse_unseen_padding(first=layer.seq_len == 0)  # straight from here: it walks the stack
        if layer_idx == 0 and self.engine.shared_scope:
            q = key_states.shape[-2]
            most = layer.physical_length + q - (min(self.pads) if self.pads and layer.seq_len == 0 else 0)
            self.engine.refuse_shared_round_mid_forward(most, q, prompt=layer.seq_len == 0)
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
        self.engine.forget()  # a model-scope policy's memoised scores belong to the replaced state
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
            self._bind_model_shape(*cache_guards.layers_and_kv_heads(model.config))
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
            check_rule_shape(rule, *shape)
        self._model_shape = shape

    def _learn_shape(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """Without the hook: heads from the first keys a layer stores; layers once layer 0 sees a second forward."""
        known_layers, known_heads = self._model_shape or (None, None)
        if known_layers is None and layer_idx == 0 and self.layers and self.layers[0].is_initialized:
            known_layers = len(self.layers)
        heads = key_states.shape[1] if key_states.dim() == 4 else known_heads
        for rule in self._rules:
            check_rule_shape(rule, known_layers, heads, layer_idx)
        if known_layers is not None and (self._model_shape is None or self._model_shape[0] is None):
            self._model_shape = (known_layers, known_heads)

    def _add_rule(self, positions, layers, heads, *, pin: bool) -> None:
        rule = make_rule(positions, layers, heads, pin=pin)
        if self._model_shape is not None:
            check_rule_shape(rule, *self._model_shape)
        self._rules.append(rule)

    # -- the round -------------------------------------------------------------------------------
    def _check_prompt_fits(self, prompt_len: int) -> None:
        problem = prompt_fits_problem(prompt_len, budget=self.budget, recent=self.recent, protect=self.protect_prompt)
        if problem:
            raise SpecError(problem.field, problem)

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
            view = self.view(layer, self.engine.candidates(layer.held[group[0]]), rows=group, offset=offset)
            for row, idx in zip(group, self._keep(layer, view, group, offset) + offset):
                kept[row] = idx
        index, held, width = padded_keep_index(kept, layer.held, self.budget, p, layer.keys.shape[1], layer.keys.device)
        layer.keep_slots(index)
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
        return self.engine.candidates(layer.physical_length)

    def held_of(self, layer: EvictingLayer, seq_len: Optional[int] = None, *, rows: Optional[list] = None,
             offset: int = 0) -> Held:
        """What the round engine reads of ``layer``: all rows, or the ``rows`` of one group (batch rows in the same
        state) from their first real slot ``offset``, each row as it would be alone (its own positions, prompt
        length, round count, and key when the cache has row keys). ``seq_len``: the length of a round another layer
        of the same forward has reached first."""
        if rows is None:
            sel, pad, round_idx, prompt_len = slice(None), 0, layer.rounds, self.prompt_len or 0
        else:
            sel = slice(rows[0], rows[0] + 1) if len(rows) == 1 else torch.tensor(rows, device=layer.keys.device)
            pad = self.pads[rows[0]] if self.pads is not None else 0
            round_idx = layer.row_rounds[rows[0]] if layer.held is not None else layer.rounds
            prompt_len = self._row_prompt_len(rows[0])
        queries = layer.recent_queries
        return Held(
            layer_idx=layer.layer_idx,
            keys=layer.keys[sel],
            values=layer.values[sel],
            positions=layer.positions[sel],
            seq_len=(layer.seq_len if seq_len is None else seq_len) - pad,
            round_idx=round_idx,
            prompt_len=prompt_len,
            offset=offset,
            row_key=self.row_keys[rows[0]] if rows is not None and self.row_keys is not None else None,
            queries=None if queries is None else queries[sel],
            query_positions=None if layer.recent_query_positions is None else layer.recent_query_positions - pad,
            scaling=layer.scaling,
            attention=None if layer.attention is None else layer.attention[sel],
        )

    def view(self, layer: EvictingLayer, n_candidates: Optional[int] = None, seq_len: Optional[int] = None, *,
             rows: Optional[list] = None, offset: int = 0) -> CacheView:
        """The read-only view a policy scores at this layer's next round: its candidates only. ``n_candidates``
        and ``seq_len`` describe a round that another layer of the same forward has reached first. ``rows`` (batch
        rows in the same state) and ``offset`` (their first real slot) give one group's view: each row as it would
        be alone, in its own positions, with its own generator when the cache has row keys."""
        n = self.candidates(layer) if n_candidates is None else n_candidates
        return self.engine.view(self.held_of(layer, seq_len, rows=rows, offset=offset), self._rules, n=n)

    def select(self, layer: EvictingLayer) -> torch.Tensor:
        """Sorted slot indices ``[B, H_kv, T]`` each head keeps at this layer's round (see :func:`select_keep`)."""
        if self.row_keys is not None:  # each row from its own generator
            if len(self.row_keys) != layer.keys.shape[0]:
                raise ValueError(f"row_keys has {len(self.row_keys)} keys but the batch has {layer.keys.shape[0]} "
                                 f"rows; give one per row")
            return torch.cat([self._keep(layer, self.view(layer, rows=[row]), [row])
                              for row in range(layer.keys.shape[0])])
        return self._keep(layer, self.view(layer))

    def _keep(self, layer: EvictingLayer, view: CacheView, rows: Optional[list] = None, offset: int = 0):
        """The engine's keep indices for ``view``; a cross-layer policy is scored from every layer's view of this
        round (built only when the round's scores are not memoised yet)."""
        def layer_views() -> list:
            n = view.shape[-1]
            short = [l.layer_idx for l in self.layers if l.physical_length < n + offset]
            if short:
                raise self.engine.shared_round_refusal(short, n)
            return [view if l is layer else self.view(l, n, layer.seq_len, rows=rows, offset=offset)
                    for l in self.layers]

        return self.engine.keep(view, self._rules, forward=layer.seq_len, group=None if rows is None else tuple(rows),
                                layer_views=layer_views)
