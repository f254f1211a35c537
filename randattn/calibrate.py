"""Calibrate TriAttention: per-head statistics of a model's pre-RoPE queries over a trace.

    python -m randattn.calibrate --out stats.pt                         # embedded model, built-in trace
    python -m randattn.calibrate --model DIR_OR_HUB_ID --out stats.pt --text corpus.txt --tokens 20000

Then ``EvictingCache("triattention", budget=..., stats="stats.pt")``.

For every layer ``l`` and query head ``h`` it accumulates, in float64, over every token of every
sequence (pre-RoPE query ``q`` = the layer's own projection + q-norm, captured by a forward
pre-hook on the attention module)::

    qbar[l, h, :] = mean q
    mbar[l, h, f] = mean sqrt(q_f^2 + q_{f+R/2}^2)      (f < R/2, R = rotary dim)

and saves them with the model's rotary ``inv_freq`` (after rope scaling), ``attention_scaling`` and
metadata (see :class:`randattn.triattention.TriAttentionStats`).

The default trace is the model's own greedy continuation of a few math word problems written for
this project (:data:`PROBLEMS`), until about ``--tokens`` tokens (prompts included).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from .capture import attention_modules, recompute_queries
from .traces import load_traces
from .triattention import TriAttentionStats, _model_shape

__all__ = ["calibrate", "rotary_parameters", "default_trace", "PROBLEMS", "main"]

#: Built-in calibration problems (written for randattn; any reasoning-style text works as well).
PROBLEMS = (
    "A baker makes 24 muffins in the morning and three times as many in the afternoon. She sells 70 muffins "
    "and gives away 12. How many muffins are left at the end of the day?",
    "Tom reads 15 pages a day. His book has 340 pages and he has already read 55 of them. How many more days "
    "does he need to finish the book?",
    "A rectangle has a perimeter of 46 cm, and its length is 5 cm more than its width. What is its area?",
    "A train leaves at 9:40 and travels 210 km at an average speed of 70 km per hour. At what time does it arrive?",
    "Three friends share a restaurant bill of 84 dollars and add a 15 percent tip, split equally. How much does "
    "each friend pay?",
    "The sum of three consecutive even numbers is 138. What are the three numbers?",
    "A tank holds 600 litres. One pipe fills it in 30 minutes and another pipe empties it in 50 minutes. If both "
    "pipes are open, how long does it take to fill the empty tank?",
    "A shop lowers the price of an 80 dollar jacket by 25 percent and then adds 8 percent sales tax. What is the "
    "final price?",
)
_INSTRUCTION = " Solve it step by step, then check your answer."


def rotary_parameters(model) -> tuple[torch.Tensor, float]:
    """The model's rotary ``inv_freq`` (float64, CPU, after rope scaling) and ``attention_scaling``."""
    found = []
    for name, module in model.named_modules():
        inv = getattr(module, "inv_freq", None)
        if torch.is_tensor(inv) and hasattr(module, "attention_scaling"):
            found.append((name, inv.detach().to("cpu", torch.float64).clone(), float(module.attention_scaling)))
    if not found:
        raise NotImplementedError(
            f"{type(model).__name__}: no rotary embedding module (with inv_freq and attention_scaling) found; "
            f"TriAttention needs a RoPE model"
        )
    _, inv, scale = found[0]
    for name, other, s in found[1:]:
        if other.shape != inv.shape or not torch.equal(other, inv) or s != scale:
            raise NotImplementedError(
                f"{type(model).__name__} has several different rotary embeddings ({found[0][0]!r}, {name!r}); "
                f"TriAttention statistics assume one rotary embedding for every layer"
            )
    return inv, scale


def _as_ids(ids) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"each calibration sequence must be a non-empty 1-D list of token ids (or [1, T]), got shape {tuple(t.shape)}")
    return t


@torch.no_grad()
def calibrate(
    model,
    input_ids_list: Iterable,
    *,
    source: str = "given token sequences",
    progress: bool = True,
) -> TriAttentionStats:
    """TriAttention statistics of ``model`` over ``input_ids_list`` (sequences of token ids, one
    uncached forward each, batch 1). Returns a :class:`TriAttentionStats`; ``.save(path)`` it."""
    shape = _model_shape(model)
    n_layers, hq, d = shape["num_layers"], shape["num_heads"], shape["head_dim"]
    inv_freq, scaling = rotary_parameters(model)
    half = inv_freq.shape[0]
    if 2 * half > d:
        raise ValueError(f"rotary dim {2 * half} exceeds head_dim {d}")
    mods = attention_modules(model)
    if sorted(i for i, _ in mods) != list(range(n_layers)):
        raise NotImplementedError(
            f"{shape['model_type']}: found attention modules for layers {sorted(i for i, _ in mods)}, expected 0..{n_layers - 1}"
        )
    qsum = torch.zeros(n_layers, hq, d, dtype=torch.float64)
    msum = torch.zeros(n_layers, hq, half, dtype=torch.float64)
    counts = [0] * n_layers

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        q = recompute_queries(module, hidden, None, rotate=False).to(torch.float64)  # [B, H_q, n, D]
        l = int(module.layer_idx)
        qsum[l] += q.sum(dim=(0, 2)).cpu()
        msum[l] += torch.sqrt(q[..., :half] ** 2 + q[..., half : 2 * half] ** 2).sum(dim=(0, 2)).cpu()
        counts[l] += q.shape[0] * q.shape[2]

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for _, m in mods]
    device = next(model.parameters()).device
    n_seq = 0
    try:
        seqs = list(input_ids_list)
        for ids in tqdm(seqs, desc="calibrate", unit="seq", disable=not progress):
            t = _as_ids(ids).to(device)
            model(input_ids=t[None], use_cache=False)
            n_seq += 1
    finally:
        for h in handles:
            h.remove()
    if n_seq == 0 or min(counts) == 0:
        raise ValueError("calibrate needs at least one non-empty sequence")
    if len(set(counts)) != 1:
        raise RuntimeError(f"layers saw different token counts {counts}; calibration hooks misfired")
    tokens = counts[0]
    cfg = model.config.get_text_config(decoder=True)
    meta = {
        **shape,
        "rotary_dim": 2 * half,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "name_or_path": str(getattr(model.config, "_name_or_path", "") or ""),
        "source": source,
        "tokens": tokens,
        "sequences": n_seq,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    meta = {k: v for k, v in meta.items() if v is not None}
    return TriAttentionStats(
        qbar=(qsum / tokens).to(torch.float32),
        mbar=(msum / tokens).to(torch.float32),
        inv_freq=inv_freq,
        attention_scaling=scaling,
        meta=meta,
    )


def _prompt_ids(tok, text: str) -> torch.Tensor:
    if getattr(tok, "chat_template", None):
        msgs = [{"role": "user", "content": text}]
        out = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        return out["input_ids"][0]
    return torch.tensor(tok(text)["input_ids"], dtype=torch.long)


@torch.no_grad()
def default_trace(model, tok, tokens: int, *, problems: Sequence[str] = PROBLEMS, progress: bool = True) -> list[torch.Tensor]:
    """The model's greedy continuations of ``problems`` (chat template when the tokenizer has one),
    sharing about ``tokens`` tokens (prompts included) between them."""
    device = next(model.parameters()).device
    seqs, total = [], 0
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    bar = tqdm(total=tokens, desc="trace", unit="tok", disable=not progress)
    for i, problem in enumerate(problems):
        left = tokens - total
        if left <= 0:
            break
        share = math.ceil(left / (len(problems) - i))
        ids = _prompt_ids(tok, problem + _INSTRUCTION).to(device)
        new = max(share - ids.shape[0], 16)
        out = model.generate(
            input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=new,
            do_sample=False, pad_token_id=pad,
        )[0]
        seqs.append(out.cpu())
        total += out.shape[0]
        bar.update(out.shape[0])
    bar.close()
    return seqs


def _chunks(ids: list, max_length: int, budget: int) -> list[torch.Tensor]:
    out = []
    for start in range(0, len(ids), max_length):
        if budget <= 0:
            break
        piece = ids[start : start + min(max_length, budget)]
        if piece:
            out.append(torch.tensor(piece, dtype=torch.long))
            budget -= len(piece)
    return out


def _file_trace(tok, *, text: Optional[Path], traces: Optional[Path], tokens: int, max_length: int) -> list[torch.Tensor]:
    texts = []
    if text is not None:
        texts.append(text.read_text(encoding="utf-8"))
    else:
        texts = load_traces(traces)
    seqs, budget = [], tokens
    for t in texts:
        got = _chunks(tok(t)["input_ids"], max_length, budget)
        seqs += got
        budget -= sum(len(s) for s in got)
        if budget <= 0:
            break
    if not seqs:
        raise ValueError(f"{text or traces}: no tokens to calibrate on")
    return seqs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m randattn.calibrate",
        description=(
            "Collect TriAttention statistics (per layer and query head: the mean pre-RoPE query qbar and the "
            "mean magnitude mbar of every rotary frequency pair) over a trace, and save them for "
            'EvictingCache("triattention", budget=..., stats=OUT).'
        ),
    )
    p.add_argument("--model", default=None,
                   help="HF hub id or local model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or hub id, when it does not live beside the model (default: the model's)")
    p.add_argument("--out", required=True, type=Path, help="where to write the statistics (.pt)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", type=Path, default=None,
                     help="calibrate on this plain-text file (split into sequences of --max-length tokens)")
    src.add_argument("--traces", type=Path, default=None,
                     help='calibrate on a JSONL file, one sequence per line in its "text" field')
    p.add_argument("--tokens", type=int, default=2000,
                   help="about how many tokens to calibrate on, prompts included (default 2000; for the built-in "
                        "trace, generating it dominates the run time)")
    p.add_argument("--max-length", type=int, default=1024,
                   help="longest sequence fed in one forward for --text / --traces (default 1024)")
    p.add_argument("--device", default="auto", help="'auto' (default: CUDA when present), 'cpu' or 'cuda[:N]'")
    p.add_argument("--seed", type=int, default=0,
                   help="torch seed (the built-in trace is greedy, so it only matters for models that sample)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Every flag checked before the model loads and the calibration runs: a usage error naming the flag."""
    import tempfile

    for flag, value in (("--tokens", args.tokens), ("--max-length", args.max_length)):
        if value <= 0:
            p.error(f"{flag}: must be a positive integer, got {value}")
    for flag, f in (("--text", args.text), ("--traces", args.traces)):
        if f is None:
            continue
        if f.is_dir():
            p.error(f"{flag}: {f} is a folder; give the file")
        if not f.is_file():
            p.error(f"{flag}: {f}: no such file")
        try:
            load_traces(f) if flag == "--traces" else f.read_text(encoding="utf-8")
        except (ValueError, OSError) as exc:  # UnicodeDecodeError is a ValueError
            p.error(f"{flag}: {f} cannot be read ({exc}); give a {'JSONL file with a text field per line' if flag == '--traces' else 'UTF-8 text file'}")
    out = args.out
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            p.error(f"--out: {parent} is a file, so {out} cannot be created; give a path in a folder")
    if out.is_dir():
        p.error(f"--out: {out} is a folder; give the statistics file to write, e.g. {out / 'stats.pt'}")
    if out.exists():
        try:
            TriAttentionStats.load(out)
        except Exception:  # anything unreadable as statistics is not ours to replace
            p.error(f"--out: {out} exists and is not a statistics file randattn wrote; nothing was changed. Give a new "
                    "file name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent, prefix=".randattn-write-check-"):
            pass
    except OSError as exc:
        p.error(f"--out: cannot write in {out.parent} ({exc.strerror or exc}); give a path you can write to")


def main(argv: Optional[Sequence[str]] = None) -> TriAttentionStats:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    from .models import load_model

    torch.manual_seed(args.seed)
    try:
        model, tok = load_model(args.model, device=args.device, tokenizer=args.tokenizer)
    except (ValueError, OSError) as exc:  # a usage error (no such device, path or hub id): a message, no traceback
        raise SystemExit(f"randattn.calibrate: {exc}") from exc
    progress = not args.quiet
    if args.text is None and args.traces is None:
        seqs = default_trace(model, tok, args.tokens, progress=progress)
        source = (
            f"greedy continuations of {len(seqs)} built-in math word problems (randattn.calibrate.PROBLEMS), "
            f"--tokens {args.tokens}"
        )
    else:
        f = args.text or args.traces
        seqs = _file_trace(tok, text=args.text, traces=args.traces, tokens=args.tokens, max_length=args.max_length)
        source = f"{'text' if args.text else 'traces'} file {f.name}, --tokens {args.tokens}, --max-length {args.max_length}"
    stats = calibrate(model, seqs, source=source, progress=progress)
    if args.model is None:
        stats.meta["name_or_path"] = "smollm2-135m (embedded SmolLM2-135M-Instruct)"
    stats.save(args.out)
    print(stats.describe())
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB); use it with "
          f'EvictingCache("triattention", budget=..., stats="{args.out}")')
    return stats


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
