"""The attention backend that runs the eviction rounds: vLLM's CPU attention, then each request's round.

:class:`EvictingCPUBackend` replaces ``CPU_ATTN`` (``register_backend``, no vLLM file edited). Its impl runs vLLM's
own kernel on the step's held pairs (the runner hook has already rewritten ``seq_lens`` and ``slot_mapping`` to
held slots, :mod:`randattn.vllm.state`), then hands the layer to :func:`randattn.vllm.state.after_attention`, which
buffers queries (policies that read them) and, for every request whose step ends on a round, scores its candidates
with the randattn policy and compacts every KV head to ``T`` pairs in place, in the request's own blocks. A step
where no request does either skips all of it. Without a
``"randattn"`` config (no step plan) it is vLLM's backend unchanged.

Where a chunk may end: a step's chunk of ``q`` tokens may end at a round (the forward that brings a layer to
``T + r`` pairs, or the end of a prompt of at least ``T + r`` unprotected tokens) and never past one; the round
then runs after this layer's attention, as the HF engine's does after its ``update`` (all ``q`` queries attended
to every pair). A chunk that would cross a round is refused (``RuntimeError``) before the step runs.

The backend-specific part is small: :class:`PagedKV` (reading and writing a request's first ``n`` slots per head)
and the impl's ``forward``. The CPU kernel stores keys in an ISA-specific order inside each (block, head) (keys
transposed for ``vec``); :class:`PagedKV` learns that order once by writing tagged values with vLLM's own
``cpu_attn_reshape_and_cache``, so it follows whatever layout the kernel uses, and refuses one it cannot map.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np
import torch

from . import state

__all__ = ["PagedKV", "layer_index", "layer_kv_cache"]  # EvictingCPUBackend, EvictingCPUImpl: built on first use (they need vLLM)

_LAYOUTS: dict = {}


def layer_index(name: str) -> int:
    """The decoder layer index in an attention layer's name (``model.layers.7.self_attn.attn`` -> 7)."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    if not found:
        raise ValueError(f"randattn.vllm: cannot read a layer index from the attention layer name {name!r}")
    return int(found[0])


def layer_kv_cache(layer_idx: int) -> torch.Tensor:
    """Layer ``layer_idx``'s paged KV cache in the forward in progress (vLLM's forward context): what a policy
    scored across layers reads of the other layers at a round."""
    from vllm.forward_context import get_forward_context

    for name, module in get_forward_context().no_compile_layers.items():
        kv = getattr(module, "kv_cache", None)
        if torch.is_tensor(kv) and kv.numel() and re.findall(r"\.(\d+)\.", f".{name}.")[:1] == [str(layer_idx)]:
            return kv  # the first index in the name is the decoder layer's (layer_index)
    raise RuntimeError(f"randattn.vllm: no KV cache of layer {layer_idx} in the forward context")


def _layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat offsets ``[block_size, D]`` of every (slot, dim) of the keys and of the values inside one (block, head)
    row of ``block_size * 2 * D`` elements, found by writing tagged values through vLLM's kernel."""
    key = (isa, dtype, block_size, head_dim)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    from vllm import _custom_ops as ops

    n = block_size * head_dim
    base = 8  # digits small enough to be exact in bf16/fp16 (tag + 1 <= 9)
    digits = int(np.ceil(np.log(n) / np.log(base))) + 1
    ids = torch.arange(n).view(block_size, 1, head_dim)  # slot-major, one head
    found = {}
    for part in ("k", "v"):
        acc = torch.zeros(block_size * 2 * head_dim, dtype=torch.long)
        where = None
        for d in range(digits):
            tag = ((ids // base**d) % base + 1).to(dtype)
            cache = torch.zeros((1, 1, block_size, 2 * head_dim), dtype=dtype)
            kc, vc = cache.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
            zeros = torch.zeros_like(tag)
            k, v = (tag, zeros) if part == "k" else (zeros, tag)
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(block_size), isa, k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype="auto")
            flat = cache.view(-1).to(torch.float32)
            hit = flat != 0
            where = hit if where is None else where
            if not torch.equal(hit, where):
                raise RuntimeError(f"randattn.vllm: the CPU KV layout (isa {isa!r}, {dtype}) is not a fixed placement "
                                   "per slot; this kernel is not supported")
            acc[hit] += (flat[hit].round().long() - 1) * base**d
        offsets = torch.full((n,), -1, dtype=torch.long)
        pos = torch.nonzero(where).view(-1)
        if pos.numel() != n or not torch.equal(torch.sort(acc[pos]).values, torch.arange(n)):
            raise RuntimeError(f"randattn.vllm: could not map the CPU KV layout (isa {isa!r}, {dtype}, block "
                               f"{block_size}, head_dim {head_dim}); this kernel is not supported")
        offsets[acc[pos]] = pos
        found[part] = offsets.view(block_size, head_dim)
    _LAYOUTS[key] = (found["k"], found["v"])
    return _LAYOUTS[key]


def _block_order(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, inv)`` for one (block, head) row of the layout: ``row[perm]`` is the row in natural order (all
    keys slot-major, then all values: ``[2, block_size, D]`` flattened) and ``natural[inv]`` the kernel's row again.
    Needs the keys and values to tile the row exactly (every layout met so does: ``vec``, ``vec16``)."""
    key = (isa, dtype, block_size, head_dim)
    if key not in _ORDERS:
        k_off, v_off = _layout(isa, dtype, block_size, head_dim)
        perm = torch.cat([k_off.reshape(-1), v_off.reshape(-1)])
        if not torch.equal(torch.sort(perm).values, torch.arange(perm.numel())):
            raise RuntimeError(f"randattn.vllm: the CPU KV layout (isa {isa!r}, {dtype}) leaves gaps in a block (its "
                               "keys and values do not tile it); this kernel is not supported")
        _ORDERS[key] = (perm, torch.argsort(perm))
    return _ORDERS[key]


_ORDERS: dict = {}


class PagedKV:
    """Read and write the first ``n`` held slots of one request, per KV head, in one layer's paged CPU cache
    ``kv_cache[num_blocks, H_kv, block_size, 2 * D]``.

    Both move whole blocks: the request's first ``ceil(n / block_size)`` block rows are taken along dim 0 (one
    ``index_select`` of contiguous rows) and put in natural order by one precomputed permutation of a block's
    ``block_size * 2 * D`` elements (:func:`_block_order`), instead of indexing every (head, slot, dim) with
    broadcast ``[H, n, D]`` index tensors (which cost a round more than its policy did). A write whose ``n`` ends
    inside a block first reads that block back, so the slots past ``n`` keep their bytes."""

    def __init__(self, kv_cache: torch.Tensor, isa: str, head_dim: int):
        self.nb, self.heads, self.block_size, _ = kv_cache.shape
        self.flat = kv_cache.view(self.nb, self.heads, -1)
        self.head_dim = head_dim
        self.perm, self.inv = _block_order(isa, kv_cache.dtype, self.block_size, head_dim)

    def _natural(self, b: torch.Tensor) -> torch.Tensor:
        """The ``m`` blocks ``b`` in natural order: ``[2 (K, V), H, m * block_size, D]``."""
        rows = self.flat.index_select(0, b)  # [m, H, 2 * bs * D], the kernel's order
        rows = torch.gather(rows, 2, self.perm.expand_as(rows))  # natural order (gather: ~8x index_select on dim 2)
        return rows.view(len(b), self.heads, 2, self.block_size, self.head_dim).permute(2, 1, 0, 3, 4).reshape(
            2, self.heads, len(b) * self.block_size, self.head_dim)

    def _blocks(self, blocks: np.ndarray, n: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(blocks[: -(-n // self.block_size)], dtype=np.int64))

    def read(self, blocks: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._natural(self._blocks(blocks, n))[:, :, :n]
        return kv[0].contiguous(), kv[1].contiguous()  # contiguous [H, n, D], as the policies always got them

    def write(self, blocks: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[1]
        b = self._blocks(blocks, n)
        kv = torch.stack([keys.to(self.flat.dtype), values.to(self.flat.dtype)])  # [2, H, n, D]
        tail = len(b) * self.block_size - n
        if tail:  # the last block is shared with slots past n: keep theirs
            kv = torch.cat([kv, self._natural(b[-1:])[:, :, self.block_size - tail:]], dim=2)
        rows = kv.view(2, self.heads, len(b), self.block_size, self.head_dim).permute(2, 1, 0, 3, 4)
        rows = rows.reshape(len(b), self.heads, -1)
        rows = torch.gather(rows, 2, self.inv.expand_as(rows))  # back to the kernel's order
        self.flat.index_copy_(0, b, rows)


def rounds_after(impl, layer, query, kv_cache, attn_metadata, out, decoder, paged_of):
    """What an evicting impl does after vLLM's attention kernel (the CPU one and FlashAttention alike): hand the
    layer to :func:`randattn.vllm.state.after_attention` when the step plan has work for it. ``paged_of(kv_cache)``
    gives the backend's own reader/writer of a layer's cache (:class:`PagedKV`, ``FlashPagedKV``)."""
    plan = state.current()
    if plan is None or not plan.work or attn_metadata is None or impl.attn_type != decoder:
        return out  # most decode steps: no request runs a round or buffers queries
    if impl._layer_idx is None:
        impl._layer_idx = layer_index(getattr(layer, "layer_name", ""))
    paged = paged_of(kv_cache)
    q = query[: attn_metadata.num_actual_tokens].view(-1, impl.num_heads, impl.head_size)
    state.after_attention(plan, impl._layer_idx, q, impl.scale, impl.num_kv_heads, paged.read, paged.write,
                          lambda i: paged_of(layer_kv_cache(i)).read)
    return out


def _cpu_classes():
    """The backend and impl classes, built on first use (vLLM is imported only then)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    class EvictingCPUImpl(CPUAttentionBackendImpl):
        """vLLM's CPU attention, then the eviction rounds of the layer (see the module docstring)."""

        _layer_idx: Optional[int] = None

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                  output_block_scale)
            return rounds_after(self, layer, query, kv_cache, attn_metadata, out, AttentionType.DECODER,
                                lambda kv: PagedKV(kv, layer.isa, self.head_size))

    class EvictingCPUBackend(CPUAttentionBackend):
        """``CPU_ATTN`` with the eviction rounds (vLLM's kernel and metadata builder unchanged)."""

        @staticmethod
        def get_impl_cls():
            return EvictingCPUImpl

    return EvictingCPUBackend, EvictingCPUImpl


_CLASSES: Optional[tuple] = None


def __getattr__(name: str):
    # EvictingCPUBackend / EvictingCPUImpl subclass vLLM classes: built lazily so this module imports without vLLM.
    global _CLASSES
    if name in ("EvictingCPUBackend", "EvictingCPUImpl"):
        if _CLASSES is None:
            _CLASSES = _cpu_classes()
        return _CLASSES[0] if name == "EvictingCPUBackend" else _CLASSES[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
