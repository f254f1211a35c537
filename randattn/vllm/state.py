"""Per-request eviction state in the vLLM worker, and the step plan the attention backend follows.

One :class:`RequestState` per running request: its prompt length, its row key, and per layer the absolute position
of every stored slot of every KV head, its round count and (for policies that read queries) the last ``w``
post-RoPE queries. The rounds themselves are the HF engine's: each request owns a one-row
:class:`randattn.EvictingCache` (never fed any keys) for its checked settings, policy and :class:`KeepLog`, and a
round hands the request's held slots to that cache's round engine (:meth:`randattn.rounds.RoundEngine.select`,
what the HF cache's own rounds call), which scores the candidates, applies prompt protection and selects the
keep-set. So a policy written for randattn runs here unchanged, with the same seeds (row key = the request key) and
the same refusals.

:func:`plan_step` (called by the runner hook once per step, before vLLM builds the attention metadata) turns
vLLM's absolute bookkeeping into held slots: request ``i`` with ``c`` tokens computed and ``q`` scheduled writes
its new pairs at held slots ``held(c) .. held(c) + q - 1`` of its own blocks and attends to ``held(c) + q`` pairs
(``seq_lens``), while RoPE keeps the absolute positions ``c .. c + q - 1``. :func:`after_attention` (called by the
backend after each layer's attention) then runs that layer's round for every request whose step ends on a round.

Where a chunk may end: at a round, never past one (:func:`randattn.vllm.config.next_round_length`); a chunk that
crosses a round is refused with ``RuntimeError`` (decode one token at a time would have evicted inside it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from ..rounds import Held
from .config import EngineConfig, held_pairs, max_held_pairs, next_round_length
from .keys import KEY_ARG, log_file_name

__all__ = ["RequestState", "StepPlan", "plan_step", "after_attention", "finish", "current", "set_current",
           "requests", "policy_problem", "KEY_ARG"]

_REQUESTS: dict[str, "RequestState"] = {}
_CURRENT: Optional["StepPlan"] = None
#: Seconds this process spent in the plugin's rounds, per phase (``read`` the held pairs, ``score`` and ``select``:
#: the round engine's, ``write`` the compaction, ``accumulate`` H2O's attention pass) and the ``rounds`` run: what
#: bench.vllm reports per arm. CPU clocks (on CUDA they count launches, not kernels).
ROUND_TIMES: dict = {}


def reset_round_times() -> None:
    ROUND_TIMES.clear()
    ROUND_TIMES.update({"read": 0.0, "score": 0.0, "select": 0.0, "write": 0.0, "accumulate": 0.0, "rounds": 0})


reset_round_times()


def policy_problem(cfg: EngineConfig) -> Optional[str]:
    """Why the configured policy cannot run inside vLLM, or None."""
    pol = cfg.spec.policy_object
    needs = set(getattr(pol, "needs", ()))
    option = getattr(pol, "calibration", None)
    if option and getattr(pol, option, None) is None:
        # The HF cache finds a model's shipped statistics through the HF model object; the worker has a vLLM model.
        return (f"policy {pol.name!r} needs per-model calibration statistics and none were given: pass them in its "
                f"options, e.g. {{'options': {{'{option}': 'smollm2-135m'}}}} (a shipped name) or a file from "
                "`python -m randattn.calibrate`")
    unknown = needs - {"queries", "attention"}
    if unknown:
        return f"policy {pol.name!r} needs {sorted(unknown)}, which the plugin cannot give it"
    return None


@dataclass
class _Layer:
    positions: torch.Tensor  # [H_kv, capacity] int64: absolute position of every held slot below `filled`
    rounds: int = 0
    # Slots [filled, held) were appended one token per position since the last round, so their positions are the
    # held count's last absolute positions: _round writes them then, not every step (that cost more than the rounds).
    filled: int = 0
    queries: Optional[torch.Tensor] = None  # [1, H_q, <=w, D], the last w post-RoPE queries
    query_positions: Optional[torch.Tensor] = None  # [<=w]
    attention: Optional[torch.Tensor] = None  # [1, H_q, capacity] float32: attention each held slot received (H2O)


@dataclass
class RequestState:
    """One request's eviction state (in the worker)."""

    req_id: str
    key: "int | str"
    prompt_len: int
    cfg: EngineConfig
    cache: object  # a one-row EvictingCache: the policy, the selection and the keep-log of the HF engine
    computed: int = 0  # tokens processed so far (vLLM's num_computed_tokens after the last planned step)
    max_len: Optional[int] = None  # prompt + max_tokens, when known: the keep-log is written after its last forward
    layers: dict = field(default_factory=dict)
    logged: int = 0  # keep-log records already written
    log_name: Optional[str] = None  # the keep-log's file in keep_log_dir (randattn.vllm.keys.log_file_name)

    @classmethod
    def new(cls, req_id: str, key, prompt_len: int, cfg: EngineConfig, max_len: Optional[int] = None,
            log_name: Optional[str] = None):
        cache = cfg.spec.make_cache(keep_log=cfg.keep_log_dir is not None, row_keys=[key], prompt_len=prompt_len)
        cache.engine.times = ROUND_TIMES
        return cls(req_id=req_id, key=key, prompt_len=int(prompt_len), cfg=cfg, cache=cache, max_len=max_len,
                   log_name=log_name or log_file_name(key))

    def save_keep_log(self) -> None:
        """Write the keep-log to ``keep_log_dir/<log_name>`` (when set and changed since the last write)."""
        log, log_dir = self.cache.keep_log, self.cfg.keep_log_dir
        if log_dir is None or log is None or (self.logged == len(log) and self.logged):
            return
        os.makedirs(log_dir, exist_ok=True)
        log.save(os.path.join(log_dir, self.log_name))
        self.logged = len(log)

    def layer(self, idx: int, heads: int, device) -> _Layer:
        st = self.layers.get(idx)
        if st is None:
            cap = max_held_pairs(self.prompt_len, self.cfg)
            st = self.layers[idx] = _Layer(positions=torch.full((heads, cap), -1, dtype=torch.long, device=device))
        return st


@dataclass
class _Row:
    req: RequestState
    q_start: int  # first token of this request in the step's flattened batch
    q: int  # tokens scheduled this step
    abs_start: int  # absolute position of the first of them (num_computed_tokens)
    slot_start: int  # held slot the first of them is written to
    blocks: np.ndarray  # the request's block ids (its block-table row)
    round_after: bool  # this step ends on a round
    last: bool = False  # this step's forward is the request's last (prompt + max_tokens - 1 tokens in)


@dataclass
class StepPlan:
    rows: list
    block_size: int
    num_layers: int
    work: list = field(default_factory=list)  # the rows after_attention has anything to do for (most steps: none)


def requests() -> dict:
    """The live request states (read-only use: tests and the scheduler's accounting)."""
    return _REQUESTS


def current() -> Optional[StepPlan]:
    return _CURRENT


def set_current(plan: Optional[StepPlan]) -> None:
    global _CURRENT
    _CURRENT = plan


def plan_step(cfg: EngineConfig, *, req_ids: list, computed: np.ndarray, scheduled: list, prompt_lens: list,
              keys: list, max_lens: list, query_start: np.ndarray, block_rows: np.ndarray, block_size: int,
              num_layers: int, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
              log_names: Optional[list] = None) -> StepPlan:
    """Plan one step and rewrite vLLM's ``seq_lens[:n]`` and ``slot_mapping`` in place to held slots.

    ``keys[i]``: request ``i``'s key (:func:`randattn.vllm.keys.request_key`); ``log_names[i]``: its keep-log file
    name (default :func:`randattn.vllm.keys.log_file_name` of the key)."""
    rows = []
    slots = []
    for i, rid in enumerate(req_ids):
        c, q, p = int(computed[i]), int(scheduled[i]), int(prompt_lens[i])
        st = _REQUESTS.get(rid)
        if c == 0:  # a new request, or one preempted and recomputed from its first token
            st = _REQUESTS[rid] = RequestState.new(rid, keys[i], p, cfg, max_lens[i],
                                                   None if log_names is None else log_names[i])
        elif st is None or c != st.computed:
            raise RuntimeError(
                f"randattn.vllm: request {rid!r} resumes at token {c} but its eviction state is at "
                f"{0 if st is None else st.computed}; "
                "only a recompute from the first token can rebuild evicted pairs (prefix caching or a KV connector "
                "restoring blocks cannot): disable them")
        end = next_round_length(p, c, cfg)
        if c + q > end:
            raise RuntimeError(
                f"randattn.vllm: request {rid!r} got a chunk of {q} tokens from position {c}, which crosses the "
                f"eviction round at length {end} (decoding one token at a time would evict there, inside the chunk); "
                "a chunk must end at a round: use the plugin's scheduler (randattn.vllm.scheduler) or smaller "
                "chunks (max_num_batched_tokens)")
        start = held_pairs(p, c, cfg)
        blocks = block_rows[i]
        logical = np.arange(start, start + q)
        slots.append(blocks[logical // block_size].astype(np.int64) * block_size + logical % block_size)
        seq_lens[i] = start + q
        rows.append(_Row(req=st, q_start=int(query_start[i]), q=q, abs_start=c, slot_start=start, blocks=blocks,
                         round_after=(c + q == end), last=st.max_len is not None and c + q >= st.max_len - 1))
        st.computed = c + q
    if slots:
        flat = np.concatenate(slots)
        slot_mapping[: len(flat)].copy_(torch.from_numpy(flat).to(slot_mapping.dtype))
    work = [r for r in rows if r.round_after or r.last or r.req.cache.needs_queries]
    return StepPlan(rows=rows, block_size=block_size, num_layers=num_layers, work=work)


def after_attention(plan: StepPlan, layer_idx: int, query: torch.Tensor, scale: float, kv_heads: int,
                    read: Callable, write: Callable, read_layer: Optional[Callable] = None) -> None:
    """One layer's bookkeeping after its attention: buffer queries, run rounds, write finished keep-logs.

    ``query``: ``[tokens, H_q, D]`` post-RoPE; ``read(blocks, n) -> (K, V)`` each ``[H_kv, n, D]``, the first
    ``n`` held slots of a request; ``write(blocks, K, V)`` stores ``[H_kv, n, D]`` into its first ``n`` slots.
    ``read_layer(i)``: layer ``i``'s ``read``, for a policy scored across layers (TriAttention's shared keep-set).
    Only ``plan.work`` is visited: a row that neither buffers queries nor ends on a round has nothing to record
    (its new slots' positions are filled at the next round, ``_Layer.filled``)."""
    for row in plan.work:
        st = row.req
        cache = st.cache
        lay = st.layer(layer_idx, kv_heads, query.device)
        if cache.needs_queries:
            new_pos = torch.arange(row.abs_start, row.abs_start + row.q, device=lay.positions.device)
            q = query[row.q_start : row.q_start + row.q].transpose(0, 1)[None]  # [1, H_q, q, D]
            w = cache.query_window
            if lay.queries is None:
                lay.queries, lay.query_positions = q[:, :, -w:].clone(), new_pos[-w:].clone()
            else:
                lay.queries = torch.cat([lay.queries, q], dim=2)[:, :, -w:].clone()
                lay.query_positions = torch.cat([lay.query_positions, new_pos])[-w:].clone()
        if cache.needs_attention:
            _accumulate(row, lay, query, scale, read)
        if row.round_after:
            _round(row, lay, layer_idx, scale, read, write, plan.num_layers, read_layer)
        if row.last and layer_idx == plan.num_layers - 1:
            # vLLM tells the worker a request finished only in the next step, which may never come: write now.
            st.save_keep_log()


def _fill_positions(row: _Row, lay: _Layer) -> int:
    """Write the positions of slots ``[filled, n)`` (the last ``n - filled`` absolute positions, ``_Layer.filled``)
    and return ``n``, the slots held after this step."""
    n = row.slot_start + row.q
    seq_len = row.abs_start + row.q
    lay.positions[:, lay.filled : n] = torch.arange(seq_len - n + lay.filled, seq_len, device=lay.positions.device)
    lay.filled = n
    return n


def _accumulate(row: _Row, lay: _Layer, query: torch.Tensor, scale: float, read: Callable) -> None:
    """H2O's "attention received", as the HF layer accumulates it (``EvictingLayer._accumulate_attention``): this
    step's queries of the request, softmax over its held slots (this step's included) in float32 with the causal
    rule, summed over the queries and added to every slot's total. vLLM's kernel returns no probabilities, so they
    are recomputed from the held keys: one more pass over the request's pairs per layer and step."""
    t0 = time.perf_counter()
    n = _fill_positions(row, lay)
    keys, _ = read(row.blocks, n)  # [H_kv, n, D]
    q = query[row.q_start : row.q_start + row.q].transpose(0, 1)[None]  # [1, H_q, q, D]
    groups = q.shape[1] // keys.shape[0]
    k = keys[None].repeat_interleave(groups, dim=1).to(torch.float32)
    logits = (q.to(torch.float32) @ k.transpose(-1, -2)) * scale  # [1, H_q, q, n]
    seq_len = row.abs_start + row.q
    q_pos = torch.arange(seq_len - row.q, seq_len, device=q.device)
    slot_pos = lay.positions[None, :, :n].repeat_interleave(groups, dim=1)  # [1, H_q, n]
    visible = slot_pos[:, :, None, :] <= q_pos[None, None, :, None]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    if lay.attention is None:
        lay.attention = torch.zeros((1, q.shape[1], lay.positions.shape[1]), dtype=torch.float32, device=q.device)
    # The HF engine adds one forward's sum at a time: the prompt's at once, then one generated token per forward. A
    # chunk of generated tokens (vLLM's recompute after a preemption) is added token by token in that order, so the
    # float32 totals, and the near-ties they decide, do not depend on how vLLM chunked the request.
    in_prompt = max(0, min(row.q, row.req.prompt_len - row.abs_start))
    if in_prompt:
        lay.attention[:, :, :n] += probs[:, :, :in_prompt].sum(dim=2)
    for t in range(in_prompt, row.q):
        lay.attention[:, :, :n] += probs[:, :, t]
    ROUND_TIMES["accumulate"] += time.perf_counter() - t0


def _layer_views(row: _Row, layer_idx: int, view, num_layers: int, read_layer: Optional[Callable]) -> Callable:
    """Every layer's view of this round, for a policy scored across layers, as the HF cache builds them when its
    first layer reaches the round: the same ``n`` candidates of each layer. In vLLM's layer-by-layer forward the
    later layers have not written this step's pairs yet, but the candidates exclude the newest ``recent`` slots, so
    (for a step of at most ``recent`` tokens, refused otherwise in :func:`_round`) they are all already there."""
    st, engine = row.req, row.req.cache.engine

    def views() -> list:
        if read_layer is None:
            raise RuntimeError(f"randattn.vllm: policy {engine.policy.name!r} scores all layers at once, but this "
                               "attention backend reads one layer only (read_layer)")
        n, out = view.shape[-1], []
        for i in range(num_layers):
            if i == layer_idx:
                out.append(view)
                continue
            other = st.layer(i, view.keys.shape[1], view.keys.device)
            # slots [filled, n) of layer i are still the last absolute positions before this step
            base = row.abs_start - row.slot_start
            other.positions[:, other.filled : n] = torch.arange(base + other.filled, base + n,
                                                                device=other.positions.device)
            other.filled = max(other.filled, n)
            keys, values = read_layer(i)(row.blocks, n)
            held = Held(layer_idx=i, keys=keys[None], values=values[None], positions=other.positions[None, :, :n],
                        seq_len=view.seq_len, round_idx=other.rounds, prompt_len=st.prompt_len, row_key=view.row_key)
            out.append(engine.view(held, n=n))
        return out

    return views


def _round(row: _Row, lay: _Layer, layer_idx: int, scale: float, read: Callable, write: Callable,
           num_layers: int = 1, read_layer: Optional[Callable] = None) -> None:
    """The HF engine's round on one request's layer: score, protect, select, compact to T, log."""
    st, cache = row.req, row.req.cache
    engine = cache.engine
    seq_len = row.abs_start + row.q
    if engine.shared_scope and row.q > engine.recent:  # the HF cache refuses the same forward before it runs
        engine.refuse_shared_round_mid_forward(row.slot_start + row.q, row.q, prompt=row.abs_start == 0)
    n = _fill_positions(row, lay)
    t0 = time.perf_counter()
    keys, values = read(row.blocks, n)
    ROUND_TIMES["read"] += time.perf_counter() - t0
    positions = lay.positions[:, :n]
    attention = None if lay.attention is None else lay.attention[:, :, :n]
    held = Held(layer_idx=layer_idx, keys=keys[None], values=values[None], positions=positions[None], seq_len=seq_len,
                round_idx=lay.rounds, prompt_len=st.prompt_len, row_key=cache.row_keys[0], queries=lay.queries,
                query_positions=lay.query_positions, scaling=float(scale), attention=attention)
    if engine.shared_scope:
        view = engine.view(held)
        kept = engine.keep(view, forward=seq_len, layer_views=_layer_views(row, layer_idx, view, num_layers,
                                                                          read_layer))[0]
    else:
        kept = engine.select(held)[0]  # [H_kv, T], sorted slot indices
    t0 = time.perf_counter()
    idx = kept[..., None].expand(-1, -1, keys.shape[-1])
    write(row.blocks, torch.gather(keys, 1, idx), torch.gather(values, 1, idx))
    ROUND_TIMES["write"] += time.perf_counter() - t0
    ROUND_TIMES["rounds"] += 1
    new_positions = torch.gather(positions, 1, kept)
    lay.positions[:, : kept.shape[1]] = new_positions
    lay.positions[:, kept.shape[1]:] = -1
    lay.filled = kept.shape[1]
    if attention is not None:  # the kept slots keep their totals (per query head of each KV head), new slots start at 0
        kept_q = kept.repeat_interleave(attention.shape[1] // kept.shape[0], dim=0)[None]
        lay.attention[:, :, : kept.shape[1]] = torch.gather(attention, 2, kept_q)
        lay.attention[:, :, kept.shape[1]:] = 0
    if cache.keep_log is not None:
        cache.keep_log.record(layer_idx, lay.rounds, seq_len, new_positions[None])
    lay.rounds += 1


def finish(req_ids) -> None:
    """Free the state of finished requests (writing their keep-logs when ``keep_log_dir`` is set)."""
    for rid in req_ids:
        st = _REQUESTS.pop(rid, None)
        if st is not None:
            st.save_keep_log()
