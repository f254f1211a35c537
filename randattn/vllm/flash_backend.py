"""The CUDA path: vLLM's FlashAttention backend with the eviction rounds (issue 39, item 3).

WRITTEN AND LAYOUT-TESTED ON CPU, NOT YET RUN ON A GPU (``bench/vllm_gpu_check.sh`` is the prepared run).

Why FlashAttention: it is the backend vLLM 0.32 picks for a plain causal decoder on CUDA, and its kernel reads a
request's keys through ``seqused_k`` (the metadata's ``seq_lens``) and its block table, so the held-length rewrite
the runner hook already does for the CPU backend (:func:`randattn.vllm.state.plan_step`: ``seq_lens`` and
``slot_mapping`` in held slots) makes it attend to exactly the held pairs. ``max_seq_len`` stays vLLM's absolute
bound, an upper bound of every held length, which the kernel accepts (it sizes its work, ``seqused_k`` ends each
row). Triton and FlexAttention read the same metadata but are not what vLLM selects by default; wrapping the one it
selects avoids an ``attention_backend=`` override a user would have to know about.

The layout: vLLM 0.32 hands every backend one logical per-layer view ``kv_cache[num_blocks, H_kv, block_size,
2 * D]`` (keys in ``[..., :D]``, values in ``[..., D:]``, as FlashAttention's own ``kv_cache.transpose(1, 2)
.split(D, -1)`` reads it); the physical memory order (``vllm.v1.kv_cache_layout.KVCacheLayout``: blocks x heads x
slots, or blocks x slots x heads, ...) lives in the view's strides. :class:`FlashPagedKV` therefore moves whole
blocks with plain torch ops on that logical view (``index_select`` / ``index_copy_`` along dim 0, slices of the
last dim), which follow any stride order: the same code runs on CPU tensors shaped and strided like the CUDA cache
(``tests/test_vllm_flash_layout.py`` checks it byte for byte against vLLM's own per-slot addressing for every
``KVCacheLayout``), and on the GPU.

Refused on this path: a quantized KV cache (fp8: the round would rank dequantised copies and write back
re-quantised ones, which vLLM's scales do not describe).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import state
from .backend import rounds_after

__all__ = ["FlashPagedKV"]  # EvictingFlashAttentionBackend, EvictingFlashAttentionImpl: built on first use


class FlashPagedKV:
    """Read and write the first ``n`` held slots of one request, per KV head, in one layer's paged cache as
    FlashAttention stores it: the logical view ``kv_cache[num_blocks, H_kv, block_size, 2 * D]``, any physical
    stride order.

    Both move the request's first ``ceil(n / block_size)`` blocks at once (one ``index_select`` / ``index_copy_``
    along the block dimension). A write whose ``n`` ends inside a block first reads that block back, so the slots
    past ``n`` keep their bytes."""

    def __init__(self, kv_cache: torch.Tensor, head_dim: int):
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_dim:
            raise ValueError(f"randattn.vllm: expected a FlashAttention KV cache [num_blocks, kv_heads, block_size, "
                             f"2 * {head_dim}], got {tuple(kv_cache.shape)}")
        self.kv = kv_cache
        self.nb, self.heads, self.block_size, _ = kv_cache.shape
        self.head_dim = head_dim

    def _blocks(self, blocks: np.ndarray, n: int) -> torch.Tensor:
        b = torch.from_numpy(np.asarray(blocks[: -(-n // self.block_size)], dtype=np.int64))
        return b.to(self.kv.device)  # the block table row is a CPU array; the cache may be on the GPU

    def _natural(self, b: torch.Tensor) -> torch.Tensor:
        """The blocks ``b`` as ``[H, len(b) * block_size, 2 * D]``, slots in the request's order."""
        rows = self.kv.index_select(0, b)  # [m, H, bs, 2D], a copy in the view's logical order
        return rows.transpose(0, 1).reshape(self.heads, len(b) * self.block_size, 2 * self.head_dim)

    def read(self, blocks: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._natural(self._blocks(blocks, n))[:, :n]
        d = self.head_dim
        return kv[..., :d].contiguous(), kv[..., d:].contiguous()  # [H, n, D] each

    def write(self, blocks: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[1]
        b = self._blocks(blocks, n)
        kv = torch.cat([keys.to(self.kv.dtype), values.to(self.kv.dtype)], dim=-1)  # [H, n, 2D]
        tail = len(b) * self.block_size - n
        if tail:  # the last block is shared with slots past n: keep theirs
            kv = torch.cat([kv, self._natural(b[-1:])[:, self.block_size - tail:]], dim=1)
        rows = kv.view(self.heads, len(b), self.block_size, 2 * self.head_dim).transpose(0, 1)
        self.kv.index_copy_(0, b, rows)


def _flash_classes():
    """The backend and impl classes, built on first use (they subclass vLLM's)."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

    class EvictingFlashAttentionImpl(FlashAttentionImpl):
        """vLLM's FlashAttention, then the eviction rounds of the layer (as :mod:`randattn.vllm.backend` on CPU)."""

        _layer_idx: Optional[int] = None

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                  output_block_scale)
            if state.current() is not None and str(self.kv_cache_dtype) not in ("auto", "float16", "bfloat16",
                                                                                 "float32"):
                raise RuntimeError(f"randattn.vllm: a quantized KV cache ({self.kv_cache_dtype}) cannot be compacted "
                                   "exactly; drop kv_cache_dtype (vllm serve --kv-cache-dtype auto)")
            return rounds_after(self, layer, query, kv_cache, attn_metadata, out, AttentionType.DECODER,
                                lambda kv: FlashPagedKV(kv, self.head_size))

    class EvictingFlashAttentionBackend(FlashAttentionBackend):
        """``FLASH_ATTN`` with the eviction rounds (vLLM's kernel and metadata builder unchanged)."""

        @staticmethod
        def get_impl_cls():
            return EvictingFlashAttentionImpl

    return EvictingFlashAttentionBackend, EvictingFlashAttentionImpl


_CLASSES: Optional[tuple] = None


def __getattr__(name: str):
    # Built lazily so this module imports without vLLM (the layout class needs only torch).
    global _CLASSES
    if name in ("EvictingFlashAttentionBackend", "EvictingFlashAttentionImpl"):
        if _CLASSES is None:
            _CLASSES = _flash_classes()
        return _CLASSES[0] if name == "EvictingFlashAttentionBackend" else _CLASSES[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
