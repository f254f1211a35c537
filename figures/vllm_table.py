"""The vLLM benchmark's table (docs/benchmarks.md, docs/vllm.md) from ``bench/vllm.json`` (``python -m bench.vllm``)."""

from __future__ import annotations

from figures.table_io import bench_footer, markdown, read_json

REL = "bench/vllm.json"


def command(meta: dict) -> str:
    """The command that made the file, from its own record."""
    hf = " ".join(str(b) for b in meta["hf_batches"])
    arms = meta.get("arms")
    # files before the selector arms (issue 39) ran the three arms that were then the default: no --arms needed
    arms = "" if arms in (None, ["vllm full", "vllm random", "hf random"]) else " --arms " + " ".join(
        f'"{a}"' for a in arms)
    return (f".venv-vllm/bin/python -m bench.vllm --requests {meta['requests']} --new-tokens {meta['new_tokens']} "
            f"--budget {meta['budget']} --buffer {meta['buffer']} --block-size {meta['block_size']} --blocks "
            f"{meta['blocks']} --hf-batches {hf} --threads {meta['torch_threads']}{arms}"
            + (f" --repeats {meta['repeats']}" if meta.get("repeats", 1) > 1 else ""))


_LABELS = {"vllm full": "vLLM, full attention", "vllm random": "vLLM + randattn Random",
           "vllm triattention": "vLLM + randattn TriAttention", "vllm rkv": "vLLM + randattn R-KV",
           "vllm h2o": "vLLM + randattn H2O"}


def _arm(r: dict) -> str:
    return _LABELS.get(r["arm"], f"HF engine (EvictingCache Random), batch {r['batch']}")


def _rounds(r: dict) -> str:
    """Seconds in the plugin's rounds: scoring, selecting, moving the pairs (read + write), H2O's attention pass."""
    t = r.get("round_s")
    if not t:
        return "–"
    return (f"{t['score']:.1f} / {t['select']:.1f} / {t['read'] + t['write']:.1f}"
            + (f" / {t['accumulate']:.1f}" if t.get("accumulate") else ""))


def _ratio(r: dict) -> str:
    """Random's tokens/s over the arm's; with repeats, the median of the within-repeat ratios and their range."""
    if not r.get("x_vllm_random"):
        return "–"
    lo_hi = r.get("x_vllm_random_range")
    return f"{r['x_vllm_random']:.2f}×" + (f" ({lo_hi[0]:.2f}–{lo_hi[1]:.2f})" if lo_hi else "")


def table() -> list[str]:
    data = read_json(REL)
    m, rows = data["meta"], data["rows"]
    body = []
    for r in rows:
        vllm = r["arm"].startswith("vllm")
        body.append([_arm(r), f"{r['kv_bytes'] / 2**20:,.1f}", f"{r['wall_s']:.0f} s", f"{r['total_tokens_per_s']:.1f}",
                     f"{r['output_tokens_per_s']:.1f}", f"{r['total_tokens_per_cpu_s']:.1f}",
                     f"{r['cpu_s'] / r['wall_s']:.2f}", f"**{r['x_vllm_full']:.2f}×**" if r["x_vllm_full"] else "–",
                     _ratio(r), _rounds(r),
                     f"{r['requests_finished']} / {r['batch']}",
                     str(r["peak_blocks_used"]) if vllm else "–",
                     f"{r['running_steps'] / r['steps']:.1f}" if vllm else str(r["batch"]), str(r["max_running"]),
                     str(r["preemptions"]) if vllm else "–", f"{r['tokens_computed']:,}" if vllm else "–"])
    header = ["arm", "KV MiB", "wall", "total tok/s", "output tok/s", "total tok per CPU s", "cores used",
              "× vLLM full", "Random ÷ this", "rounds s (score / select / move / H2O)", "finished", "peak blocks",
              "running (mean)", "running (max)", "preemptions", "tokens computed"]
    lo, hi = m["prompt_lengths"]
    note = (f"{m['requests']} requests × {m['new_tokens']:,} new tokens (prompts {lo}–{hi} tokens), "
            f"T={m['budget']}, r={m['buffer']}, block size {m['block_size']}: a full-attention request needs up to "
            f"{m['full_blocks_per_request']} blocks, an evicting one {m['capped_blocks_per_request']}; every vLLM arm "
            f"shares a pool of {m['blocks']} blocks. vLLM {m['vllm']}, torch {m['torch']}, {m['torch_threads']} threads, fp32. "
            "The HF rows run the first *b* requests as one left-padded batch (KV: the cache's own bytes). "
            "Cores used: the arm's CPU seconds over its wall time (2 = both cores all the time). Random ÷ this: "
            "vLLM + Random's total tokens/s over the arm's (the paper's serving headline is this ratio against its "
            "strongest selector). Rounds: the evicting arm's seconds in the plugin's rounds, scoring / selecting / "
            "moving the held pairs (read + compacted write) / H2O's attention pass.")
    if m.get("repeats", 1) > 1:
        note += (f" Every vLLM arm ran {m['repeats']} times, the arms' order rotated by one each repeat; wall, CPU and "
                 "round seconds are the medians, Random ÷ this the median of the ratios within each repeat (range in "
                 "brackets).")
    hf = [r for r in rows if "same_tokens_as_vllm_random" in r]
    if hf:
        note += (" Requests whose new tokens all equal vLLM + Random's (the same keys): "
                 + ", ".join(f"{r['same_tokens_as_vllm_random']} of {r['batch']} (HF, batch {r['batch']})" for r in hf)
                 + ".")
    return markdown(header, body) + ["", note, "", bench_footer(REL, command(m))]
