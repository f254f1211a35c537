"""Reasoning-trace corpus: varied math word problems and the model's own step-by-step solutions.

    python -m probes.traces                                  # embedded model -> data/traces/smollm2-135m.jsonl
    python -m probes.traces --tokens 20000 --out my.jsonl --model Qwen/Qwen3-0.6B

Each JSONL row: ``id``, ``question``, ``answer`` (the true result), ``text`` (the model's
solution), ``tokens`` (its length), and the generation ``settings``. The run appends one batch at a
time and resumes where a file left off, so an interrupted run loses at most one batch. Probes
draw filler from the ``text`` field of any such file (``--traces FILE.jsonl``), e.g. a reasoning
model's MATH500 completions.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from randattn.traces import load_traces  # noqa: F401  (re-exported for the probes)

from . import cli
from .config import POSITIVE, ConfigError, RunConfig, option
from .planted_run import load
from randattn.seeding import batch_seed

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Elif", "Farah", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena", "Mateo",
         "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yusuf", "Zara"]
ITEMS = [("apple", "apples"), ("book", "books"), ("marble", "marbles"), ("pencil", "pencils"), ("stamp", "stamps"),
         ("cookie", "cookies"), ("sticker", "stickers"), ("shell", "shells"), ("card", "cards"), ("coin", "coins")]


def _problem(rng: random.Random) -> tuple[str, float]:
    """One word problem and its exact answer."""
    a, b = rng.sample(NAMES, 2)
    one, many = rng.choice(ITEMS)
    kind = rng.randrange(8)
    if kind == 0:
        x, y, z = rng.randint(12, 95), rng.randint(3, 9), rng.randint(5, 40)
        return (f"{a} has {x} {many}. {b} has {y} times as many {many} as {a}, then gives away {z}. "
                f"How many {many} does {b} have left?", x * y - z)
    if kind == 1:
        price, n = rng.randint(2, 19), rng.randint(3, 12)
        paid = (price * n // 50 + 1) * 50
        return (f"{a} buys {n} {many} at ${price} each and pays with ${paid}. How much change does {a} get?",
                paid - price * n)
    if kind == 2:
        speed, hours, extra = rng.randint(35, 95), rng.randint(2, 7), rng.randint(10, 90)
        return (f"A train travels at {speed} km per hour for {hours} hours, then another {extra} km. "
                f"How far does it travel in total?", speed * hours + extra)
    if kind == 3:
        total, pct = rng.randint(4, 30) * 20, rng.choice([10, 15, 20, 25, 30, 40, 60, 75])
        return (f"A shop has {total} {many}. It sells {pct}% of them in the morning and half of the rest in the "
                f"afternoon. How many {many} are left?", (total - total * pct / 100) / 2)
    if kind == 4:
        w, h = rng.randint(4, 30), rng.randint(4, 30)
        return (f"A garden is {w} m long and {h} m wide. A path 1 m wide runs around the outside. "
                f"What is the area of the path in square metres?", (w + 2) * (h + 2) - w * h)
    if kind == 5:
        n, k = rng.randint(3, 9), rng.randint(2, 6)
        boxes = rng.randint(4, 15)
        return (f"{a} packs {many} into {boxes} boxes with {n} {many} in each box. {b} packs {k} more boxes of the "
                f"same size. How many {many} did they pack together?", n * (boxes + k))
    if kind == 6:
        age, diff, years = rng.randint(6, 20), rng.randint(2, 30), rng.randint(2, 15)
        return (f"{a} is {age} years old and {b} is {diff} years older. How old will they be together in "
                f"{years} years?", age + age + diff + 2 * years)
    x, y = rng.randint(10, 60), rng.randint(10, 60)
    return (f"{a} and {b} share {x + y} {many}. {a} gets {x - y if x > y else y - x} more than {b}. "
            f"How many {many} does {a} get?", max(x, y))


def make_problem(rng: random.Random) -> dict:
    question, answer = _problem(rng)
    answer = int(answer) if float(answer).is_integer() else answer
    return {"question": question + " Solve it step by step and give the final answer.", "answer": answer}


def _done(path: Path, settings: Optional[dict] = None) -> tuple[int, int]:
    """(rows, tokens) already in ``path``; refuses (:class:`ConfigError` naming ``out``, nothing changed) a folder, a
    file that is not a traces file this command wrote, or one written with other settings; a torn last row (a run
    killed mid-write) is cut off."""
    rows = tokens = 0
    if path.is_dir():
        raise ConfigError("out", f"{path} is a folder; --out names the traces JSONL file, e.g. {path / 'traces.jsonl'}")
    if not path.exists():
        return rows, tokens
    data = path.read_bytes()
    cut = None
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        if not data[cut:].startswith(b'{"id": '):
            cut = None  # not one of our rows cut short: refused below
        else:
            data = data[:cut]
    foreign = ConfigError("out", f"{path} is not a traces file written by probes.traces; nothing was changed. Give "
                                 "--out a new file name")
    for line in data.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise foreign from None
        if not (isinstance(row, dict) and isinstance(row.get("tokens"), int) and "text" in row and "settings" in row):
            raise foreign
        if settings is not None and row["settings"] != settings:
            diff = sorted(k for k in set(settings) | set(row["settings"]) if settings.get(k) != row["settings"].get(k))
            raise ConfigError("out", f"{path} holds traces generated with other settings (differs in "
                                     f"{', '.join(diff)}); give --out a new file, or the same settings to resume")
        rows += 1
        tokens += row["tokens"]
    if cut is not None:
        with open(path, "r+b") as f:
            f.truncate(cut)
    return rows, tokens


def _top_p(value) -> Optional[str]:
    return None if isinstance(value, (int, float)) and 0 < value <= 1 else f"must be in (0, 1], got {value!r}"


@dataclass
class Config(RunConfig):
    """Write reasoning traces of a model (``python -m probes.traces``)."""

    out: Optional[str] = option(None, "the JSONL file to write (default: data/traces/smollm2-135m.jsonl under the "
                                      "current folder); resumes")
    tokens: int = option(100_000, "stop once the file holds this many trace tokens", check=POSITIVE)
    batch: int = option(16, "problems generated together", check=POSITIVE)
    max_new_tokens: int = option(384, "tokens per trace at most", check=POSITIVE)
    temperature: float = option(0.7, "sampling temperature", check=POSITIVE)
    top_p: float = option(0.95, "nucleus sampling, in (0, 1]", check=_top_p)


def main(argv=None) -> int:
    return cli.main(Config, run, argv, __doc__)


def run(config: Config) -> int:
    args = config
    import randattn

    out = Path(args.out or "data/traces/smollm2-135m.jsonl")
    settings = {
        "model": args.model or randattn.DEFAULT_MODEL, "do_sample": True, "temperature": args.temperature,
        "top_p": args.top_p, "max_new_tokens": args.max_new_tokens, "seed": args.seed, "chat_template": True,
        "cache": "full (no eviction)",
    }
    for p in out.parents:
        if p.exists() and not p.is_dir():
            raise ConfigError("out", f"{p} is a file, so {out} cannot be created; give a path in a folder")
    rows, tokens = _done(out, settings)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("out", f"cannot create {out.parent} ({exc.strerror or exc}); give a path you can write to")
    model, tok = load(config)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    bar = tqdm(total=args.tokens, initial=min(tokens, args.tokens), unit="tok", desc=f"traces -> {out}")
    while tokens < args.tokens:
        base = batch_seed(args.seed, rows)  # resumable: problem i depends only on (seed, i)
        problems = [make_problem(random.Random(base + i)) for i in range(args.batch)]
        prompts = [tok.apply_chat_template([{"role": "user", "content": pr["question"]}], add_generation_prompt=True,
                                           tokenize=False) for pr in problems]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        torch.manual_seed(base)
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=True, temperature=args.temperature, top_p=args.top_p,
                                 max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
        new = gen[:, enc["input_ids"].shape[1]:]
        written = 0
        with open(out, "a") as f:
            for i, (pr, ids) in enumerate(zip(problems, new)):
                if tokens >= args.tokens:  # the target is reached within this batch: the rest is not kept
                    break
                written += 1
                ids = ids[ids != tok.pad_token_id] if tok.pad_token_id != tok.eos_token_id else ids
                ids = ids[: (ids == tok.eos_token_id).nonzero()[0, 0]] if (ids == tok.eos_token_id).any() else ids
                text = tok.decode(ids, skip_special_tokens=True).strip()
                row = {"id": rows + i, **pr, "text": text, "tokens": int(ids.numel()), "settings": settings}
                f.write(json.dumps(row) + "\n")
                tokens += row["tokens"]
                bar.update(row["tokens"])
        rows += written
    bar.close()
    print(f"{out}: {rows} traces, {tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
