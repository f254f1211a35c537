"""Headline numbers before and after the paper's engine, beside the paper's values.

    python -m figures.before_after --snapshot   # (from a git checkout) copy the previous engine's result files
    python -m figures.tables                    # renders the before/after table in docs/remeasure.md

"Before" is the toolkit's engine up to revision ``OLD_REVISION`` (every pair of a round competed, the budget
counted without the recent window); its result files are copied once from git into ``docs/data/old-engine/``
(documentation data, not shipped with the package). "After" is the shipped results on the paper's engine.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

OLD_REVISION = "0918c9a"  # the last revision before the paper's engine (6ced941)
OLD = Path(__file__).resolve().parents[1] / "docs" / "data" / "old-engine"

# old path at OLD_REVISION -> the name it is kept under in docs/data/old-engine/
OLD_FILES = {
    "data/results/head_pooling/smollm2-135m-random-K256-r16-d384-s0.summary.csv": "head_pooling.summary.csv",
    "data/results/scatter/smollm2-135m-random-K256-r16-d384-s0.summary.csv": "scatter.summary.csv",
    "data/results/two_facts/smollm2-135m-random-K256-r16-d384-s0.summary.csv": "two_facts.summary.csv",
    "data/results/blocks/summary-smollm2-135m-K256-r16-d384-s0.csv": "blocks.summary.csv",
    "data/results/passcode/summary-smollm2-135m-K256-r16-n57-s0.csv": "passcode.summary.csv",
    "data/results/prompt_protection/smollm2-135m-K256-r16-b512-s0.summary.csv": "prompt_protection.summary.csv",
    "data/results/shared_draw/summary-smollm2-135m-K256-r16-s0.csv": "shared_draw.summary.csv",
    "data/results/accuracy/smollm2-135m-copy-r16-n192-s0.table.csv": "accuracy.table.csv",
    "data/results/bench/decode.json": "bench_decode.json",
    "data/results/bench/round_cost.json": "bench_round_cost.json",
    "data/results/bench/batch_scaling.json": "bench_batch_scaling.json",
    "data/results/bench/memory.json": "bench_memory.json",
}
SURVIVAL = "data/results/survival/smollm2-135m-K256-r16-n24-seq4-b4-s0.jsonl"


def _survival_summary(rows: list[dict]) -> list[dict]:
    """Per (policy, mode): per-head and union survival after 12 rounds, slot coverage, prompt survival (union)."""
    from analysis.survival import pool

    out = []
    for p in pool(rows).values():
        c, i = p.by_rounds, 12 - 1  # bin i holds what has been through i + 1 rounds
        ok = len(c.total) > i and c.total[i]
        out.append({"policy": p.policy, "mode": p.mode, "s_h12": float(c.head[i]) if ok else np.nan,
                    "s_u12": float(c.union[i]) if ok else np.nan, **p.metrics})
    return out


def snapshot() -> None:
    """Copy the previous engine's files out of git (needs a checkout with that revision)."""
    OLD.mkdir(parents=True, exist_ok=True)
    show = lambda path: subprocess.run(["git", "show", f"{OLD_REVISION}:{path}"], check=True,  # noqa: E731
                                       capture_output=True, text=True, cwd=OLD.parents[2]).stdout
    for path, name in OLD_FILES.items():
        (OLD / name).write_text(show(path))
    rows = [json.loads(line) for line in show(SURVIVAL).splitlines() if line.strip()]
    table = _survival_summary(rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(table[0]))
    w.writeheader()
    w.writerows(table)
    (OLD / "survival.summary.csv").write_text(buf.getvalue())
    (OLD / "README.md").write_text(
        f"# The previous engine's results\n\nCopied by `python -m figures.before_after --snapshot` from git revision "
        f"`{OLD_REVISION}` (the last before the paper's engine): each file is `git show {OLD_REVISION}:<path>` of\n\n"
        + "".join(f"- `{name}`: `{path}`\n" for path, name in OLD_FILES.items())
        + f"- `survival.summary.csv`: summarised from `{SURVIVAL}` (per-head and union survival after 12 rounds, "
          "keep-log metrics).\n\nThey are the *before* column of docs/remeasure.md, nothing else.\n")


def _old(name: str) -> list[dict]:
    with open(OLD / name, newline="") as f:
        return list(csv.DictReader(f))


def _pick(rows, **match) -> dict:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    raise KeyError(f"no row with {match}")


def table() -> list[str]:
    from analysis.names import shipped_name
    from figures import table_io as t

    new = {k: t.read_csv(shipped_name(k, "summary"))
           for k in ("head_pooling", "scatter", "blocks", "passcode", "prompt_protection", "shared_draw")}
    new["survival"] = _survival_summary(t.read_jsonl(shipped_name("survival")))
    old = {k: _old(f"{k}.summary.csv") for k in new}
    acc_new = t.result_path(shipped_name("accuracy", "table"))
    with open(acc_new, newline="") as f:
        new["accuracy"] = list(csv.DictReader(f))
    old["accuracy"] = _old("accuracy.table.csv")

    def cell(probe, field, digits=3, **match):
        def one(rows):
            try:
                return t.f(_pick(rows, **match)[field], digits)
            except KeyError:
                return "–"
        return one(old[probe]), one(new[probe])

    def acc(method, column):
        def one(rows):
            try:
                return _pick(rows, method=method)[column].split(" ")[0] or "–"
            except KeyError:
                return "–"
        return one(old["accuracy"]), one(new["accuracy"])

    def bench(name, value):
        """``value(rows)`` of the old and the new benchmark file; "–" where the file or its arm is missing."""
        def one(path):
            try:
                return value(json.loads(path.read_text())["rows"])
            except (FileNotFoundError, StopIteration, KeyError):
                return "–"
        return one(OLD / f"bench_{name}.json"), one(t.result_path(f"bench/{name}.json"))

    def tok_s(rows, batch, policy):
        import statistics

        return statistics.median(r["tokens_per_s"] for r in rows if r["batch"] == batch and r["policy"] == policy)

    def ratio(batch, policy, base):
        return bench("decode", lambda rows: f"{tok_s(rows, batch, policy) / tok_s(rows, batch, base):.2f}×"
                     if any(r["policy"] == base for r in rows) else "–")

    def round_cost(shape, policy, field="x_random"):
        def value(rows):
            r = next(x for x in rows if x["shape"] == shape and x["policy"] == policy)
            return f"{r[field]:.2f} ms" if field == "ms" else f"{r[field]:.2f}×"
        return bench("round_cost", value)

    def vs_floor(rows):
        r = next(x for x in rows if x["shape"] == "Qwen3-4B K=1024" and x["policy"] == "random")
        return f"{r['ms'] / r['copy_floor_ms']:.2f}×"

    def scaling(batch, policy):
        def value(rows):
            r = next(x for x in rows if x["batch"] == batch and x["policy"] == policy)
            return f"{r['x_full']:.2f}×"
        return bench("batch_scaling", value)

    def memory(field):
        return bench("memory", lambda rows: f"{next(x for x in rows if x['policy'] == 'random')[field]:.2f}×")

    rows = [
        ("head pooling: Retrieval, fact in every head", *cell("head_pooling", "retrieval", condition="all"), "0.99 (8 heads)"),
        ("head pooling: Retrieval, best single head (head 2)", *cell("head_pooling", "retrieval", condition="h2"), "0.03"),
        ("head pooling: Recall R, fact left to Random", *cell("head_pooling", "recall", condition="policy"), "–"),
        ("scatter: Recall R, scattered (mean of phases)", *cell("scatter", "recall", condition="scattered (mean of phases)"), "0.33"),
        ("scatter: Recall R, intact (mean of pairs)", *cell("scatter", "recall", condition="intact (mean of pairs)"), "0.39"),
        ("blocks: Δ next-token loss, block 1", *cell("blocks", "delta_nll", block="1"), "≈ 0 (T=1,024)"),
        ("blocks: Δ next-token loss, block 256", *cell("blocks", "delta_nll", block="256"), "degrades"),
        ("passcode: Retrieval, Random", *cell("passcode", "retrieval", policy="random"), "0.000"),
        ("passcode: Retrieval, R-KV", *cell("passcode", "retrieval", policy="rkv"), "0.836"),
        ("passcode: Retrieval, VaSE", *cell("passcode", "retrieval", policy="vase"), "0.344"),
        ("passcode: mean LP, R-KV", *cell("passcode", "mean_lp", 2, policy="rkv"), "–"),
        ("passcode: mean LP, VaSE", *cell("passcode", "mean_lp", 2, policy="vase"), "–"),
        # like for like: the paper's 0.9375 per round is score-only survival ((T - r)/T, K=1,024, r=64), which T=256,
        # r=16 share; the protected number's analytic value is ((T - r - lp)/(T - lp))^12 and has no paper counterpart
        ("survival: Random per head after 12 rounds, score only", *cell("survival", "s_h12", policy="random", mode="score-only"), "0.9375^12 = 0.461 (K=1,024, r=64: the same (T − r)/T)"),
        ("survival: Random per head after 12 rounds, protected", *cell("survival", "s_h12", policy="random", mode="protected"), "– (analytic ((T − r − ℓp)/(T − ℓp))^12 = 0.323)"),
        ("survival: R-KV per head after 12 rounds, protected", *cell("survival", "s_h12", policy="rkv", mode="protected"), "–"),
        ("survival: Random slot coverage, protected", *cell("survival", "slot_coverage", policy="random", mode="protected"), ".999–1.000"),
        ("prompt protection: Random gain", *cell("prompt_protection", "gain", policy="random"), "+0.42 (MATH500 accuracy)"),
        ("prompt protection: SnapKV gain", *cell("prompt_protection", "gain", policy="snapkv"), "+0.13 (MATH500 accuracy)"),
        ("shared draw: Δ loss, shared − per-head", *cell("shared_draw", "value", measure="delta_nll_vs_full", policy="shared - per-head"), "≈ 0"),
        ("copy accuracy T=256 protected: Random", *acc("random", "copy K=256"), "–"),
        ("copy accuracy T=256 protected: SnapKV", *acc("snapkv", "copy K=256"), "–"),
        ("copy accuracy T=256 protected: recency", *acc("recency", "copy K=256"), "–"),
        ("copy accuracy T=256 score only: Random", *acc("random", "copy K=256 score only"), "–"),
        ("copy accuracy T=320 protected: Random", *acc("random", "copy K=320"), "–"),
        ("decode tokens/s, batch 1, Random × full (4,096 tokens, T=1,024, r=64)", *ratio(1, "random", "full"),
         "0.52–0.96× (short compute-bound runs)"),
        ("decode tokens/s, batch 1, Random × sliding window of T + r", *ratio(1, "random", "window"), "–"),
        ("round cost, Qwen3-4B layer, T=1,024: Random", *round_cost("Qwen3-4B K=1024", "random", "ms"),
         "≈ 0.30 ms (H200)"),
        ("round cost, Qwen3-4B layer, T=1,024: Random × copying the kept pairs once", *bench("round_cost", vs_floor), "–"),
        ("round cost, Qwen3-4B layer, T=1,024: TriAttention × Random", *round_cost("Qwen3-4B K=1024", "triattention"),
         "≈ 5× (1.47–1.64 ms)"),
        ("round cost, Qwen3-4B layer, T=1,024: SnapKV × Random", *round_cost("Qwen3-4B K=1024", "snapkv"), "–"),
        ("batch amplification, batch 64, Random × full (256 tokens, T=128, r=16)", *scaling(64, "random"), "–"),
        ("batch amplification, batch 64, SnapKV × full", *scaling(64, "snapkv"), "–"),
        ("peak memory, 8,000 tokens, T=1,024, r=64: Random's peak RSS × full", *memory("x_full_rss_peak"), "–"),
        ("peak memory, 8,000 tokens: Random's peak KV bytes × full", *memory("x_full_kv_peak"), "–"),
    ]
    body = t.markdown(["headline number (embedded SmolLM2-135M unless the paper's)", f"before ({OLD_REVISION})",
                       "paper's engine", "the paper (Qwen3-4B)"], [list(r) for r in rows])
    return body + ["", f"*Before: `docs/data/old-engine/` (`python -m figures.before_after --snapshot`, from git revision "
                       f"`{OLD_REVISION}`). After: the shipped results named in each probe's table in "
                       "[probes.md](probes.md). The paper: `SPEC.md` §4.*"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--snapshot", action="store_true", help=f"copy the files of revision {OLD_REVISION} out of git")
    args = p.parse_args(argv)
    if args.snapshot:
        snapshot()
        print(f"wrote {OLD}")
    else:
        print("\n".join(table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
