"""One layer's storage in an :class:`randattn.EvictingCache`: keys, values, absolute positions (and accumulated
attention, recent queries) per slot, in buffers with room for ``T + r`` pairs per head; the HF layer API
(``update``, ``get_mask_sizes``, ``get_seq_length``, row reordering). The layer calls its cache's ``run_round`` when
a round is due (:meth:`randattn.rounds.RoundEngine.due`); the round's decision is :mod:`randattn.rounds`'.

Slots no longer equal positions after a round, so the layer keeps the absolute position of every slot
(``positions[B, H_kv, P]``), reports the absolute length from :meth:`get_seq_length` (HF derives ``position_ids``
from it, so new tokens keep their true positions) and the physical one through :meth:`get_mask_sizes`
(``kv_offset = L - P`` keeps the causal rule exact: every cached slot precedes every new query).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from transformers.cache_utils import CacheLayerMixin

from .rules import SpecError

__all__ = ["EvictingLayer"]


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



class EvictingLayer(CacheLayerMixin):
    """One layer's evicting cache. Created by :class:`EvictingCache`; not used on its own."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, parent, layer_idx: int):  # parent: the randattn.EvictingCache (which imports this module)
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
            due = [row for row, n in enumerate(self.held) if p.engine.due(n)]
            if due:
                p.run_round(self, rows=due)
        elif p.engine.due(keys.shape[-2]):
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
