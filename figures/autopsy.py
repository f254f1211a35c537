"""Eviction autopsy: per problem, position x (layer, KV head) map of what was held at the divergence, and the spans
that mattered (pinned back: sufficient; force-evicted from the full run: necessary)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from analysis.autopsy import unpack_mask

from . import style


def plot(rows: list[dict], out_dir=None, name: str = "autopsy", max_panels: int = 4) -> list[Path]:
    """Draw from the probe's rows (JSONL): the first ``max_panels`` problems that diverged."""
    shown = [r for r in rows if r.get("held")][:max_panels]
    if not shown:
        raise ValueError("no row diverged from full attention: nothing to map")
    style.apply()
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 2.6 * len(shown)), squeeze=False)
    for ax, r in zip(axes[:, 0], shown):
        n = r["divergence_pos"]
        held = np.array([[unpack_mask(h, n) for h in layer] for layer in r["held"]])  # [L, H, P]
        img = held.reshape(-1, n).astype(float)
        ax.imshow(img, aspect="auto", cmap="Greys_r", vmin=-0.3, vmax=1, interpolation="nearest")
        for s in r.get("spans") or []:
            ax.axvspan(s["start"] - 0.5, s["end"] - 0.5, color=style.PALETTE[3], alpha=0.45,
                       label=f"sufficient [{s['start']},{s['end']}) {s['text'][:24]!r}")
        for s in r.get("necessary") or []:
            ax.axvspan(s["start"] - 0.5, s["end"] - 0.5, color=style.PALETTE[0], alpha=0.35,
                       label=f"necessary [{s['start']},{s['end']}) {s['text'][:24]!r}")
        ax.axvline(r["prompt_len"] - 0.5, color=style.PALETTE[2], lw=1, ls="--", label="prompt end")
        layers, heads = len(r["held"]), len(r["held"][0])
        step = max(1, layers // 6)
        ax.set_yticks([l * heads for l in range(0, layers, step)], [f"L{l}" for l in range(0, layers, step)])
        ax.set_xlabel("position (the divergence at the right edge)")
        ax.set_title(f"{r['problem']} {r['policy']}: {r['status']} at token {r['divergence']} "
                     f"({r['full_token']!r} vs {r['evict_token']!r}); white = held, dark = evicted", fontsize=9)
        ax.legend(fontsize=7, loc="lower left")
        ax.grid(False)
    cfg = shown[0]["config"]
    fig.suptitle(f"Eviction autopsy: {style.model_label(cfg['model'])}, {cfg['task']}, K={cfg['budget']}, "
                 f"r={cfg['buffer']}", fontsize=10)
    fig.tight_layout()
    return style.save(fig, name, out_dir)
