"""The CUDA path's KV layout code (randattn.vllm.flash_backend, issue 39 item 3), run on CPU tensors shaped and
strided exactly like vLLM 0.32's FlashAttention cache, checked against vLLM's own per-slot addressing.

vLLM hands a backend the logical per-layer view ``[num_blocks, H_kv, block_size, 2 * D]``; the physical order is
one of its ``KVCacheLayout`` stride permutations of ``[L, B, H, N, C]`` (``vllm/v1/kv_cache_layout.py``, copied here
as data so the main environment needs no vLLM). FlashAttention reads a slot ``s`` of a request with block row
``blocks`` as ``kv_cache.transpose(1, 2).split(D, -1)[k or v][blocks[s // bs], s % bs, head]``: the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from randattn.vllm import state
from randattn.vllm import config as vcfg
from randattn.vllm.flash_backend import FlashPagedKV

#: vLLM 0.32's KVCacheLayout members: the physical order of the logical [L, B, H, N, C] axes.
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


#: CPU always; CUDA too where a GPU is there (bench/vllm_gpu_check.sh runs this file on one), skipped elsewhere.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def _layer_view(layout: str, layers: int, nb: int, heads: int, bs: int, d: int, dtype, layer: int, seed: int = 0,
                device: str = "cpu"):
    """Layer ``layer``'s logical view [nb, H, bs, 2D] of a cache allocated in ``layout``'s physical order, and the
    physical tensor behind it (to compare every byte)."""
    order = LAYOUTS[layout]
    logical = (layers, nb, heads, bs, 2 * d)
    physical = torch.randn([logical[i] for i in order], generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    view = physical.permute(*np.argsort(order).tolist())  # logical axes again, the strides stay physical
    return view[layer], physical


def _reference(view: torch.Tensor, d: int, blocks: np.ndarray, n: int):
    """FlashAttention's own addressing of the first n slots: (K, V) each [H, n, D], and the index tuple."""
    k_cache, v_cache = view.transpose(1, 2).split(d, dim=-1)  # [nb, bs, H, D] each, as flash_attn.py reads it
    bs = view.shape[2]
    s = np.arange(n)
    blk = torch.as_tensor(np.asarray(blocks, dtype=np.int64)[s // bs], device=view.device)
    off = torch.as_tensor(s % bs, device=view.device)
    return k_cache[blk, off].transpose(0, 1), v_cache[blk, off].transpose(0, 1), (k_cache, v_cache, blk, off)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bs,d", [(16, 64), (32, 8)])
@pytest.mark.parametrize("device", DEVICES)
def test_flash_paged_kv_equals_vllm_addressing(layout, dtype, bs, d, device):
    heads, nb, layers = 3, 7, 2
    blocks = np.random.default_rng(1).permutation(nb).astype(np.int32)
    g = torch.Generator().manual_seed(2)
    for n in sorted({1, bs - 1, bs, bs + 1, 3 * bs - 5, nb * bs}):
        view, physical = _layer_view(layout, layers, nb, heads, bs, d, dtype, layer=1, seed=n, device=device)
        ref_view, ref_physical = _layer_view(layout, layers, nb, heads, bs, d, dtype, layer=1, seed=n, device=device)
        paged = FlashPagedKV(view, d)
        k, v = paged.read(blocks, n)
        rk, rv, (k_cache, v_cache, blk, off) = _reference(ref_view, d, blocks, n)
        assert k.shape == (heads, n, d) and k.is_contiguous() and v.is_contiguous()
        assert torch.equal(k, rk) and torch.equal(v, rv), (layout, n)
        keys, values = torch.randn(2, heads, n, d, generator=g).to(device)  # fp32, as a round hands them over
        paged.write(blocks, keys, values)
        k_cache[blk, off] = keys.transpose(0, 1).to(dtype)
        v_cache[blk, off] = values.transpose(0, 1).to(dtype)
        # every byte of the whole allocation (both layers, the slots past n, the other blocks) as the reference
        assert torch.equal(physical, ref_physical), (layout, n)


def test_flash_paged_kv_refuses_another_shape():
    with pytest.raises(ValueError, match="FlashAttention KV cache"):
        FlashPagedKV(torch.zeros(4, 2, 16, 64), 64)  # 2 * D would be 128


def test_a_round_through_the_flash_layout_equals_the_natural_one():
    """One request's round run by state.after_attention with FlashPagedKV on an LBNHC-strided cache (FlashAttention's
    usual NHD order) keeps exactly what the same round keeps on a plain natural-order cache."""
    cfg = vcfg.parse_config({"policy": "snapkv", "budget": 32, "buffer": 8})
    heads, q_heads, d, bs, nb = 2, 4, 8, 4, 16
    blocks = np.random.default_rng(3).permutation(nb).astype(np.int32)
    flash_view, _ = _layer_view("LBNHC", 1, nb, heads, bs, d, torch.float32, layer=0, seed=5)
    natural = flash_view.contiguous().clone()  # same logical content, natural strides
    assert not flash_view.is_contiguous()

    def natural_read(blk, n):
        rows = natural.index_select(0, torch.as_tensor(np.asarray(blk[: -(-n // bs)], dtype=np.int64)))
        kv = rows.transpose(0, 1).reshape(heads, -1, 2 * d)[:, :n]
        return kv[..., :d].contiguous(), kv[..., d:].contiguous()

    def natural_write(blk, k, v):
        n = k.shape[1]
        for s in range(n):
            natural[int(blk[s // bs]), :, s % bs] = torch.cat([k[:, s], v[:, s]], dim=-1)

    kept = {}
    for name, read, write in (("flash", *(lambda p: (p.read, p.write))(FlashPagedKV(flash_view, d))),
                              ("natural", natural_read, natural_write)):
        rid = f"req-{name}"
        try:
            seq_lens = torch.zeros(1, dtype=torch.int32)
            slots = torch.zeros(40, dtype=torch.int64)
            plan = state.plan_step(cfg, req_ids=[rid], computed=np.array([0]), scheduled=[40], prompt_lens=[4],
                                   keys=["same-key"], max_lens=[None], query_start=np.array([0]),
                                   block_rows=blocks[None], block_size=bs, num_layers=1, seq_lens=seq_lens,
                                   slot_mapping=slots)
            assert plan.rows[0].round_after  # 40 = T + r tokens: this step ends on a round
            query = torch.randn(40, q_heads, d, generator=torch.Generator().manual_seed(9))
            state.after_attention(plan, 0, query, 0.3, heads, read, write)
            kept[name] = state.requests()[rid].layers[0].positions.clone()
        finally:
            state.finish([rid])
    assert torch.equal(kept["flash"], kept["natural"])
    k_flash, v_flash = FlashPagedKV(flash_view, d).read(blocks, 32)
    k_nat, v_nat = natural_read(blocks, 32)
    assert torch.equal(k_flash, k_nat) and torch.equal(v_flash, v_nat)


# -- the impl's glue in the vLLM environment (the vllm tier) -------------------------------------------------------
_GLUE = r'''
import json, types
import numpy as np, torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backend import AttentionType
import randattn.vllm as rv
from randattn.vllm import state, config as vcfg
from randattn.vllm.flash_backend import FlashPagedKV, EvictingFlashAttentionImpl, EvictingFlashAttentionBackend

rv.register()
out = {"registered": AttentionBackendEnum.FLASH_ATTN.get_path(),
       "subclass": issubclass(EvictingFlashAttentionImpl, FlashAttentionImpl),
       "impl_of_backend": EvictingFlashAttentionBackend.get_impl_cls() is EvictingFlashAttentionImpl}
# FlashAttention's kernel needs CUDA: its forward is replaced by one that returns the output untouched, so what is
# tested is the wrap around it (the plan, the layer index, the layout, the round).
FlashAttentionImpl.forward = lambda self, layer, query, key, value, kv_cache, attn_metadata, output, *a: output
impl = object.__new__(EvictingFlashAttentionImpl)
impl.attn_type, impl.kv_cache_dtype, impl.head_size, impl.num_heads, impl.num_kv_heads, impl.scale = (
    AttentionType.DECODER, "auto", 8, 4, 2, 0.3)
cfg = vcfg.parse_config({"policy": "snapkv", "budget": 32, "buffer": 8})
bs, nb = 4, 16
blocks = np.random.default_rng(3).permutation(nb).astype(np.int32)
physical = torch.randn(1, nb, bs, 2, 16, generator=torch.Generator().manual_seed(5))  # [L, B, N, H, C]: LBNHC
kv_cache = physical.permute(0, 1, 3, 2, 4)[0]
before = kv_cache.clone()
query = torch.randn(40, 4 * 8, generator=torch.Generator().manual_seed(9))
plan = state.plan_step(cfg, req_ids=["a"], computed=np.array([0]), scheduled=[40], prompt_lens=[4], keys=["k"],
                       max_lens=[None], query_start=np.array([0]), block_rows=blocks[None], block_size=bs,
                       num_layers=1, seq_lens=torch.zeros(1, dtype=torch.int32),
                       slot_mapping=torch.zeros(40, dtype=torch.int64))
state.set_current(plan)
layer = types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
impl.forward(layer, query, None, None, kv_cache, types.SimpleNamespace(num_actual_tokens=40), torch.zeros(1))
glue = state.requests()["a"].layers[0].positions[:, :32].clone()
state.finish(["a"]); state.set_current(None)
# the same round by hand on a natural copy of the cache before it
plan = state.plan_step(cfg, req_ids=["b"], computed=np.array([0]), scheduled=[40], prompt_lens=[4], keys=["k"],
                       max_lens=[None], query_start=np.array([0]), block_rows=blocks[None], block_size=bs,
                       num_layers=1, seq_lens=torch.zeros(1, dtype=torch.int32),
                       slot_mapping=torch.zeros(40, dtype=torch.int64))
ref = FlashPagedKV(before, 8)
state.after_attention(plan, 0, query.view(40, 4, 8), 0.3, 2, ref.read, ref.write)
hand = state.requests()["b"].layers[0].positions[:, :32].clone()
state.finish(["b"])
out["positions_equal"] = bool(torch.equal(glue, hand))
out["cache_equal"] = bool(torch.equal(kv_cache, before))
out["evicted"] = int((glue != torch.arange(32)).sum())
print(json.dumps(out))
'''


@pytest.mark.vllm
def test_the_flash_impl_wraps_vllms_and_runs_the_round():
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    py = root / ".venv-vllm" / "bin" / "python"
    if not py.exists():
        pytest.skip(f"no vLLM environment at {py.parent.parent}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([str(py), "-c", _GLUE], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["registered"] == "randattn.vllm.flash_backend.EvictingFlashAttentionBackend"
    assert got["subclass"] and got["impl_of_backend"]
    assert got["positions_equal"] and got["cache_equal"], got
    assert got["evicted"] > 0, got  # the round did evict (the check above compares something)
