"""The kvpress side of ``python -m bench.kvpress_peer``, run by the peer environment's python.

    .venv-kvpress/bin/python bench/_kvpress_worker.py REQUEST.json      # or - for stdin

Reads one JSON request (see ``parse_request``), times full attention and kvpress's ``DecodingPress``
around each requested scorer press, and prints one JSON document on stdout (progress goes to
stderr). Optionally it also inspects the compressed cache of an untimed batch-1 run to recover
which original positions it kept and in what order (``match_positions``, ``order_summary``).

Only torch is imported at module level, so the main environment can import the parsing and the
order check without kvpress installed.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

# Our policy names -> kvpress press classes (same names in bench.kvpress_peer).
PRESSES = {"random": "RandomPress", "streamingllm": "StreamingLLMPress", "snapkv": "SnapKVPress"}
_REQUIRED = {"model": dict, "prompt_ids": list, "batch": int, "new_tokens": int, "budget": int, "buffer": int,
             "policies": list}
_OPTIONAL = {"snapkv_window": 32, "snapkv_kernel": 5, "n_sink": 4, "threads": None, "check_tokens": 0,
             "check_layer": 0, "full": True}


class RequestError(ValueError):
    """A malformed request: the message names the field."""


def parse_request(text: str) -> dict:
    """Validate a JSON request and fill in optional fields; a bad field is a ``RequestError`` naming it."""
    try:
        req = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"request is not JSON: {exc}") from None
    if not isinstance(req, dict):
        raise RequestError("request must be a JSON object")
    for key, typ in _REQUIRED.items():
        if key not in req:
            raise RequestError(f"request lacks {key!r}")
        if not isinstance(req[key], typ) or isinstance(req[key], bool):
            raise RequestError(f"request field {key!r} must be {typ.__name__}, got {type(req[key]).__name__}")
    unknown = set(req) - set(_REQUIRED) - set(_OPTIONAL)
    if unknown:
        raise RequestError(f"request has unknown fields {sorted(unknown)}")
    model = req["model"]
    if len(model) != 1 or not ({"gguf", "dir"} & set(model)):
        raise RequestError("request field 'model' must be {'gguf': FILE} or {'dir': DIR}")
    if "full" in req and not isinstance(req["full"], bool):
        raise RequestError(f"request field 'full' must be bool, got {type(req['full']).__name__}")
    for key in ("batch", "new_tokens", "budget", "buffer"):
        if req[key] <= 0:
            raise RequestError(f"request field {key!r} must be positive, got {req[key]}")
    ids = req["prompt_ids"]
    if not ids or not all(isinstance(t, int) for t in ids):
        raise RequestError("request field 'prompt_ids' must be a non-empty list of token ids")
    bad = [p for p in req["policies"] if p not in PRESSES]
    if bad:
        raise RequestError(f"request names policies {bad} kvpress has no counterpart for; choose from {sorted(PRESSES)}")
    out = {**_OPTIONAL, **req}
    if "snapkv" in out["policies"] and out["snapkv_window"] >= out["buffer"]:
        # DecodingPress hands SnapKV only the r hidden states since the last compression.
        raise RequestError(f"snapkv_window {out['snapkv_window']} must be below buffer {out['buffer']}: kvpress's "
                           "SnapKV needs more buffered queries than its window")
    return out


# -- which original positions a compressed cache kept -------------------------------------------------
def match_positions(kept_keys: torch.Tensor, full_keys: torch.Tensor):
    """Recover the original position of every kept key by nearest neighbour among a full run's keys.

    ``kept_keys [H, S, D]`` from a compressed cache, ``full_keys [H, T, D]`` from one uncompressed forward
    over the same tokens, both at a layer whose keys depend only on token and position (layer 0:
    ``RoPE(W_k · norm(embedding))``). Returns ``positions [H, S]`` and the relative distance of each
    match ``[H, S]``: near zero means the kept key is exactly the model's post-RoPE key at that
    position (stored, not re-rotated).
    """
    kept, full = kept_keys.double(), full_keys.double()
    dist = torch.cdist(kept, full)  # [H, S, T]
    best, pos = dist.min(-1)
    rel = best / full.norm(dim=-1).gather(1, pos).clamp_min(1e-12)
    return pos, rel


def order_summary(positions: torch.Tensor, rel_err: torch.Tensor, *, prompt_len: int, seq_len: int) -> dict:
    """What the matched positions ``[H, S]`` say: exact post-RoPE keys? chronological slots? prompt kept?"""
    steps = positions[:, 1:] - positions[:, :-1]
    return {
        "kept_per_head": positions.shape[1],
        "max_rel_key_error": float(rel_err.max()),
        "keys_exact": bool(rel_err.max() < 1e-4),
        "distinct": all(len(set(row.tolist())) == len(row) for row in positions),
        "chronological_heads": int((steps > 0).all(-1).sum()),
        "heads": positions.shape[0],
        "ordered_adjacent_fraction": float((steps > 0).double().mean()),
        "prompt_kept_per_head": (positions < prompt_len).sum(-1).tolist(),
        "prompt_len": prompt_len,
        "newest_kept": int(positions.max()),
        # A sink + recent-window keep-set holds the newest S - n_sink positions; scrambled slots break that.
        "in_recent_window_fraction": float((positions >= seq_len - positions.shape[1]).double().mean()),
        "first4_kept_per_head": (positions < 4).sum(-1).tolist(),
        "newest_position": seq_len - 1,
        "head0_slots_first12": positions[0, :12].tolist(),
    }


def _cache_kwarg(model) -> str:
    """The forward keyword that takes a cache: ``cache`` from transformers 5.24 on, else ``past_key_values``
    (randattn.cache_argument_name, repeated here: the peer environment has no randattn)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def full_keys(model, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s post-RoPE keys of one uncompressed forward over ``ids [1, T]``: ``[H, T, D]``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(ids, use_cache=True, **{_cache_kwarg(model): cache})
    return cache.layers[layer].keys[0]


# -- the kvpress runs -----------------------------------------------------------------------------------
def _load(req):
    from transformers import AutoModelForCausalLM
    from pathlib import Path

    if "gguf" in req["model"]:
        path = Path(req["model"]["gguf"])
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                    attn_implementation="sdpa").eval()
    return AutoModelForCausalLM.from_pretrained(req["model"]["dir"], dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


class _CountedPress:
    """Wraps a DecodingPress's ``compress`` to count the compressions that shrank the cache and time them."""

    def __init__(self, press):
        self.calls, self.seconds, inner = 0, 0.0, press.compress

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            t0 = time.perf_counter()
            k, v = inner(module, hidden_states, keys, values, attentions, kwargs)
            self.seconds += time.perf_counter() - t0
            self.calls += int(k.shape[2] < keys.shape[2])
            return k, v

        press.compress = compress  # instance attribute: DecodingPress.forward_hook calls self.compress
        self.press = press


def make_press(req, policy: str):
    import kvpress

    K, r = req["budget"], req["buffer"]
    if policy == "random":
        base = kvpress.RandomPress()
    elif policy == "streamingllm":
        base = kvpress.StreamingLLMPress(n_sink=req["n_sink"])
    else:
        base = kvpress.SnapKVPress(window_size=req["snapkv_window"], kernel_size=req["snapkv_kernel"])
    # Score-free presses read no hidden states; SnapKV needs the r since the last compression.
    return kvpress.DecodingPress(base_press=base, compression_interval=r, target_size=K,
                                 hidden_states_buffer_size=r if policy == "snapkv" else 0)


def generate(model, ids, new_tokens: int, press=None):
    """Greedy, EOS ignored, as bench.decode's run_one; returns (output ids, cache, seconds)."""
    import contextlib

    from transformers import DynamicCache

    cache = DynamicCache()
    ctx = press(model) if press is not None else contextlib.nullcontext()
    t0 = time.perf_counter()
    with ctx, torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, **{_cache_kwarg(model): cache})
    return out, cache, time.perf_counter() - t0


def _kv_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def run(req: dict, log=sys.stderr) -> dict:
    import importlib.metadata as md

    if req["threads"]:
        torch.set_num_threads(req["threads"])
    torch.manual_seed(0)  # RandomPress draws from the global generator
    model = _load(req)
    prompt = torch.tensor([req["prompt_ids"]])
    ids = prompt.expand(req["batch"], -1).contiguous()
    with torch.no_grad():
        top = model(prompt).logits[0, -1].topk(5)
    generate(model, prompt, 8)  # untimed warm-up: allocator and kernel choice land in no arm's timing
    rows, checks = [], {}
    for policy in [*([None] if req["full"] else []), *req["policies"]]:
        load = os.getloadavg()[0]
        counted = None if policy is None else _CountedPress(make_press(req, policy))
        out, cache, seconds = generate(model, ids, req["new_tokens"], counted and counted.press)
        new = out.shape[1] - ids.shape[1]
        row = {"policy": policy or "full", "batch": ids.shape[0], "prompt_tokens": ids.shape[1], "new_tokens": new,
               "seconds": seconds, "tokens_per_s": new * ids.shape[0] / seconds, "kv_bytes_end": _kv_bytes(cache),
               "pairs_per_head_end": cache.layers[0].keys.shape[2], "loadavg_1m_before": load}
        if counted is not None:
            layers = len(cache.layers)
            row.update(budget=req["budget"], buffer=req["buffer"], rounds_per_layer=counted.calls / layers,
                       round_seconds=counted.seconds, round_share=counted.seconds / seconds)
        rows.append(row)
        print(json.dumps(row), file=log, flush=True)
        if policy is not None and req["check_tokens"]:
            checks[policy] = check_order(model, prompt, req, policy)
    return {
        "versions": {d: md.version(d) for d in ("kvpress", "transformers", "torch", "gguf", "accelerate")},
        "python": sys.version.split()[0],
        "torch_threads": torch.get_num_threads(),
        "prompt_top5": {"ids": top.indices.tolist(), "logits": top.values.tolist()},
        "rows": rows,
        "order_checks": checks,
    }


def check_order(model, prompt, req, policy) -> dict:
    """An untimed batch-1 run of ``check_tokens`` under the press, then its layer's kept keys matched to a full forward's."""
    out, cache, _ = generate(model, prompt, req["check_tokens"], make_press(req, policy))
    seq = out[:, :-1]  # the last token was sampled but never fed, so the cache holds everything before it
    ref = full_keys(model, seq, req["check_layer"])
    pos, rel = match_positions(cache.layers[req["check_layer"]].keys[0], ref)
    return order_summary(pos, rel, prompt_len=prompt.shape[1], seq_len=seq.shape[1])


def _quiet() -> None:
    """No weight-loading progress bars in the worker's stderr (the caller sets TQDM_DISABLE for the GGUF one)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 2
    text = sys.stdin.read() if argv[0] == "-" else open(argv[0]).read()
    try:
        req = parse_request(text)
    except RequestError as exc:
        print(f"kvpress worker: {exc}", file=sys.stderr)
        return 2
    _quiet()
    print(json.dumps(run(req)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
