"""One look for every figure: seaborn paper context, readable labels, PNG + PDF."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # figures are files; never open a window (CI, ssh, notebooks alike)
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

from analysis.files import FIGURE_METADATA, check_ours, replacing  # noqa: E402

PALETTE = sns.color_palette("colorblind")


def apply() -> None:
    sns.set_theme(context="paper", style="whitegrid", palette=PALETTE, font_scale=1.15,
                  rc={"axes.titleweight": "bold", "figure.dpi": 110, "savefig.bbox": "tight"})


def model_label(name) -> str:
    """The model as a title names it: the base name of what ``--model`` gave (a local folder's or GGUF file's name,
    not its whole path; a hub id's name after its organisation, ``Qwen/Qwen3-4B`` -> ``Qwen3-4B``; the embedded name
    as it is)."""
    text = str(name).rstrip("/\\")
    return Path(text).name or text


def geometry(config: dict) -> str:
    """``model, K=.., r=.., distance ..`` for titles and captions."""
    parts = [model_label(config["model"]), f"K={config['budget']}", f"r={config['buffer']}"]
    if "distance" in config:
        parts.append(f"distance {config['distance']}")
    parts.append(f"background: {config['policy']}{' + prompt' if config.get('protect_prompt') else ''}")
    return ", ".join(parts)


def errorbar(ax, x, est, **kw):
    """One point with its bootstrap CI (an :class:`randattn.stats.Estimate`)."""
    return ax.errorbar(x, est.value, yerr=[[est.value - est.lo], [est.hi - est.value]], fmt=kw.pop("fmt", "o"),
                       capsize=kw.pop("capsize", 3), **kw)


def targets(name: str, out_dir: "str | Path | None" = None) -> list[Path]:
    """The files :func:`save` writes: ``name.png`` and ``name.pdf`` in ``out_dir`` (default ``figures/``)."""
    out = Path(out_dir) if out_dir else Path("figures")
    return [out / f"{name}.png", out / f"{name}.pdf"]


def save(fig, name: str, out_dir: "str | Path | None" = None) -> list[Path]:
    """Write ``name.png`` and ``name.pdf`` into ``out_dir`` (default ``figures/`` under the current folder), each
    through a temporary file renamed into place (a kill leaves the old figure or the new one) and marked as
    randattn's in its metadata; a file there that randattn did not write raises ``NotOurs`` before either is
    written."""
    paths = targets(name, out_dir)
    try:
        for path in paths:
            check_ours(path)
        for path, dpi in zip(paths, (200, None)):
            fmt = path.suffix[1:]
            with replacing(path, check=False) as tmp:
                fig.savefig(tmp, format=fmt, metadata=FIGURE_METADATA[fmt], **({"dpi": dpi} if dpi else {}))
    finally:
        plt.close(fig)
    return paths
