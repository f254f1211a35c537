"""The measured tables in ``docs/``, rendered from the shipped result files (no model is run).

    python -m figures.tables            # rewrite every table block in docs/*.md from data/results/
    python -m figures.tables --check    # exit 1 (naming the block) when a block differs from its results

A doc marks a table as ``<!-- table: NAME -->`` ... ``<!-- /table -->``; everything between the markers is
generated here, so a number in a table can only come from its result file. Each block ends with the file, the
command that made it and the revision its rows were computed at. Results are read from ``data/results/`` under
the current folder when there, else from the shipped copy (as ``python -m figures`` does).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Callable

from analysis.files import replacing
from analysis.names import shipped_name
from analysis.registry import PROBES

from figures.table_io import (bench_footer, ci, f, footer, markdown, provenance, read_csv, read_json, read_jsonl,
                              result_path)

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


# -- one function per table ------------------------------------------------------------------------
HEAD_NAMES = {"deleted": "no head (deleted)", "all": "every head (kept everywhere)", "policy": "left to Random",
              "full": "full cache (no eviction)"}


def _condition(name: str) -> str:
    if name in HEAD_NAMES:
        return HEAD_NAMES[name]
    if name.startswith("h"):
        heads = name[1:]
        return ("heads " if "+" in heads else "head ") + heads
    return name


PLANTED_COLUMNS = ["Retrieval [95% CI]", "Recall R [95% CI]", "R against the full cache", "mean LP"]


def _planted_cells(r: dict) -> list[str]:
    return [ci(r, "retrieval"), ci(r, "recall"), ci(r, "recall_full"), f(r["mean_lp"], 2)]


def head_pooling() -> list[str]:
    rel = shipped_name("head_pooling", "summary")
    rows = read_csv(rel)
    body = markdown(["fact kept in"] + PLANTED_COLUMNS, [[_condition(r["condition"])] + _planted_cells(r) for r in rows])
    return body + ["", footer(rel, "python -m probes.head_pooling", shipped_name("head_pooling"))]


def head_pooling_pairs() -> list[str]:
    """Every pair's superadditivity, ``R(a+b) − R(a) − R(b)`` with its bootstrap CI, from the shipped rows (the
    probe prints the same lines; analysis.planted computes both)."""
    import itertools

    from analysis.planted import subset_label, superadditivity

    rel = shipped_name("head_pooling")
    rows = read_jsonl(rel)
    heads = sorted({int(h) for r in rows if r["condition"].startswith("h") and "+" not in r["condition"]
                    for h in r["condition"][1:].split("+")})
    n = max(heads) + 1 if heads else 0  # the subsets name heads 0..n-1 ("all" is every head)
    body = []
    for a, b in itertools.combinations(range(n), 2):
        na, nb, nab = (subset_label(x, n) for x in ((a,), (b,), (a, b)))
        est = superadditivity(rows, na, nb, nab)
        verdict = "superadditive" if est.lo > 0 else "subadditive" if est.hi < 0 else "additive within the CI"
        body.append([f"heads {a}+{b}", f"{est.value:+.3f} [{est.lo:+.3f}, {est.hi:+.3f}]".replace("-", "−"), verdict])
    return (markdown(["pair", "R(a+b) − R(a) − R(b) [95% CI]", "reading"], body)
            + ["", footer(rel, "python -m probes.head_pooling", rel)])


def calibration() -> list[str]:
    """Every regime calibration under ``data/results/calibration/`` (``python -m probes.calibrate_regime``): per task
    and point the ceiling's, Random's and recency's scores, and the point the rule (or its declared fallback tier)
    chose; a sentence while none has been run."""
    folder = result_path("calibration")
    files = sorted(folder.glob("*/*/regime.json")) if folder.is_dir() else []
    if not files:
        return ["No calibration has been run yet: `python -m probes.calibrate_regime TASK --values ...` writes "
                "`data/results/calibration/<setting>/<task>/regime.json`, which this table is rendered from."]
    body, sources = [], []
    for path in files:
        rel = path.relative_to(folder.parent).as_posix()
        data = read_json(rel)
        chosen = data.get("chosen") or {}
        pick = chosen.get(data["knob"])
        settings = data["settings"]
        for point in data["points"]:
            s = point["scores"]
            mark = "–"
            if point["value"] == pick:
                mark = "**chosen** (rule)" if chosen.get("tier", "rule") == "rule" else "**chosen** (fallback tier)"
            budget = "swept" if data["knob"] == "budget" else str(settings["budget"])
            body.append([data["task"], budget, str(settings["buffer"]),
                         f"{data['knob']} {point['value']}", str(settings["units"]), f(s.get("ceiling")),
                         f(s.get("random")), f(s.get("recency")), mark])
        if not chosen:
            body.append([data["task"], "", "", "", "", "", "", "", "no point chosen (no regime on this model)"])
        sources.append(f"`data/results/{rel}`")
    command = "python -m probes.calibrate_regime TASK --values ... [--fallback]"
    return (markdown(["task", "T", "r", "point", "units", "ceiling", "Random", "recency", "choice"], body)
            + ["", f"*From {', '.join(sources)} (`{command}`; the command lines of each point are in its file).*"])


def scatter() -> list[str]:
    rel = shipped_name("scatter", "summary")
    rows = read_csv(rel)
    body = markdown(["condition", "Retrieval [95% CI]", "Recall R [95% CI]", "mean LP"],
                    [[_condition(r["condition"]), ci(r, "retrieval"), ci(r, "recall"), f(r["mean_lp"], 2)]
                     for r in rows])
    return body + ["", footer(rel, "python -m probes.scatter", shipped_name("scatter"))]


def two_facts() -> list[str]:
    rel = shipped_name("two_facts", "summary")
    rows = read_csv(rel)
    single = [r for r in rows if r["answer"] in ("x", "y") and "+" not in r["condition"]]
    body = markdown(["answer", "condition", "Retrieval [95% CI]", "Recall R [95% CI]"],
                    [[r["answer"], _condition(r["condition"]), ci(r, "retrieval"), ci(r, "recall")] for r in single])
    pairs = [r for r in rows if r["answer"] == "x and y" and " - " in r["condition"]]
    body += ["", "Superadditivity of both answers together, `R_xy(x@a+y@b) − R_xy(x@a) − R_xy(y@b)`:", ""]
    body += markdown(["pair", "difference [95% CI]"], [[r["condition"], ci(r, "recall", signed=True)] for r in pairs])
    return body + ["", footer(rel, "python -m probes.two_facts", shipped_name("two_facts"))]


def blocks() -> list[str]:
    rel = shipped_name("blocks", "summary")
    rows = read_csv(rel)
    body = markdown(["block", "blocks per head", "Δ next-token loss vs full [95% CI]", "Recall R of a fact left to it",
                     "Retrieval"],
                    [[r["block"], f(r["blocks_per_head"], 0), ci(r, "delta_nll"), ci(r, "recall"), ci(r, "retrieval")]
                     for r in rows])
    return body + ["", footer(rel, "python -m probes.blocks", shipped_name("blocks"))]


def shared_draw() -> list[str]:
    rel = shipped_name("shared_draw", "summary")
    rows = read_csv(rel)
    body = markdown(["measure", "policy", "n", "value [95% CI]"],
                    [[r["measure"], r["policy"], r["n"], ci(r, "value", signed=" - " in r["policy"])] for r in rows])
    return body + ["", footer(rel, "python -m probes.shared_draw", shipped_name("shared_draw"))]


def passcode() -> list[str]:
    rel = shipped_name("passcode", "summary")
    rows = read_csv(rel)
    body = markdown(["policy", "Retrieval [95% CI]", "mean LP [95% CI]", "LP vs Random [95% CI]"],
                    [[r["policy"], ci(r, "retrieval"), ci(r, "mean_lp", 2), ci(r, "lp_vs_random", 2, signed=True)]
                     for r in rows])
    return body + ["", footer(rel, "python -m probes.passcode", shipped_name("passcode"))]


def prompt_protection() -> list[str]:
    rel = shipped_name("prompt_protection", "summary")
    rows = read_csv(rel)
    body = markdown(["policy", "digits recalled, score only", "protected", "gain [95% CI]", "LP gain [95% CI]"],
                    [[r["policy"], f(r["digit_acc_score_only"]), f(r["digit_acc_protected"]),
                      ci(r, "gain", signed=True), ci(r, "lp_gain", 2, signed=True)] for r in rows])
    return body + ["", footer(rel, "python -m probes.prompt_protection", shipped_name("prompt_protection"))]


def survival() -> list[str]:
    from analysis.survival import mean_deficit, pool

    rel = shipped_name("survival")
    pooled = pool(read_jsonl(rel))
    out = []
    for p in pooled.values():
        m, c = p.metrics, p.by_rounds
        i = 12 - 1  # bin i holds what has been through i + 1 rounds
        at12 = (f(c.head[i]), f(c.union[i])) if len(c.total) > i and c.total[i] else ("–", "–")
        out.append([f"`{p.policy}`", p.mode, f(m["slot_coverage"]), f"{f(m['prompt_union'])} / {f(m['prompt_head'])}",
                    f(m["jaccard"], 2), f(m["entropy"], 2), *at12, f(mean_deficit(c), 3, signed=True)])
    body = markdown(["policy", "mode", "slot coverage", "prompt survival union / per head", "Jaccard", "entropy",
                     "s_h(12)", "s_U(12)", "deficit"], out)
    return body + ["", footer(rel, "python -m probes.survival")]


def survival_random() -> list[str]:
    from analysis.survival import pool

    rel = shipped_name("survival")
    pooled = pool(read_jsonl(rel))
    out = []
    for mode in ("protected", "score-only"):
        p = pooled.get(("random", mode))
        if p is None:
            continue
        c, (head, union) = p.by_rounds, p.analytic_rounds
        ns = [n for n in (1, 2, 4, 8, 12, 16, 20, 24) if n <= len(c.total) and c.total[n - 1]]  # bin n - 1: n rounds
        out.append((mode, ns, [f(c.head[n - 1], 4) for n in ns], [f(head[n - 1], 4) for n in ns],
                    [f(c.union[n - 1], 4) for n in ns], [f(union[n - 1], 4) for n in ns]))
    body = []
    for mode, ns, mh, ah, mu, au in out:
        body += [f"Random, {mode}:", ""]
        body += markdown(["n rounds"] + [str(n) for n in ns],
                         [["per head, measured"] + mh, ["per head, analytic"] + ah,
                          ["union, measured"] + mu, ["union, analytic"] + au])
        body.append("")
    return body + [footer(rel, "python -m probes.survival")]


def accuracy() -> list[str]:
    rel = shipped_name("accuracy")
    table = result_path(rel).with_suffix(".table.md").read_text().strip().splitlines()
    protocols = sorted({str(r.get("protocol")) for r in read_jsonl(rel)})
    return table + ["", f"Protocols in the file: {', '.join(protocols)}. "
                          + footer(rel, "python -m probes.accuracy --protocol matched --budget 256` then "
                                        "`python -m probes.accuracy --budget 320 384")]


def accuracy_repeat() -> list[str]:
    from analysis.accuracy import table_results
    from analysis.repeat import DEGENERATE, LINES
    from randattn.stats import comparison_table

    rel = shipped_name("accuracy_repeat")
    rows = read_jsonl(rel)
    table = result_path(rel).with_suffix(".table.md").read_text().strip().splitlines()
    sweep = sorted({(r["budget"], r["compression"]) for r in rows if r.get("compression")}, reverse=True)
    shares = [{**r, "share": r["copies"] / LINES} for r in rows]
    copies = comparison_table(table_results(shares, "repeat", "share"), reference="random").strip().splitlines()

    def how(group: list[dict]) -> list[str]:
        """How the generations ended: copies written (the endpoint, capped at 64), tokens, stopped by themselves,
        degenerate (one digit 30+ times in a row), and the fidelity of the copies written (the other endpoint)."""
        n = len(group)
        fid = [r["fidelity"] for r in group if r["fidelity"] is not None]
        return [f"{sum(r['copies'] for r in group) / n:.1f}", f"{sum(r['gen_len'] for r in group) / n:,.0f}",
                f"{sum(bool(r['terminated']) for r in group)} of {n}",
                f"{sum(bool(DEGENERATE.search(r['output'])) for r in group)} of {n}",
                f"{sum(fid) / len(fid):.3f}" if fid else "–", f"{n - len(fid)} of {n}"]

    arms = list(dict.fromkeys((r["policy"], r["budget"]) for r in rows))
    detail = markdown(["method", "K", "copies written (mean, of 64)", "tokens (mean)", "stopped by itself",
                       "degenerate", "fidelity of copies written", "no copy written"],
                      [[pol, "–" if k is None else str(k)] + how([r for r in rows if (r["policy"], r["budget"]) == (pol, k)])
                       for pol, k in arms])
    return (["Fidelity of the copies written (the row's grade; content kept):", ""] + table
            + ["", f"Copies written, as a share of {LINES} (generation behaviour: when the model stopped):", ""] + copies
            + ["", "Budgets: " + ", ".join(f"K={k} is {c:g}×" for k, c in sweep) + " (of the mean full-attention "
               "length). How the generations ended:", ""] + detail + [
        "", footer(rel, "python -m probes.accuracy --task repeat --compression 2 4 8 16 --policy full random "
                        "triattention vase --runs 1")])


def prompt_budget() -> list[str]:
    rel = shipped_name("accuracy_prompt_budget")
    table = result_path(rel).with_suffix(".table.md").read_text().strip().splitlines()
    return table + ["", footer(rel, "python -m probes.accuracy --policy full random snapkv random-pcap random-pmix "
                                    "--policy-option random-pcap:cap=64 random-pmix:small=64 --budget 256 "
                                    "--out data/results/accuracy_prompt_budget")]


def challenge() -> list[str]:
    """The shipped challenge: its board rows (the leaderboard's, for the example selector), then the descriptive
    rows (cost medians, keep-sets)."""
    folder = shipped_name("challenge", "folder")
    rows = read_csv(f"{folder}/verdict.csv")
    body = markdown(["task", "metric", "n", "selector [95% CI]", "Random [95% CI]", "full attention",
                     "difference [95% CI]", "sign W/L/T", "p (Holm)", "MDE", "verdict", "log-prob difference [95% CI]",
                     "Recall R",
                     "round cost vs Random"],
                    [[r["test"], r["metric"], r["n"], ci(r, "value"), ci(r, "random"), f(r.get("full_attention")),
                      ci(r, "delta", signed=True), f"{r['wins']}/{r['losses']}/{r['ties']}", p_cells(r), mde_cell(r),
                      r["verdict"],
                      (ci(r, "lp_delta", 2, signed=True) + ("*" if r["lp_verdict"] in ("better", "worse") else ""))
                      if r.get("lp_delta") else "–",
                      f"{f(r['recall'])} vs {f(r['random_recall'])}" if r.get("recall") else "–",
                      "×" + f(r["round_cost_ratio"], 2) if r.get("round_cost_ratio") else "–"] for r in rows])
    extra = read_csv(f"{folder}/descriptive.csv") if result_path(f"{folder}/descriptive.csv").exists() else []
    if extra:
        body += ["", "Descriptive rows (no test): cost medians measured side by side, keep-set metrics.", ""]
        body += markdown(["part", "metric", "policy", "selector", "Random", "difference [95% CI] or ratio"],
                         [[r["test"], r["metric"], r["policy"], f(r["value"]), f(r["random"]),
                           ci(r, "delta", signed=True) if r.get("delta") else
                           ("×" + f(r["ratio"], 2) if r.get("ratio") else "–")] for r in extra])
    accuracy_rows = sorted(p for p in result_path(folder).rglob("*.jsonl")
                           if "work" not in p.relative_to(result_path(folder)).parts
                           and p.parent != result_path(folder))  # the accuracy part's rows, in <task>/
    return body + [
        "", footer(f"{folder}/verdict.csv",
                   "python -m probes.challenge --policy examples/attention_selector.py:recent_attention --quick",
                   f"{folder}/{accuracy_rows[0].relative_to(result_path(folder)).as_posix()}")]


def p_cells(r: dict) -> str:
    """A board row's p (the larger of the bootstrap's and the sign test's) and its Holm-adjusted value across the
    board; rows written before the board adjusted (no ``p_adjusted``) show the sign test's p alone."""
    if not r.get("p_adjusted"):
        return f(r["p_sign"])
    return f"{f(r['p'])} ({f(r['p_adjusted'])})"


def mde_cell(r: dict) -> str:
    """A board row's minimum detectable effect (80% power, the board's Bonferroni level); 'none' where no
    difference is detectable at its n."""
    if not r.get("mde"):
        return "–"
    return "none" if float(r["mde"]) == float("inf") else f(r["mde"], 2)


LEADERBOARD_COMMAND = "python -m probes.leaderboard --runs 3 --instances 8 --cost-repeats 1"  # every task (the default)


def leaderboard() -> list[str]:
    rel = shipped_name("leaderboard", "table")
    rows = read_csv(rel)
    tasks = list(dict.fromkeys(r["test"] for r in rows))
    out = []
    for task in tasks:
        these = sorted((r for r in rows if r["test"] == task), key=lambda r: int(r["rank"]))
        ref = these[0]
        lp = any(r.get("lp_delta") for r in these)
        out.append([task, "", "random (reference)", ref["n"], ci(ref, "random"), "", "", "", "", "", "",
                    f(ref["random_gen_len"], 1) if ref.get("random_gen_len") else "–"]
                   + ([f"LP {f(ref['random_lp'], 2)}"] if lp else ["–"]))
        for r in these:
            out.append([task, r["rank"], r["policy"], r["n"], ci(r, "value"), ci(r, "delta", signed=True),
                        f"{r['wins']}/{r['losses']}/{r['ties']}", p_cells(r), mde_cell(r), r["verdict"],
                        "×" + f(r["round_cost_ratio"], 2) if r.get("round_cost_ratio") else "–",
                        f(r["gen_len"], 1) if r.get("gen_len") else "–",
                        (ci(r, "lp_delta", 2, signed=True) + ("*" if r["lp_verdict"] in ("better", "worse") else ""))
                        if r.get("lp_delta") else "–"])
    body = markdown(["task", "rank", "selector", "n", "score [95% CI]", "difference from Random [95% CI]",
                     "sign W/L/T", "p (Holm)", "MDE", "verdict", "round cost vs Random", "generated length",
                     "log-prob difference [95% CI]"], out)
    folder = shipped_name("leaderboard", "folder")
    sources = [p for p in sorted(result_path(folder).rglob("*.jsonl")) if "work" not in p.relative_to(
        result_path(folder)).parts]
    rows_from = "; ".join(f"{p.relative_to(result_path(folder)).as_posix()}: "
                          f"{provenance(f'{folder}/{p.relative_to(result_path(folder)).as_posix()}')}"
                          for p in sources)
    return body + ["", f"*From `data/results/{rel}` (`{LEADERBOARD_COMMAND}`); its rows: {rows_from}.*"]


BOARD_COMMAND = "python -m probes.board merge data/boards/{name}.toml"


def board() -> list[str]:
    """Every board under ``data/results/board/`` (``python -m probes.board``): per task, endpoint and selector the
    difference from Random with its CI, raw and board-adjusted p, the MDE and the verdict; a sentence while none has
    been run."""
    from analysis.names import result_name

    folder = result_path("board")
    tables = sorted(p for p in folder.glob("*/board.csv")) if folder.is_dir() else []
    if not tables:
        return ["No board has been run yet: `python -m probes.board merge data/boards/NAME.toml` writes "
                "`data/results/board/NAME/board.csv`, which this table is rendered from."]
    out: list[str] = []
    for path in tables:
        name = path.parent.name
        rel = f"board/{result_name('board', {'name': name}, 'table')}"
        rows = read_csv(rel)
        body = []
        for r in rows:
            if r["verdict"] == "missing":
                body.append([r["task"], r["endpoint"] or "–", r["selector"], "–", r["T"], r["r"], "–", "–", "–", "–",
                             "–", "missing (no rows yet)"])
                continue
            digits = 2 if r["mde_units"] == "nats" else 3
            body.append([r["task"], r["endpoint"], r["selector"], r["n"], r["T"], r["r"],
                         ci(r, "value", digits), ci(r, "random", digits), ci(r, "delta", digits, signed=True),
                         f"{f(r['p'])} ({f(r['p_adjusted'])})",
                         mde_cell(r) + (" nats" if r["mde_units"] == "nats" and mde_cell(r) != "none" else ""),
                         r["verdict"] + (f" ({r['note']})" if r.get("note") else "")])
        scored = [r for r in rows if r["verdict"] != "missing"]
        rule = (f"{'Holm' if scored[0]['adjustment'] == 'holm' else 'Benjamini-Hochberg'} across all "
                f"{scored[0]['family']} comparisons at alpha {scored[0]['alpha']}") if scored else "no comparison yet"
        resolved = result_path(f"board/{name}/board.json")
        spec = read_json(f"board/{name}/board.json").get("spec") if resolved.exists() else None
        command = f"python -m probes.board merge {spec}" if spec else BOARD_COMMAND.format(name=name)
        out += [f"Board `{name}` ({rule}):", ""]
        out += markdown(["task", "endpoint", "selector", "n", "T", "r", "value [95% CI]", "Random [95% CI]",
                         "difference [95% CI]", "p (adjusted)", "MDE", "verdict"], body)
        out += ["", f"*From `data/results/{rel}` (`{command}`).*", ""]
    return out[:-1]


BOARD_V2 = "smollm2-135m-v2"


def _verdict_counts(rows: list[dict], col: str = "verdict") -> str:
    """better / no detectable difference / worse, as counts over a task's selectors."""
    verdicts = [r[col] for r in rows]
    return f"{verdicts.count('better')}/{verdicts.count('no detectable difference')}/{verdicts.count('worse')}"


def _spread(rows: list[dict], col: str, digits: int) -> str:
    values = [float(r[col]) for r in rows if r.get(col) not in (None, "")]
    return f"{f(min(values), digits)} to {f(max(values), digits)}" if values else "–"


def _recorded_r(folder: str, task: str) -> str:
    """r as a leaderboard task's rows record it (the repeat task runs at its own, not the leaderboard's)."""
    (rows,) = sorted(result_path(f"{folder}/{task}").glob("*.jsonl"))
    return str(read_jsonl(f"{folder}/{task}/{rows.name}")[0]["config"]["buffer"])


def board_vs_leaderboard() -> list[str]:
    """The shipped leaderboard (one T and r for every task, 8-32 units, the repeat task at its own r = 8) beside the
    board re-run at the calibrated, pre-registered settings (``smollm2-135m-v2``): per task and endpoint the setting,
    the units, Random, the selectors' range and the count of verdicts, each side read from its own result file."""
    old_rel = shipped_name("leaderboard", "table")
    old_folder = shipped_name("leaderboard", "folder")
    old_rows = read_csv(old_rel)
    old_spec = read_json(f"{old_folder}/spec.json")["tasks"]
    new_rel = f"board/{BOARD_V2}/board.csv"
    new_rows = [r for r in read_csv(new_rel) if r["endpoint"] != "cost" and r["verdict"] != "missing"]
    body = []
    for (task, test, endpoint) in dict.fromkeys((r["task"], r["test"], r["endpoint"]) for r in new_rows):
        new = [r for r in new_rows if (r["task"], r["test"], r["endpoint"]) == (task, test, endpoint)]
        lp = endpoint == "log-prob"
        digits = 2 if lp else 3
        old = [r for r in old_rows if r["test"] == test and (r.get("lp_delta") if lp else True)]
        if old:
            spec = old_spec[task]["spec"]
            old_r = _recorded_r(old_folder, task) if task == "repeat" else spec["buffer"]
            value, ref, verdict = ("lp", "random_lp", "lp_verdict") if lp else ("value", "random", "verdict")
            old_cells = [old[0]["budget"], str(old_r), old[0]["n"], f(old[0][ref], digits),
                         _spread(old, value, digits), _verdict_counts(old, verdict)]
        else:
            old_cells = ["–"] * 6
        full = new[0].get("full_attention")
        body.append([task, endpoint] + old_cells
                    + [new[0]["T"], new[0]["r"], new[0]["n"], f(full, digits) if full else "–",
                       f(new[0]["random"], digits), _spread(new, "value", digits), _verdict_counts(new)])
    out = markdown(["task", "endpoint", "leaderboard T", "r", "n", "Random", "selectors", "better/ndd/worse",
                    "board T", "r", "n", "full attention", "Random", "selectors", "better/ndd/worse"], body)
    return out + ["", f"*Left: `data/results/{old_rel}` (`{LEADERBOARD_COMMAND}`; verdicts as that file gives them, "
                      f"Holm within the leaderboard). Right: `data/results/{new_rel}` (`python -m probes.board merge "
                      f"data/boards/{BOARD_V2}.toml`; Holm across the whole board). Log-prob values in nats, as each "
                      f"task's log-prob endpoint defines them; 'ndd': no detectable difference.*"]


def board_cost() -> list[str]:
    """The board ``smollm2-135m-v2``'s cost task: per selector, ms per eviction round and decode tokens/s as ratios
    to Random's, measured interleaved with Random in one unit (descriptive: no verdict)."""
    rel = f"board/{BOARD_V2}/board.csv"
    rows = read_csv(rel)
    per = {}
    for r in rows:
        if r.get("round_cost_ratio") or r.get("throughput_ratio"):
            per.setdefault(r["selector"], r)
    if not per:
        return [f"The cost task of `{BOARD_V2}` has no rows yet."]
    body = [[s, "×" + f(r["round_cost_ratio"], 2) if r.get("round_cost_ratio") else "–",
             "×" + f(r["throughput_ratio"], 2) if r.get("throughput_ratio") else "–"] for s, r in per.items()]
    spec = read_json(f"board/{BOARD_V2}/cost/spec.json")["tasks"]["cost"]["spec"]
    cost_rows = read_jsonl(f"board/{BOARD_V2}/cost/cost.jsonl")
    return markdown(["selector", "ms per round ÷ Random's", "decode tokens/s ÷ Random's"], body) + [
        "", f"*From `data/results/{rel}` (`python -m probes.board run data/boards/{BOARD_V2}.toml --tasks cost`, then "
            f"`merge`): T = {spec['budget']}, r = {spec['buffer']}, {spec['cost_batch']} sequences per timed "
            f"generation, {spec['cost_rounds']} rounds, {spec['cost_repeats']} repeat(s), each selector interleaved "
            f"with Random in one unit, units one at a time; rows: {provenance(f'board/{BOARD_V2}/cost/cost.jsonl')}"
            f" ({len(cost_rows)} rows).*"]


def autopsy() -> list[str]:
    out, sources = [], []
    for task in ("copy", "recall"):
        rel = shipped_name("autopsy", "summary", task=task)
        if not result_path(rel).exists():
            continue
        sources.append((task, rel))
        for r in read_csv(rel):
            out.append([task, r["policy"], r["problems"], r["diverged"], r["restored"],
                        f"{r['sufficient_prompt']} / {r['sufficient_recent']} / {r['sufficient_middle']}",
                        f"{r['necessary_prompt']} / {r['necessary_recent']} / {r['necessary_middle']}",
                        f(r["mean_grade_full"]), f(r["mean_grade_evicted"])])
    body = markdown(["task", "policy", "problems", "diverged", "restored by a pin",
                     "sufficient span in prompt / recent / middle", "necessary span in prompt / recent / middle",
                     "grade, full", "grade, evicted"], out)
    return body + [""] + [footer(rel, f"python -m probes.autopsy --task {task} --policy random snapkv --max-replays 8",
                                 shipped_name("autopsy", task=task, policy="random"))
                          for task, rel in sources]


def _median_rows(rows: list[dict]) -> dict:
    """``{(batch, policy): (median, min, max, first row)}`` of tokens/s over a benchmark's repeats."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["batch"], r["policy"]), []).append(r)
    return {k: (statistics.median(x["tokens_per_s"] for x in v), min(x["tokens_per_s"] for x in v),
                max(x["tokens_per_s"] for x in v), v[0]) for k, v in out.items()}


CACHE_NAMES = {"full": "full (HF DynamicCache)", "window": "window (HF sliding window, T + r pairs)"}


def _decode_rows(rel: str) -> list[list[str]]:
    med = _median_rows(read_json(rel)["rows"])
    out = []
    for (batch, policy), (m, lo, hi, r) in med.items():
        full, window = med.get((batch, "full")), med.get((batch, "window"))
        rng = f" [{lo:.2f}, {hi:.2f}]" if hi > lo else ""
        share = f"{100 * r['round_share']:.2f}%" if "round_share" in r else "–"
        out.append([str(batch), CACHE_NAMES.get(policy, f"`{policy}`"), f"{m:.2f}{rng}",
                    f"{m / full[0]:.2f}" if full else "–", f"{m / window[0]:.2f}" if window else "–",
                    f"{r['kv_bytes_end'] / 2**20:,.1f}",
                    f"{r['kv_bytes_end'] / full[3]['kv_bytes_end']:.2f}" if full else "–",
                    str(r.get("rounds_per_layer", "–")), share])
    return out


DECODE_HEADER = ["batch", "cache", "tokens/s, median [range]", "× full", "× window", "KV MiB at end", "KV × full",
                 "rounds per layer", "time in rounds"]


def bench_decode() -> list[str]:
    out = []
    for rel, command in (("bench/decode.json", "python -m bench.decode --batches 1 --repeats 2 --threads 2"),
                         ("bench/decode_b8.json", "python -m bench.decode --batches 8 --threads 2 --out "
                                                  "data/results/bench/decode_b8.json")):
        if not result_path(rel).exists():
            continue
        meta = read_json(rel)["meta"]
        out += [f"{meta['new_tokens']:,} new tokens, T={meta['budget']:,}, r={meta['buffer']}, "
                f"{meta.get('repeats', 1)} repeat(s), {meta['torch_threads']} threads:", ""]
        out += markdown(DECODE_HEADER, _decode_rows(rel)) + ["", bench_footer(rel, command), ""]
    return out[:-1]


def bench_batch_scaling() -> list[str]:
    rel = "bench/batch_scaling.json"
    rows = read_json(rel)["rows"]
    policies = [p for p in dict.fromkeys(r["policy"] for r in rows) if p != "full"]
    cell = {(r["batch"], r["policy"]): r for r in rows}
    body = []
    for batch in sorted({r["batch"] for r in rows}):
        full = cell[(batch, "full")]["tokens_per_s"]
        body.append([str(batch), f"{full:.1f}"]
                    + [f"{cell[(batch, p)]['tokens_per_s']:.1f} ({cell[(batch, p)]['tokens_per_s'] / full:.2f}×)"
                       for p in policies]
                    + [f"{100 * cell[(batch, 'random')]['round_share']:.1f}%"] * ("random" in policies))
    header = ["batch", "full"] + [f"`{p}`" for p in policies] + ["Random's time in rounds"] * ("random" in policies)
    return markdown(header, body) + ["", bench_footer(rel, "python -m bench.batch_scaling --batches 1 2 4 8 16 32 64 "
                                                           "--new-tokens 256 --budget 128 --buffer 16 --threads 2")]


def bench_memory() -> list[str]:
    rel = "bench/memory.json"
    mib = 2**20
    body = [[CACHE_NAMES.get(r["policy"], f"`{r['policy']}`"), f"{r['rss_peak_before'] / mib:,.0f}",
             f"{r['rss_peak'] / mib:,.0f}", f"{r['rss_growth'] / mib:,.0f}", f"**{r['x_full_rss_peak']:.2f}**",
             f"{r['kv_bytes_peak'] / mib:,.1f}", f"**{r['x_full_kv_peak']:.3f}**", str(r.get("rounds_per_layer", "–"))]
            for r in read_json(rel)["rows"]]
    return markdown(["cache", "peak RSS before generating MiB", "peak RSS MiB", "growth MiB", "peak RSS × full",
                     "peak KV MiB", "KV × full", "rounds per layer"], body) + [
        "", bench_footer(rel, "python -m bench.memory --threads 1")]


KVPRESS_PAPER = ("bench/kvpress_peer_paper_b1.json", "bench/kvpress_peer_paper.json")  # batch 1, batch 8


def _kvpress_command(rel: str, data: dict) -> str:
    meta, rows = data["meta"], data["rows"]
    no_full = "" if any(r["policy"] == "full" for r in rows) else " --no-full"
    n = max(c["repeats"] for c in data["comparison"])
    repeats = f" --repeats {n}" if n > 1 else ""
    return (f"python -m bench.kvpress_peer --new-tokens {meta['new_tokens']} --budget {meta['budget']} --buffer "
            f"{meta['buffer']} --batches {' '.join(map(str, meta['batches']))}{repeats} --policies "
            f"{' '.join(meta['policies'])}{no_full} --check-tokens {meta['check_tokens']} --threads "
            f"{meta['torch_threads']} --out data/results/{rel}")


def bench_kvpress() -> list[str]:
    """The kvpress peer at the paper's setting: each side's tokens/s (median [range] over the repeats), time in
    rounds and ours / kvpress."""
    body, sources = [], []
    for rel in KVPRESS_PAPER:
        if not result_path(rel).exists():
            continue
        data = read_json(rel)
        by_arm: dict = {}
        for r in data["rows"]:
            by_arm.setdefault((r["side"], r["batch"], r["policy"]), []).append(r)

        def tok_s(runs_):
            return f"{min(runs_):.2f}" if len(runs_) == 1 else (
                f"{statistics.median(runs_):.2f} [{min(runs_):.2f}, {max(runs_):.2f}]")

        def share(arm):
            return "–" if not arm or "round_share" not in arm[0] else \
                f"{100 * statistics.median(x['round_share'] for x in arm):.2f}%"

        for c in data["comparison"]:
            ours, peer = by_arm[("ours", c["batch"], c["policy"])], by_arm.get(("kvpress", c["batch"], c["policy"]))
            body.append([str(c["batch"]), CACHE_NAMES.get(c["policy"], f"`{c['policy']}`"), str(c["repeats"]),
                         tok_s(c["ours_runs"]), share(ours), tok_s(c["kvpress_runs"]) if c["kvpress_runs"] else "–",
                         share(peer), f"**{f(c['ours_over_kvpress'], 2)}**", f"{ours[0].get('rounds_per_layer', 0):g}",
                         f"{peer[0]['rounds_per_layer']:g}" if peer and "rounds_per_layer" in peer[0] else "–"])
        sources.append(bench_footer(rel, _kvpress_command(rel, data)))
    return markdown(["batch", "policy", "runs per side", "ours tokens/s", "ours: time in rounds", "kvpress tokens/s",
                     "kvpress: time in rounds", "ours / kvpress (medians)", "rounds per layer (ours)",
                     "rounds per layer (kvpress)"], body) + [""] + sources


def bench_kvpress_order() -> list[str]:
    """The untimed positions/order check of both sides (layer 0's kept keys matched to an uncompressed forward's)."""
    rel = "bench/kvpress_peer_checks.json"
    data = read_json(rel)
    body = [[side, f"`{policy}`", f"{'yes' if c['keys_exact'] else '**no**'} (max rel. error {c['max_rel_key_error']:.0e})",
             f"{c['chronological_heads']} of {c['heads']}", f"{c['ordered_adjacent_fraction']:.2f}",
             str(c["first4_kept_per_head"]), "yes" if c["newest_kept"] == c["newest_position"] else "no"]
            for side, checks in data["order_checks"].items() for policy, c in checks.items()]
    meta = data["meta"]
    command = (f"python -m bench.kvpress_peer --new-tokens {meta['new_tokens']} --budget {meta['budget']} --buffer "
               f"{meta['buffer']} --batches 1 --check-tokens {meta['check_tokens']} --threads {meta['torch_threads']} "
               f"--out data/results/{rel}")
    return markdown(["side", "policy", "keys exact at true positions", "chronological heads", "adjacent slots in order",
                     "positions 0–3 kept per head", "newest token kept"], body) + ["", bench_footer(rel, command)]


def grid_overhead() -> list[str]:
    rel = "bench/grid_overhead.json"
    body = [[f"`{r['backend']}`", str(r["workers"]), f"{r['wall_s']:.0f} s", f"{r['items_per_s']:.2f}",
             f"{r['start_to_first_batch_s']:.0f} s", f"{r['median_batch_s']:.1f} s",
             "yes" if r["same_rows_as_first_arm"] else "**no**"] for r in read_json(rel)["rows"]]
    return markdown(["backend", "workers", "wall", "items/s", "start to first batch", "one batch (median)",
                     "same rows as the first arm"], body) + ["", bench_footer(rel, "python -m bench.grid_overhead")]


def bench_pack() -> list[str]:
    rel = "bench/pack.json"
    data = read_json(rel)
    m = data["meta"]
    body = [[r["arm"], f"`{r['flags']}`", f"{r['wall_s']:.0f} s", f"{r['problems_per_hour']:.0f}",
             f"{r['x_one_at_a_time']:.2f}×"] for r in data["rows"]]
    command = (f"python -m bench.pack --problems {m['problems']} --batch {m['batch']} --policies "
               f"{' '.join(m['policies'])} --budget {m['budget']} --buffer {m['buffer']} --max-new-tokens "
               f"{m['max_new_tokens']} --threads {m['torch_threads']}")
    lengths = data["rows"][0]["prompt_lengths"]
    return markdown(["arm", "flags", "wall", "problems/h", "× one at a time"], body) + [
        "", f"Prompts {lengths[0]}–{lengths[1]} tokens ({lengths[2]} lengths); packed rows equal to the "
            f"one-at-a-time rows: {m['rows_equal']} of {m['rows_compared']}.", "", bench_footer(rel, command)]


def bench_main_job() -> list[str]:
    rel = "bench/main_job.json"
    data = read_json(rel)
    m = data["meta"]
    body = [[str(r["instances"]), f"{r['old_s']:.0f} s", f"{r['new_s']:.0f} s", f"**{r['x_faster']:.2f}×**",
             "identical" if r["rows_identical"] else "**differ**"] for r in data["rows"]]
    sizes = " ".join(str(r["instances"]) for r in data["rows"])
    extra = f" --new-args {' '.join(m['new_args'])}" if m.get("new_args") else ""
    return markdown(["--instances", f"old ({m['baseline']})", f"new ({m['new']})", "× faster", "rows (floats exact)"],
                    body) + ["", f"*From `data/results/{rel}` (`python -m bench.main_job --baseline {m['baseline']} "
                                 f"--instances {sizes}{extra}`; measured {m['date']} on {m['cores']} cores "
                                 f"({m['machine']}), one command at a time, nothing else running).*"]


def bench_equal_memory() -> list[str]:
    rel = "bench/equal_memory.json"
    rows = read_json(rel)["rows"]
    body = [[CACHE_NAMES.get(r["policy"], f"`{r['policy']}`"), str(r["batch"]), f"{r['kv_bytes_peak'] / 2**20:,.1f}", f"{r['tokens_per_s']:.2f}",
             f"{r['x_full_tokens_per_s']:.2f}", "yes" if r["fits"] else "no"] for r in rows]
    return markdown(["cache", "batch", "peak KV MiB", "tokens/s", "× full", "within the budget"], body) + [
        "", bench_footer(rel, "python -m bench.equal_memory --new-tokens 1024 --budget 256 --buffer 16 --base-batch 8 "
                              "--threads 2")]


def bench_replay() -> list[str]:
    body, sources = [], []
    for rel, command in (("bench/replay_speed_4096.json", "python -m bench.replay_speed --threads 2 --out "
                                                          "data/results/bench/replay_speed_4096.json"),
                         ("bench/replay_speed.json", "python -m bench.replay_speed --new-tokens 1024 --budget 256 "
                                                     "--buffer 16 --policies random snapkv --threads 2")):
        sources.append(bench_footer(rel, command))
        for r in read_json(rel)["rows"]:
            body.append([f"{r['budget']:,}", str(r["buffer"]), f"{r['new_tokens']:,}", f"`{r['policy']}`",
                         f"{r['replay_seconds']:.1f} ({r['replay_forwards']})",
                         f"{r['tokenwise_seconds']:.1f} ({r['tokenwise_forwards']:,})", f"**{r['speedup']:.1f}×**",
                         f"{r['max_abs_logprob_diff']:.1e}", "identical" if r["same_keep_sets"] else "differ",
                         "same" if r["same_argmax"] else "differ"])
    return markdown(["T", "r", "trace tokens", "policy", "replay s (forwards)", "token-by-token s (forwards)",
                     "speed-up", "max \\|Δ log-prob\\|", "keep-sets", "greedy predictions"], body) + [""] + sources


def bench_round_cost() -> list[str]:
    rel = "bench/round_cost.json"
    rows = read_json(rel)["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    cell = {(r["shape"], r["policy"]): r for r in rows}
    body = [[f"`{pol}`"] + [f"{cell[(s, pol)]['ms']:.2f} ms ({cell[(s, pol)]['x_random']:.2f}×)" for s in shapes]
            for pol in dict.fromkeys(r["policy"] for r in rows)]
    body.append(["copy floor"] + [f"{cell[(s, 'random')]['copy_floor_ms']:.2f} ms (Random "
                                  f"{cell[(s, 'random')]['ms'] / cell[(s, 'random')]['copy_floor_ms']:.2f}×)"
                                  for s in shapes])
    return markdown(["policy"] + shapes, body) + ["", bench_footer(rel, "python -m bench.round_cost --threads 2")]


def bench_aims() -> list[str]:
    """The benchmark aims the re-measured files answer, each with its measured value and whether it was met."""
    rows = []
    for rel in ("bench/decode.json", "bench/decode_b8.json"):
        if not result_path(rel).exists():
            continue
        med = _median_rows(read_json(rel)["rows"])
        for batch in sorted({b for b, _ in med}):
            rnd, window, full = (med.get((batch, p)) for p in ("random", "window", "full"))
            if rnd and window:
                x = rnd[0] / window[0]
                rows.append([f"Random ≥ 0.95× the sliding window's tokens/s, batch {batch}", f"{x:.2f}×",
                             "met" if x >= 0.95 else "missed"])
            if rnd and full:
                x = rnd[0] / full[0]
                rows.append([f"Random no slower than full attention, batch {batch}", f"{x:.2f}×",
                             "met" if x >= 1 else "missed"])
            if rnd:
                share = rnd[3]["round_share"]
                rows.append([f"eviction rounds ≤ 5% of decode time, batch {batch}", f"{100 * share:.2f}%",
                             "met" if share <= 0.05 else "missed"])
    if result_path("bench/kvpress_peer_paper.json").exists():
        for c in read_json("bench/kvpress_peer_paper.json")["comparison"]:
            if c["policy"] == "random" and c["ours_over_kvpress"]:
                x = c["ours_over_kvpress"]
                rows.append([f"Random ahead of kvpress's DecodingPress(RandomPress), batch {c['batch']}", f"{x:.2f}×",
                             "met" if x > 1 else "missed"])
    cost = read_json("bench/round_cost.json")["rows"]
    for r in (x for x in cost if x["policy"] == "random"):
        x = r["ms"] / r["copy_floor_ms"]
        rows.append([f"a Random round within 2× of copying the kept pairs once ({r['shape']})", f"{x:.2f}×",
                     "met" if x <= 2 else "missed"])
    return markdown(["aim (4,096 new tokens, T=1,024, r=64 for decode)", "measured", ""], rows)


def before_after() -> list[str]:
    from figures.before_after import table  # one way: before_after reads through figures.table_io only

    return table()


def bench_vllm() -> list[str]:
    from figures.vllm_table import table  # bench/vllm.json (python -m bench.vllm, in the vLLM environment)

    return table()


# Each registered probe's table (analysis.registry: the function of its name here), then the rest.
TABLES: dict[str, Callable[[], list[str]]] = {
    **{p.name: globals()[p.name] for p in PROBES if p.table},
    "survival_random": survival_random, "challenge": challenge, "before_after": before_after,
    "head_pooling_pairs": head_pooling_pairs,
    "prompt_budget": prompt_budget, "bench_decode": bench_decode,
    "bench_round_cost": bench_round_cost, "bench_aims": bench_aims,
    "bench_equal_memory": bench_equal_memory, "bench_replay": bench_replay,
    "accuracy_repeat": accuracy_repeat, "bench_batch_scaling": bench_batch_scaling, "bench_memory": bench_memory,
    "bench_kvpress": bench_kvpress, "bench_kvpress_order": bench_kvpress_order, "grid_overhead": grid_overhead,
    "bench_pack": bench_pack, "bench_vllm": bench_vllm, "bench_main_job": bench_main_job, "board": board,
    "calibration": calibration, "board_vs_leaderboard": board_vs_leaderboard, "board_cost": board_cost,
}


def render(text: str, where: str) -> str:
    def block(m: re.Match) -> str:
        name = m["name"]
        if name not in TABLES:
            raise SystemExit(f"{where}: unknown table {name!r} (known: {', '.join(TABLES)})")
        return m.group(1) + "\n".join(TABLES[name]()) + "\n" + m.group(4)

    return BLOCK.sub(block, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 naming every stale doc")
    p.add_argument("--docs", default=str(DOCS), help="folder of the markdown docs (default: the checkout's docs/)")
    args = p.parse_args(argv)
    stale = []
    for path in sorted(Path(args.docs).glob("*.md")):
        old = path.read_text()
        new = render(old, str(path))
        if new != old:
            stale.append(path)
            if not args.check:
                with replacing(path, check=False) as tmp:  # a kill leaves the old doc or the new one
                    tmp.write_text(new)
    for path in stale:
        print(f"{path}: {'stale, run python -m figures.tables' if args.check else 'tables rewritten'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
