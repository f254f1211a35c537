"""Two facts in two heads: recall of both answers together vs the sum of the singles."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from analysis.planted import pair_tests, summarize

from . import style


def plot(rows: list[dict], out_dir=None, name: str = "two_facts") -> list[Path]:
    """Draw two facts in two heads from the probe's result rows."""
    config = rows[0]["config"]
    names = list(dict.fromkeys(r["condition"] for r in rows))
    pairs = [tuple(int(h) for h in n.replace("x@", "").replace("y@", "").split("+")) for n in names if "+" in n]
    summ = summarize(rows, names, fact=None, seed=config["seed"])
    style.apply()
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(pairs) + 2), 4))
    width = 0.25
    for i, (a, b) in enumerate(pairs):
        xa, yb, both = summ[f"x@{a}"].recall, summ[f"y@{b}"].recall, summ[f"x@{a}+y@{b}"].recall
        ax.bar(i - width, xa.value, width, color=style.PALETTE[0], label="x in head a alone" if i == 0 else None)
        ax.bar(i - width, yb.value, width, bottom=xa.value, color=style.PALETTE[2],
               label="+ y in head b alone (sum of singles)" if i == 0 else None)
        ax.bar(i + width * 0.2, both.value, width, color=style.PALETTE[1], label="x in a and y in b together" if i == 0 else None)
        style.errorbar(ax, i + width * 0.2, both, color="black", ms=0)
        sup = pair_tests(rows, a, b, config["seed"])["superadditivity"]
        ax.text(i, max(both.hi, xa.value + yb.value) + 0.03, f"{sup.value:+.2f}\n[{sup.lo:+.2f}, {sup.hi:+.2f}]",
                ha="center", fontsize=7)
    ax.set_xticks(range(len(pairs)), [f"a={a}, b={b}" for a, b in pairs])
    ax.set_ylabel("Recall R of both answers (summed log-prob)")
    ax.set_xlabel("KV heads: x kept only in a, y only in b (numbers: together - sum of singles, 95% CI)")
    ax.legend(fontsize=8, loc="upper left")
    n = summ[names[0]].n
    fig.suptitle(f"Two facts in two heads: {style.geometry(config)}; n={n}", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
