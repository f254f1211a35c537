"""Benchmark figures: decode throughput and KV memory (full vs Random), per-round cost per policy, batch scaling."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter, ScalarFormatter

from . import style


def plot_decode(data: dict, out_dir=None, name: str = "bench_decode") -> list[Path]:
    """Draw the decode benchmark from its result (``{"meta": ..., "rows": [...]}``): every cache it ran (full
    attention, the sliding-window floor, each policy), medians over the repeats with their range."""
    import statistics

    meta, rows = data["meta"], data["rows"]
    batches = sorted({r["batch"] for r in rows})
    arms = list(dict.fromkeys(r["policy"] for r in rows))
    label = {"full": "full attention", "window": f"sliding window ({meta['budget'] + meta['buffer']} pairs)"}
    style.apply()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        runs = {b: [r for r in rows if r["policy"] == arm and r["batch"] == b] for b in batches}
        present = [i for i, b in enumerate(batches) if runs[b]]
        xs = [i + (j - (len(arms) - 1) / 2) * width for i in present]
        tok = [[r["tokens_per_s"] for r in runs[batches[i]]] for i in present]
        med = [statistics.median(t) for t in tok]
        err = [[m - min(t) for m, t in zip(med, tok)], [max(t) - m for m, t in zip(med, tok)]]
        text = label.get(arm, f"{arm} (K={meta['budget']}, r={meta['buffer']})")
        axes[0].bar(xs, med, width, yerr=err, capsize=3, label=text, color=style.PALETTE[j])
        axes[1].bar(xs, [runs[batches[i]][0]["kv_bytes_end"] / 2**20 for i in present], width, label=text,
                    color=style.PALETTE[j])
        if arm != "full":
            for x, i, m in zip(xs, present, med):
                full = [r["tokens_per_s"] for r in rows if r["policy"] == "full" and r["batch"] == batches[i]]
                if full:
                    axes[0].text(x, m, f"{m / statistics.median(full):.2f}x", ha="center", va="bottom", fontsize=8)
    for ax, ylabel in ((axes[0], "decode throughput (tokens/s), median and range"),
                       (axes[1], "KV cache at the end (MiB)")):
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_ylabel(ylabel)
    axes[1].legend(fontsize=8, loc="upper right")  # the KV panel has room above the evicting caches
    fig.suptitle(f"Decoding {meta['new_tokens']} new tokens: {style.model_label(meta['model'])} on {meta['device']} "
                 f"({meta.get('torch_threads', '?')} threads), {meta['dtype'].replace('torch.', '')}; "
                 f"{meta.get('repeats', 1)} repeat(s)", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)


def plot_round_cost(data: dict, out_dir=None, name: str = "bench_round_cost") -> list[Path]:
    """Draw the round-cost benchmark from its result."""
    rows = data["rows"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    style.apply()
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        sel = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["ms"])
        colors = [style.PALETTE[1] if r["policy"] == "random" else style.PALETTE[0] for r in sel]
        ax.barh([r["policy"] for r in sel], [r["ms"] for r in sel], color=colors)
        ax.axvline(sel[0]["copy_floor_ms"], ls="--", color="gray", lw=1, label="gather/copy floor")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("one eviction round, all heads of one layer (ms)")
        ax.set_title(shape, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"Per-round eviction cost on {data['meta']['device']} ({data['meta'].get('threads', '?')} threads)",
                 fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)


def plot_batch_scaling(data: dict, out_dir=None, name: str = "bench_batch_scaling") -> list[Path]:
    """Throughput vs batch per policy (left) and each policy's per-round cost vs batch (right), from the result."""
    meta, rows = data["meta"], data["rows"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    style.apply()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, policy in enumerate(policies):
        sel = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["batch"])
        label = "full attention" if policy == "full" else policy
        kw = dict(marker="o", ms=4, color=style.PALETTE[i % len(style.PALETTE)], label=label,
                  ls="--" if policy == "full" else "-")
        axes[0].plot([r["batch"] for r in sel], [r["tokens_per_s"] for r in sel], **kw)
        if policy != "full":
            axes[1].plot([r["batch"] for r in sel], [r["ms_per_round"] for r in sel], **kw)
    for ax, label in ((axes[0], "decode throughput, all sequences (tokens/s)"),
                      (axes[1], "one round, one layer, whole batch (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(meta["batches"], [str(b) for b in meta["batches"]])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"{meta['new_tokens']} new tokens, K={meta['budget']}, r={meta['buffer']}: "
                 f"{style.model_label(meta['model'])} on {meta['device']} ({meta.get('torch_threads', '?')} threads), "
                 f"{meta['dtype'].replace('torch.', '')}",
                 fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
